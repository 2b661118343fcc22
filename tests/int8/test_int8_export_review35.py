"""Two regressions found by review of round 35's int8 refusals: a float model with an int8
signature it does not export, made into a .tflite, was refused as "already int8" (the check read
every function of the SavedModel, not what the export runs); and a string output of numbers
(tf.strings.as_string of a score) was held to the fraction of differing strings, so every
rounding-level change failed the export and one wild number passed at the default tolerance."""

import os

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import quantized
from pkm_serve.export import ExportError, export_saved_model
from pkm_serve.export.quantize import relative_error

N, D, K = 40, 8, 3


def _table():
    return np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)


def test_a_float_signature_beside_an_int8_one_becomes_a_tflite(tmp_path):
    table = _table()

    class Mixed(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)
            self.int8_table = quantized.quantize_table(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            return {"out": tf.reduce_sum(tf.gather(self.table, ids), axis=1)}

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve_int8(self, ids):
            return {"out": quantized.embedding_bag(self.int8_table, ids)}

    model = Mixed()
    tf.saved_model.save(model, str(tmp_path / "src"), signatures={"serving_default": model.serve,
                                                                   "int8": model.serve_int8})
    tflite = str(tmp_path / "m.tflite")
    result = export_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"), signatures=["serving_default"],
                                tflite=tflite, quiet=True)
    assert result.fused and os.path.getsize(tflite) > 0


def test_string_outputs_of_numbers_are_compared_as_numbers():
    want = np.array([b"0.123456", b"1.500000", b"2.000000", b"3.0"] * 25, dtype=object)
    wild = want.copy()
    wild[0] = b"900.0"
    err, scale, relative = relative_error(want, wild)
    assert (err, scale) == pytest.approx((900.0 - 0.123456, 3.0)) and relative > 1e-2
    close = np.array([b"0.123457", b"1.500001", b"2.000001", b"3.00001"] * 25, dtype=object)
    assert relative_error(want, close)[2] == pytest.approx(1e-5 / 3.0, rel=1e-6)
    labels = np.array([b"cat", b"dog", b"cat", b"bird"], dtype=object)
    assert relative_error(labels, np.array([b"cat", b"dog", b"dog", b"bird"], dtype=object)) == (0.25, 1.0, 0.25)


def test_an_int8_export_of_a_model_scoring_as_text_passes_its_tolerance(tmp_path):
    table = _table()

    class Scores(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            return {"score_text": tf.strings.as_string(tf.reduce_sum(tf.gather(self.table, ids), axis=1),
                                                       precision=2)}

    model = Scores()
    tf.saved_model.save(model, str(tmp_path / "src"), signatures={"serving_default": model.serve})
    result = export_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"), quantize_table="int8", quiet=True)
    ids = tf.constant([[1, 2, 3], [4, 4, 0]])
    got = tf.saved_model.load(result.dst).signatures["serving_default"](ids=ids)["score_text"].numpy()
    want = table[[[1, 2, 3], [4, 4, 0]]].astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(got.astype(np.float64), want, atol=0.05)
    with pytest.raises(ExportError, match="already are int8"):
        export_saved_model(result.dst, str(tmp_path / "again"), quantize_table="int8", quiet=True)
