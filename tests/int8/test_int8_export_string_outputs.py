"""`--quantize-table int8` of a model with a string output (a class name looked up from the
bag's argmax, as TF Serving classifiers return them) besides its float one: the verification
failed with "could not convert string to float" (the CLI called it unexpected); a string output
is now held to --quantize-tolerance by the fraction of its elements that differ from the float
model's, reported as such, and the float outputs as before."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import export_saved_model
from pkm_serve.export.quantize import relative_error

N, D, K = 60, 6, 4
NAMES = [f"class_{i}" for i in range(D)]


def _save_classifier(path):
    table = np.random.default_rng(7).normal(size=(N, D)).astype(np.float32)

    class Classifier(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            scores = tf.reduce_sum(tf.gather(self.table, ids), axis=1)
            return {"scores": scores, "label": tf.gather(tf.constant(NAMES), tf.argmax(scores, axis=1))}

    model = Classifier()
    tf.saved_model.save(model, path, signatures={"serving_default": model.serve})


def test_a_string_output_is_measured_by_the_fraction_that_differs():
    want = np.array([b"a", b"b", b"c", b"d"])
    err, scale, relative = relative_error(want, np.array([b"a", b"x", b"c", b"d"]))
    assert relative == pytest.approx(np.mean(want != np.array([b"a", b"x", b"c", b"d"])))
    assert relative_error(want, want.copy())[2] == 0.0


def test_int8_export_of_a_model_with_a_string_output(tmp_path):
    src = str(tmp_path / "src")
    _save_classifier(src)
    result = export_saved_model(src, str(tmp_path / "dst"), quantize_table="int8", quiet=True)
    rows = {r["output"]: r for r in result.quantization["verification"]}
    ids = tf.constant(np.random.default_rng(1).integers(0, N, size=(32, K)).astype(np.int32))
    want = tf.saved_model.load(src).signatures["serving_default"](ids=ids)
    got = tf.saved_model.load(result.dst).signatures["serving_default"](ids=ids)
    float_err = np.abs(want["scores"].numpy() - got["scores"].numpy()).max() / np.abs(want["scores"].numpy()).max()
    assert float_err <= 1e-2 and rows["scores"]["relative_err"] <= 1e-2
    assert 0.0 <= rows["label"]["relative_err"] <= 1e-2
    np.testing.assert_array_equal(got["label"].numpy(), np.array(NAMES, dtype=object)[
        np.argmax(got["scores"].numpy(), axis=1)].astype(bytes))
