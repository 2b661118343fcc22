"""`--quantize-table int8` refusals a user meets: a table holding NaN or infinity is one
ExportError naming the table variable and the row (it was a bare ValueError, "table has
non-finite values", naming neither, which the CLI reported as an unexpected failure), and
quantize_rows names the row; an export that already is int8, exported again with
--quantize-table int8 or with --tflite, says its tables already are int8 and what to export
instead (it advised converting to .tflite, which then failed on an unknown custom op)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import ExportError, export_saved_model
from pkm_serve.quantized import quantize_rows

N, D, K = 40, 8, 3


def _save_bag_model(path, table):
    class BagModel(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            return {"out": tf.reduce_sum(tf.gather(self.table, ids), axis=1)}

    model = BagModel()
    tf.saved_model.save(model, path, signatures={"serving_default": model.serve})


def _table():
    return np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_quantize_rows_names_the_non_finite_row(value):
    table = _table()
    table[17, 5] = value
    with pytest.raises(ValueError, match=r"row 17\b"):
        quantize_rows(table)


def test_a_nan_table_is_one_export_error_naming_table_and_row(tmp_path):
    table = _table()
    table[23, 2] = np.nan
    _save_bag_model(str(tmp_path / "src"), table)
    with pytest.raises(ExportError, match=r"(?s)table/\.ATTRIBUTES/VARIABLE_VALUE.*row 23\b"):
        export_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"), quantize_table="int8", quiet=True)


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    base = tmp_path_factory.mktemp("int8_again")
    _save_bag_model(str(base / "src"), _table())
    result = export_saved_model(str(base / "src"), str(base / "int8"), quantize_table="int8", quiet=True)
    return base, result.dst


def test_quantizing_an_int8_export_again_says_it_already_is(int8_export):
    base, int8_dir = int8_export
    with pytest.raises(ExportError, match="already are int8.*export it without --quantize-table"):
        export_saved_model(int8_dir, str(base / "again"), quantize_table="int8", quiet=True)


def test_a_tflite_of_an_int8_export_says_to_export_the_float_model(int8_export):
    base, int8_dir = int8_export
    with pytest.raises(ExportError, match=r"(?s)already are int8.*float model.*--quantize-table int8 --tflite"):
        export_saved_model(int8_dir, str(base / "again_tflite"), tflite=str(base / "m.tflite"), quiet=True)


def test_an_int8_export_exported_again_without_flags_still_serves(int8_export):
    base, int8_dir = int8_export
    result = export_saved_model(int8_dir, str(base / "plain"), quiet=True)
    ids = np.array([[1, 2, 3], [4, 4, 0]], np.int32)
    got = tf.saved_model.load(result.dst).signatures["serving_default"](ids=tf.constant(ids))["out"].numpy()
    want = tf.saved_model.load(int8_dir).signatures["serving_default"](ids=tf.constant(ids))["out"].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float_sites_beside_int8_bags_are_still_quantized(tmp_path):
    """A model with an int8 bag of its own (quantized.embedding_bag) and a float composite
    site: --quantize-table int8 quantizes the float site, and is not refused as 'already int8'."""
    from pkm_serve import quantized

    int8_table = quantized.quantize_table(_table())

    class Mixed(tf.Module):
        def __init__(self):
            self.table = tf.Variable(_table() * 2)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            return {"int8": quantized.embedding_bag(int8_table, ids),
                    "float": tf.reduce_sum(tf.gather(self.table, ids), axis=1)}

    model = Mixed()
    tf.saved_model.save(model, str(tmp_path / "src"), signatures={"serving_default": model.serve})
    result = export_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"), quantize_table="int8", quiet=True)
    assert [t["table"] for t in result.quantization["tables"]] == ["table/.ATTRIBUTES/VARIABLE_VALUE"]
