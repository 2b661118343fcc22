"""MultiInference as TF Serving's multi_inference.cc runs it: one set of examples fed to
one input tensor, so every task's signature must read that same tensor."""
import grpc
import pytest
from tensorflow_serving.apis import inference_pb2

from serving_helpers import polled_manager, write_example_model
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.service import InferenceService


def _write_two_inputs(path):
    """classify reads tf_example_a, regress reads tf_example_b (both: feature x[2])."""
    import tensorflow as tf
    with tf.Graph().as_default():
        sigs = {}
        for key, tensor_name in (("classify", "tf_example_a"), ("regress", "tf_example_b")):
            serialized = tf.compat.v1.placeholder(tf.string, [None], name=tensor_name)
            x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32)})["x"]
            if key == "classify":
                classes = tf.tile(tf.constant([["a", "b"]]), [tf.shape(x)[0], 1])
                sigs[key] = tf.compat.v1.saved_model.classification_signature_def(
                    serialized, classes, tf.nn.softmax(x, axis=1))
            else:
                sigs[key] = tf.compat.v1.saved_model.regression_signature_def(serialized, tf.reduce_sum(x, 1))
        with tf.compat.v1.Session() as sess:
            builder = tf.compat.v1.saved_model.Builder(path)
            builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map=sigs)
            builder.save()


def _request(*tasks):
    req = inference_pb2.MultiInferenceRequest()
    for signature, method in tasks:
        t = req.tasks.add(method_name=method)
        t.model_spec.name = "m"
        t.model_spec.signature_name = signature
    req.input.example_list.examples.add().features.feature["x"].float_list.value.extend([0.5, 1.5])
    return req


CLASSIFY, REGRESS = "tensorflow/serving/classify", "tensorflow/serving/regress"


def test_tasks_reading_different_input_tensors_are_refused(tmp_path, tf_with_ops):
    _write_two_inputs(str(tmp_path / "m" / "1"))
    manager = polled_manager(tmp_path / "m", warmup=False)
    try:
        service = InferenceService(manager)
        with pytest.raises(ServingError) as err:
            service.multi_inference(_request(("classify", CLASSIFY), ("regress", REGRESS)))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message.startswith("Input tensor must be the same for all Signatures.")
        one = service.multi_inference(_request(("regress", REGRESS)))   # one task: fine
        assert one.results[0].regression_result.regressions[0].value == pytest.approx(2.0)
    finally:
        manager.stop()


def test_tasks_sharing_the_input_tensor_run(tmp_path, tf_with_ops):
    write_example_model(str(tmp_path / "m" / "1"))
    manager = polled_manager(tmp_path / "m", warmup=False)
    try:
        resp = InferenceService(manager).multi_inference(
            _request(("serving_default", CLASSIFY), ("regress", REGRESS)))
        assert [c.label for c in resp.results[0].classification_result.classifications[0].classes] == ["a", "b"]
        assert resp.results[1].regression_result.regressions[0].value == pytest.approx(2.0)
    finally:
        manager.stop()
