"""Keras 3 mixed precision (`mixed_float16` / `mixed_bfloat16`): Embedding casts
the float32 rows to the compute dtype, GlobalAveragePooling1D / keras.ops.mean
casts them back to float32 for the mean (gather -> Cast(half) -> Cast(float32)
-> Mean -> Cast(half)). Those sites were skipped ("Cast -> Cast between the
gather and the reduction"); they are fused, the op summing the float32 rows
without the half rounding, within the half dtype's tolerance of the original."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 300, 16, 6
TOLERANCE = {"mixed_float16": 1e-2, "mixed_bfloat16": 3e-2}  # pkm_serve.export.verify.TOLERANCES


def _keras_mixed(path, policy, pooling, mask_zero=False, seed=3):
    """Keras 3 Embedding -> mean over the bag (GlobalAveragePooling1D, "gap", or
    keras.ops.mean) under a mixed-precision policy, exported with model.export.
    mask_zero: the rows and the mask are summed in the compute dtype and divided in it."""
    import keras
    keras.mixed_precision.set_global_policy(policy)
    try:
        ids = keras.Input((K,), dtype="int32", name="ids")
        emb = keras.layers.Embedding(N, D, mask_zero=mask_zero, name="emb")
        rows = emb(ids)
        out = keras.layers.GlobalAveragePooling1D()(rows) if pooling == "gap" else keras.ops.mean(rows, axis=1)
        model = keras.Model(ids, out)
        table = np.random.default_rng(seed).normal(size=(N, D)).astype(np.float32)
        emb.embeddings.assign(table)
        model.export(str(path), format="tf_saved_model", verbose=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return table


def _call(path, ids):
    out = tf.saved_model.load(str(path)).signatures["serving_default"](ids=tf.constant(ids))
    (value,) = out.values()
    return value


@pytest.mark.parametrize("pooling", ["gap", "ops_mean"])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_mixed_precision_embedding_mean_is_fused(tmp_path, policy, pooling):
    table = _keras_mixed(tmp_path / "m", policy, pooling)
    half = policy.split("_")[1]
    for quantize in (None, "int8"):
        result = export_saved_model(str(tmp_path / "m"), str(tmp_path / f"out_{quantize}"), quiet=True,
                                    quantize_table=quantize)
        assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
        assert [(s.dtype, s.cast_to, s.rounded_to) for s in result.sites] == [("float32", "float32", half)]
        ids = np.random.default_rng(4).integers(0, N, (64, K)).astype(np.int32)
        want, got = _call(tmp_path / "m", ids), _call(result.dst, ids)
        assert got.dtype == want.dtype == tf.as_dtype(half)
        want, got = want.numpy().astype(np.float64), got.numpy().astype(np.float64)
        scale = np.abs(want).max()
        tol = TOLERANCE[policy] if quantize is None else TOLERANCE[policy] + 1e-2  # + int8 rows
        assert np.abs(got - want).max() <= tol * scale
        np.testing.assert_allclose(got, table.astype(np.float64)[ids].mean(1), atol=tol * scale)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_mixed_precision_masked_mean_converts_to_tflite(tmp_path, policy):
    """The mask count and the division after the fused bag were left in half
    precision, which TFLite has no SUM / DIV for: --tflite failed ("custom ops
    ['RealDiv', 'Sum']"). They are counted and divided in float32 and cast back."""
    from pkm_serve import tflite
    table = _keras_mixed(tmp_path / "m", policy, "gap", mask_zero=True, seed=5)
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                tflite=str(tmp_path / "m.tflite"))
    assert [(s.status, s.computes) for s in result.sites] == [("fused", "masked mean")]
    ids = np.random.default_rng(6).integers(0, N, (64, K)).astype(np.int32)
    ids[::3, K // 2:] = 0  # padding (mask_zero)
    ids[5] = 0  # an all-padding bag: 0 / 0, NaN in both
    keep = (ids != 0).astype(np.float64)
    with np.errstate(invalid="ignore"):
        expected = np.einsum("bk,bkd->bd", keep, table.astype(np.float64)[ids]) / keep.sum(1)[:, None]
    want = _call(tmp_path / "m", ids).numpy().astype(np.float64)
    got = _call(result.dst, ids).numpy().astype(np.float64)
    lite = tflite.run_tflite(str(tmp_path / "m.tflite"), [ids], interpreter="litert")[0].astype(np.float64)
    scale = np.nanmax(np.abs(expected))
    for out in (want, got, lite):
        assert np.array_equal(np.isnan(out), np.isnan(expected))
        np.testing.assert_allclose(out, expected, atol=TOLERANCE[policy] * scale)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[policy] * scale)
