"""gRPC Predict output_filter checks, made before the model runs as predict_util.cc's
PreProcessPrediction makes them: a signature with a side effect (a counter it bumps) shows
whether a refused request ran it."""
import numpy as np
import pytest
import tensorflow as tf
from google.protobuf import text_format
from tensorflow_serving.apis import predict_pb2

from serving_helpers import polled_manager
from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.service import InferenceService


class _Counting(tf.Module):
    def __init__(self):
        super().__init__()
        self.calls = tf.Variable(0, dtype=tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def run(self, x):
        calls = self.calls.assign_add(1)
        return {"y": x * 2.0, "z": x + 1.0, "calls": tf.fill(tf.shape(x), calls)}


@pytest.fixture(scope="module", params=["direct", "batched"])
def service(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("filter") / "m"
    module = _Counting()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.run})
    manager = polled_manager(base)
    batcher = None
    if request.param == "batched":
        batcher = BatchScheduler(text_format.Parse("batch_timeout_micros { value: 1000 }",
                                                   protos.BatchingParameters()))
    yield InferenceService(manager, batcher=batcher)
    if batcher is not None:
        batcher.stop()
    manager.stop()


def _predict(service, *output_filter):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "m"
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0, 2.0], np.float32)))
    req.output_filter.extend(output_filter)
    return service.predict(req).outputs


def _calls(service):
    return int(tf.make_ndarray(_predict(service, "calls")["calls"])[0])


@pytest.mark.parametrize("output_filter, message", [
    (("y", "nosuch"), "output tensor alias not found in signature: nosuch Outputs expected to be in the set "
                      "{calls,y,z}."),
    (("y", "z", "y"), "duplicate output tensor alias: y"),
])
def test_a_bad_output_filter_is_refused_before_the_model_runs(service, output_filter, message):
    before = _calls(service)
    with pytest.raises(ServingError) as err:
        _predict(service, *output_filter)
    assert err.value.code.name == "INVALID_ARGUMENT" and message in err.value.message
    assert _calls(service) == before + 1   # only the second counting call ran


def test_a_filter_returns_exactly_the_outputs_named(service):
    outputs = _predict(service, "z", "y")
    assert sorted(outputs) == ["y", "z"]
    np.testing.assert_array_equal(tf.make_ndarray(outputs["z"]), [2.0, 3.0])
