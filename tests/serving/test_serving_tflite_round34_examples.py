"""tf.Example requests (Classify, Regress, MultiInference) on .tflite versions, as TF Serving's
TfLiteSession serves them: the SignatureDefs of its signature_defs_metadata may share one string
input (MultiInference feeds it once); the converter's SignatureDefs each read their own
subgraph's input (refused, saying so, as the SavedModel's own signatures are); a model that
parses its examples with TFLite's ParseExample custom op cannot load (no kernel in the Python
interpreters) and says so. References: numpy on the request's serialized examples."""
import contextlib

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import inference_pb2

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError
from test_serving_tflite_signatures import _servable, _sigdef, _with_signature_defs_metadata

CLASSIFY, REGRESS = "tensorflow/serving/classify", "tensorflow/serving/regress"


def _example(value):
    import tensorflow as tf
    return tf.train.Example(features=tf.train.Features(
        feature={"x": tf.train.Feature(float_list=tf.train.FloatList(value=[value]))}))


MATCH = 1.0   # the model's "hit": an example equal to _example(MATCH)


@pytest.fixture(scope="module")
def models(tf_with_ops):
    """{name: .tflite bytes}: `metadata` (one string input, TF Serving SignatureDefs classify
    -> scores [hit, 1 - hit] and regress -> outputs 3 * hit + 1 reading it), `converter` (the
    same two as converter signatures), `parse_example` (tf.io.parse_example, allow_custom_ops)."""
    import tensorflow as tf
    target = _example(MATCH).SerializeToString()

    def hit(ex):
        return tf.cast(tf.equal(ex, target), tf.float32)
    # Keyed "inputs", as Classify and Regress want the one input of a signature (classifier.cc).
    spec = [tf.TensorSpec([None], tf.string, name="inputs")]

    class Model(tf.Module):
        @tf.function(input_signature=spec)
        def both(self, ex):
            return {"scores": tf.stack([hit(ex), 1 - hit(ex)], axis=1), "outputs": 3 * hit(ex) + 1}

        @tf.function(input_signature=spec)
        def classify(self, ex):
            return {"scores": tf.stack([hit(ex), 1 - hit(ex)], axis=1)}

        @tf.function(input_signature=spec)
        def regress_hits(self, ex):
            return {"outputs": 3 * hit(ex) + 1}

        @tf.function(input_signature=spec)
        def regress(self, ex):
            return {"outputs": 3 * tf.io.parse_example(ex, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]}
    m = Model()

    def convert(*functions, custom_ops=False):
        converter = tf.lite.TFLiteConverter.from_concrete_functions([f.get_concrete_function() for f in functions], m)
        converter.allow_custom_ops = custom_ops
        return converter.convert()
    both = convert(m.both)
    details = tflite.make_interpreter(both, use_delegate=False).get_output_details()
    outputs = {d["name"]: len(d["shape_signature"]) for d in details}
    scores, values = (next(n for n, rank in outputs.items() if rank == r) for r in (2, 1))
    metadata = _with_signature_defs_metadata(both, {
        "classify": _sigdef({"inputs": "serving_default_inputs:0"}, {"scores": scores}, CLASSIFY).SerializeToString(),
        "regress": _sigdef({"inputs": "serving_default_inputs:0"}, {"outputs": values}, REGRESS).SerializeToString()})
    return {"metadata": metadata, "converter": convert(m.classify, m.regress_hits),
            "parse_example": convert(m.regress, custom_ops=True)}


class _Version:
    def __init__(self, servable):
        self._servable = servable

    @contextlib.contextmanager
    def serving(self, _model_spec):
        yield self._servable


def _multi_inference(servable, values, tasks):
    from pkm_serve.serving.service import InferenceService
    req = inference_pb2.MultiInferenceRequest()
    for signature, method in tasks:
        task = req.tasks.add(method_name=method)
        task.model_spec.name, task.model_spec.signature_name = "m", signature
    for v in values:
        req.input.example_list.examples.add().CopyFrom(_example(v))
    return InferenceService(_Version(servable)).multi_inference(req)


def test_multi_inference_over_signatures_sharing_the_input(tmp_path, models):
    servable = _servable(tmp_path, models["metadata"])
    try:
        values = [MATCH, 2.0, MATCH, -1.0]
        resp = _multi_inference(servable, values, [("classify", CLASSIFY), ("regress", REGRESS)])
        hit = np.array([v == MATCH for v in values], np.float64)
        scores = [[c.score for c in cl.classes] for cl in resp.results[0].classification_result.classifications]
        np.testing.assert_array_equal(scores, np.stack([hit, 1 - hit], axis=1))
        np.testing.assert_array_equal([r.value for r in resp.results[1].regression_result.regressions], 3 * hit + 1)
        assert [r.model_spec.signature_name for r in resp.results] == ["classify", "regress"]
    finally:
        servable.release()


def test_multi_inference_over_converter_signatures_is_refused_saying_why(tmp_path, models):
    """Refused as TF Serving refuses the SavedModel's own two signatures; the message now says
    the converter's signatures can never share an input and what to do."""
    servable = _servable(tmp_path, models["converter"])
    try:
        with pytest.raises(ServingError) as err:
            _multi_inference(servable, [MATCH], [("classify", CLASSIFY), ("regress_hits", REGRESS)])
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        says = err.value.message
        assert says.startswith("Input tensor must be the same for all Signatures.") and \
            "each SignatureDef the TFLite converter wrote runs a subgraph of its own" in says, says
        one = _multi_inference(servable, [MATCH, 0.0], [("regress_hits", REGRESS)])   # one task: fine
        assert [r.value for r in one.results[0].regression_result.regressions] == [4.0, 1.0]
    finally:
        servable.release()


def test_parse_example_model_fails_the_load_naming_the_reason(tmp_path, models):
    """TF Serving registers TFLite's ParseExample kernel; the Python interpreters have none. The
    load failed with the interpreter's 'unresolved custom op' and a link to writing custom ops."""
    with pytest.raises(ServingError) as err:
        _servable(tmp_path, models["parse_example"])
    says = err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "parses tf.Example input with TFLite's ParseExample custom op" in says and \
        "serve this version from its SavedModel" in says and "ParseExampleV2" in says, says
