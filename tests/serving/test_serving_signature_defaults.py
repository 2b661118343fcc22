"""SignatureDef.defaults: a tf.function's default arguments, which tf.saved_model.save writes
into the signature; TF Serving's Predict (GetInputValues in tensorflow/cc/saved_model/util.cc)
feeds them for the inputs a request leaves out."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2

from serving_helpers import polled_manager
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.service import InferenceService

SCALE_DEFAULT, SHIFT_DEFAULT = 2.5, 7


class _Scaler(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32),
                                  tf.TensorSpec([], tf.int64)])
    def scale(self, x, scale=tf.constant(SCALE_DEFAULT), shift=tf.constant(SHIFT_DEFAULT, tf.int64)):
        return {"y": x * scale + tf.cast(shift, tf.float32)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.float32)])
    def plain(self, x, scale):
        return {"y": x * scale}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    base = tmp_path_factory.mktemp("defaults") / "m"
    module = _Scaler()
    tf.saved_model.save(module, str(base / "1"),
                        signatures={"serving_default": module.scale, "plain": module.plain})
    manager = polled_manager(base)
    yield InferenceService(manager)
    manager.stop()


def _predict(service, signature="", **inputs):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m"
    request.model_spec.signature_name = signature
    for k, v in inputs.items():
        request.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return tf.make_ndarray(service.predict(request).outputs["y"])


@pytest.mark.parametrize("given, scale, shift", [
    ({}, SCALE_DEFAULT, SHIFT_DEFAULT),
    ({"scale": np.float32(-1.0)}, -1.0, SHIFT_DEFAULT),
    ({"shift": np.int64(100)}, SCALE_DEFAULT, 100),
    ({"scale": np.float32(3.0), "shift": np.int64(0)}, 3.0, 0),
])
def test_inputs_left_out_are_fed_their_default(service, given, scale, shift):
    x = np.array([1.0, -2.0, 0.5], np.float32)
    got = _predict(service, x=x, **given)
    np.testing.assert_array_equal(got, x * np.float32(scale) + np.float32(shift))


def test_an_input_without_a_default_is_still_required(service):
    with pytest.raises(ServingError) as err:
        _predict(service, "plain", x=np.array([1.0], np.float32))
    # predict_util.cc's VerifyRequestInputsSize: "plain" has no defaults to fill the gap.
    assert err.value.code.name == "INVALID_ARGUMENT" and err.value.message == (
        "input size does not match signature: 1!=2 len({x}) != len({scale,x}). Sent extra: {}. "
        "Missing but required: {scale}.")


@pytest.mark.parametrize("given, message", [
    # Fewer inputs than the signature's pass the size check where it has defaults; then
    # saved_model::GetInputValues names the one without a default, or the name it does not know.
    ({"scale": np.float32(1.0), "z": np.float32(1.0)},
     "Signature input alias: x(feed name: serving_default_x:0) not found in request and no default value provided. "
     "Inputs expected to be in the request {scale,z}, or default input alias set: scale,shift"),
    ({"x": np.array([1.0], np.float32), "z": np.float32(1.0)},
     "Inputs contains invalid name. Used request inputs: x, request input: x,z")])
def test_input_names_are_checked_in_get_input_values_words(service, given, message):
    """The words were this server's ("missing input(s) ['x']", "unknown input(s) ['z']")."""
    with pytest.raises(ServingError) as err:
        _predict(service, **given)
    assert err.value.code.name == "INVALID_ARGUMENT" and err.value.message == message
