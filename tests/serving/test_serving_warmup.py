"""Model warmup as TF Serving does it (servables/tensorflow/saved_model_warmup.cc): replay
assets.extra/tf_serving_warmup_requests if the version has one, run nothing otherwise."""
import os

import numpy as np
import pytest

from pkm_serve.serving.servable import WARMUP_FILE, Servable


def _write_stateful(path):
    """serving_default: y = x * w and calls_to_bump = n; set_w assigns w; bump adds 1 to n."""
    import tensorflow as tf

    class S(tf.Module):
        def __init__(self):
            self.w = tf.Variable(2.0)
            self.n = tf.Variable(0, dtype=tf.int64)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def predict(self, x):
            return {"y": x * self.w, "calls_to_bump": tf.fill(tf.shape(x, out_type=tf.int64), self.n)}

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32, name="w")])
        def set_w(self, w):
            self.w.assign(w)
            return {"w": self.w.read_value()}

        @tf.function(input_signature=[])
        def bump(self):
            self.n.assign_add(1)
            return {"n": self.n.read_value()}

    m = S()
    tf.saved_model.save(m, path, signatures={"serving_default": m.predict.get_concrete_function(),
                                             "set_w": m.set_w.get_concrete_function(),
                                             "bump": m.bump.get_concrete_function()})
    return path


@pytest.fixture
def stateful(tmp_path, tf_with_ops):
    return _write_stateful(str(tmp_path / "stateful" / "1"))


def _predict(servable):
    sig = servable.signature("serving_default")
    return sig.run({"x": np.array([1.0, 3.0], np.float32)})


def test_no_warmup_file_runs_no_signature(stateful):
    # Before: every signature ran on zeros at load, so set_w set w = 0 and bump counted 1.
    servable = Servable("stateful", 1, stateful, warmup=True)
    try:
        out = _predict(servable)
        np.testing.assert_array_equal(out["y"], [2.0, 6.0])
        np.testing.assert_array_equal(out["calls_to_bump"], [0, 0])
    finally:
        servable.release()


def _write_warmup(path, *logs):
    import tensorflow as tf
    os.makedirs(os.path.join(path, "assets.extra"), exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(path, WARMUP_FILE)) as w:
        for entry in logs:
            w.write(entry.SerializeToString())


def test_warmup_file_is_replayed_and_only_it(stateful):
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2
    req = predict_pb2.PredictRequest()
    req.model_spec.signature_name = "bump"
    _write_warmup(stateful, prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=req)))
    servable = Servable("stateful", 1, stateful, warmup=True)
    try:
        out = _predict(servable)
        np.testing.assert_array_equal(out["y"], [2.0, 6.0])          # set_w did not run
        np.testing.assert_array_equal(out["calls_to_bump"], [1, 1])  # the record's bump did, once
    finally:
        servable.release()


def _example_requests():
    from tensorflow_serving.apis import classification_pb2, inference_pb2, regression_pb2
    from tensorflow_serving.apis import prediction_log_pb2 as plog

    def fill(input_proto):
        input_proto.example_list.examples.add().features.feature["x"].float_list.value.extend([0.5, 1.5])

    c = classification_pb2.ClassificationRequest()
    fill(c.input)
    r = regression_pb2.RegressionRequest()
    r.model_spec.signature_name = "regress"
    fill(r.input)
    m = inference_pb2.MultiInferenceRequest()
    task = m.tasks.add(method_name="tensorflow/serving/regress")
    # multi_inference.cc refuses a task without a model name, in warmup too (the name is not looked up)
    task.model_spec.name, task.model_spec.signature_name = "ex", "regress"
    fill(m.input)
    return [plog.PredictionLog(classify_log=plog.ClassifyLog(request=c)),
            plog.PredictionLog(regress_log=plog.RegressLog(request=r)),
            plog.PredictionLog(multi_inference_log=plog.MultiInferenceLog(request=m))]


def test_classify_regress_multi_inference_warmup_records_are_replayed(tmp_path, tf_with_ops, caplog):
    """TF Serving's saved_model_warmup.cc replays ClassifyLog, RegressLog and
    MultiInferenceLog records too; this refused the load ("only predict_log")."""
    from serving_helpers import write_example_model
    path = write_example_model(str(tmp_path / "ex" / "1"))
    _write_warmup(path, *_example_requests())
    with caplog.at_level("INFO", logger="pkm_serve.serving"):
        servable = Servable("ex", 1, path, warmup=True)
    servable.release()
    assert "model ex version 1: replayed 3 warmup requests" in [r.getMessage() for r in caplog.records]


def test_a_failing_classify_warmup_record_fails_the_load(tmp_path, tf_with_ops):
    from serving_helpers import write_example_model
    from pkm_serve.serving.errors import ServingError
    path = write_example_model(str(tmp_path / "ex" / "1"))
    bad = _example_requests()[0]
    bad.classify_log.request.model_spec.signature_name = "nope"
    _write_warmup(path, bad)
    with pytest.raises(ServingError, match="No signature was found with the name: nope"):
        Servable("ex", 1, path, warmup=True)


def test_num_request_iterations_for_warmup_replays_each_record_that_often(stateful, tmp_path):
    """TF Serving's --num_request_iterations_for_warmup (default 1): each record runs that
    many times; the flag was refused as not implemented."""
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2
    from serving_helpers import free_port
    from pkm_serve.serving import config
    from pkm_serve.serving.server import Server
    req = predict_pb2.PredictRequest()
    req.model_spec.signature_name = "bump"
    _write_warmup(stateful, prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=req)))
    base = os.path.dirname(stateful)
    for flags, bumps in (([], 1), (["--num_request_iterations_for_warmup=3"], 3),
                         (["--num_request_iterations_for_warmup=0"], 1),   # upstream: used only if > 0
                         (["--num_request_iterations_for_warmup=3", "--enable_model_warmup=false"], 0)):
        server = Server(config.parse_args([f"--model_base_path={base}", "--model_name=s", f"--port={free_port()}",
                                           "--load_pkm_ops=false", "--file_system_poll_wait_seconds=0", *flags]))
        server.start()
        try:
            with server.manager.serving(model_pb2.ModelSpec(name="s")) as servable:
                np.testing.assert_array_equal(_predict(servable)["calls_to_bump"], [bumps, bumps])
        finally:
            server.stop()
