"""PkmRaggedEmbeddingBag (values + row_splits) in LiteRT, tf.lite and
tflite_runtime (the TF-free venv) through libpkm_tflite.so.

Models come from the real TF->TFLite converter applied to the TF op; the
reference is a numpy loop over the bags (float64, negative id = padding).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from tests.reference import ragged_embedding_bag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tflite import run_in  # noqa: E402  (in-process, or the TF-free venv)

N, D = 40, 6
RNG = np.random.default_rng(21)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
INTERPRETERS = ("litert", "tf", "tflite_runtime")


def convert(combiner, weighted, splits_dtype, table=TABLE):
    lib = ops.load_library()
    table = tf.constant(table)

    def bag(values, splits, weights):
        return lib.pkm_ragged_embedding_bag(
            table, values, splits, weights if weighted else tf.zeros([0]),
            combiner=combiner, has_weights=weighted)
    fn = tf.function(bag, input_signature=[tf.TensorSpec([None], tf.int64),
                                           tf.TensorSpec([None], splits_dtype),
                                           tf.TensorSpec([None], tf.float32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [fn.get_concrete_function()], fn)
    converter.allow_custom_ops = True
    return converter.convert()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ragged")
    paths = {}
    for key in [("sum", True, tf.int64), ("mean", True, tf.int32), ("sqrtn", True, tf.int64),
                ("mean", False, tf.int64)]:
        path = d / f"{key[0]}_{'w' if key[1] else 'nw'}_{key[2].name}.tflite"
        path.write_bytes(convert(*key))
        paths[key] = str(path)
    return paths


def bags(splits_dtype=np.int64):
    """Bags [3, 7] [] [0, -1 (padding), 12] [39] [] with positive weights."""
    values = np.array([3, 7, 0, -1, 12, 39], np.int64)
    splits = np.array([0, 2, 2, 5, 6, 6], splits_dtype)
    weights = RNG.uniform(0.2, 2.0, len(values)).astype(np.float32)
    return values, splits, weights


def run(interpreter, path, inputs, tmp_path):
    """The model's single output, from LiteRT / tf.lite in-process or the venv."""
    return run_in(interpreter, path, inputs, tmp_path)[0]


def ordered_inputs(path, values, splits, weights):
    """The converter orders inputs by name: map them onto the model's order."""
    by_role = {"values": values, "splits": splits, "weights": weights}
    details = tflite.make_interpreter(path, interpreter="litert").get_input_details()
    names = [d["name"] for d in details]
    return [next(v for role, v in by_role.items() if role in name) for name in names]


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_ragged_bags_match_numpy(models, interpreter, tmp_path):
    for (combiner, weighted, splits_dtype), path in models.items():
        values, splits, weights = bags(splits_dtype.as_numpy_dtype)
        got = run(interpreter, path, ordered_inputs(path, values, splits, weights), tmp_path)
        want = ragged_embedding_bag(TABLE, values, splits, weights if weighted else None, combiner)
        assert got.shape == (len(splits) - 1, D)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{interpreter} {combiner} weighted={weighted}")
        # TF's own op on the same inputs agrees too.
        lib = ops.load_library()
        tf_out = lib.pkm_ragged_embedding_bag(
            TABLE, values, splits, weights if weighted else np.zeros([0], np.float32),
            combiner=combiner, has_weights=weighted).numpy()
        np.testing.assert_allclose(got, tf_out, rtol=1e-6, atol=1e-6)


def test_int8_offset_rows_carry_zero_points(tmp_path):
    """quantize_table_int8 on the ragged op's table: rows in [5, 6] keep (max - min) / 510
    per value through the zero points (the symmetric rows' 6/254 fails this bound)."""
    table = (5.0 + np.random.default_rng(22).uniform(0, 1, (N, D))).astype(np.float32)
    path = tmp_path / "ragged_int8.tflite"
    path.write_bytes(tflite.quantize_table_int8(convert("sum", True, tf.int64, table)))
    values, splits, weights = bags()
    x = table.astype(np.float64)
    want = ragged_embedding_bag(x, values, splits, weights, "sum")
    half_step = np.r_[(x.max(axis=1) - x.min(axis=1)) / 510.0, 0.0][values]   # padding (-1): 0
    per_bag = np.array([(weights[a:b] * half_step[a:b]).sum() for a, b in zip(splits[:-1], splits[1:])])
    bound = per_bag[:, None] * (1 + 1e-5) + 1e-5
    for interpreter in INTERPRETERS:
        got = run(interpreter, str(path), ordered_inputs(str(path), values, splits, weights), tmp_path)
        err = np.abs(got.astype(np.float64) - want)
        assert np.all(err <= bound), (interpreter, float((err - bound).max()))


@pytest.mark.parametrize("interpreter", INTERPRETERS)
@pytest.mark.parametrize("case,splits,values,message", [
    ("first not 0", [1, 2, 3], [1, 2, 3], "row_splits"),
    ("decreasing", [0, 3, 2, 3], [1, 2, 3], "row_splits"),
    ("last != len(values)", [0, 1, 2], [1, 2, 3], "row_splits"),
    ("id out of range", [0, 2, 3], [1, N, 3], f"is out of range [0, {N})"),
])
def test_bad_ragged_input_is_a_clear_error(models, interpreter, tmp_path, case, splits, values,
                                           message):
    path = models[("sum", True, tf.int64)]
    values = np.array(values, np.int64)
    splits = np.array(splits, np.int64)
    weights = np.ones(len(values), np.float32)
    with pytest.raises(RuntimeError) as info:
        run(interpreter, path, ordered_inputs(path, values, splits, weights), tmp_path)
    text = str(info.value)
    assert "PkmRaggedEmbeddingBag" in text and message in text, (case, text)


def test_registration_symbol_for_cpp_apps():
    symbols = subprocess.run(["nm", "-D", "--defined-only", tflite.delegate_path()],
                             capture_output=True, text=True, check=True).stdout
    assert " PkmRaggedEmbeddingBagRegistration" in symbols
    assert " PkmEmbeddingBagRegistration" in symbols
