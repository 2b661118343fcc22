"""quantize_table_int8 on rows an int8 row with a positive finite scale cannot hold as they
are: a NaN or infinity (the NaN became a row of small integers, scale 1; an infinity gave an
infinite scale the delegate refused at every request), and a row so small that max|row| / 127
rounds to 0 in float32 (a zero scale, refused the same way)."""
import numpy as np
import pytest

from pkm_serve import tflite


def _model(table):
    return tflite.build_embedding_bag_model(table.astype(np.float32), 2, combiner="sum")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_row_is_refused_naming_it(value):
    table = np.random.default_rng(0).uniform(-0.5, 0.5, (6, 8)).astype(np.float32)
    table[4, 3] = value
    with pytest.raises(ValueError, match=r"table 'params': row 4 of the table holds .*column 3.*NaN or infinity"):
        tflite.quantize_table_int8(_model(table))
    with pytest.raises(ValueError, match="row 4"):
        tflite.quantize_rows_int8(table)


def test_rows_too_small_for_a_float32_scale_still_run():
    table = np.random.default_rng(1).uniform(-1, 1, (5, 8)).astype(np.float32)
    table[2] *= np.float32(1e-44) / np.abs(table[2]).max()  # max|row| / 127 is 0 in float32
    table[3] = 0.0
    q, scales = tflite.quantize_rows_int8(table)
    assert np.all(scales > 0) and np.all(np.isfinite(scales))
    assert np.abs(q[2].astype(np.float32) * scales[2] - table[2]).max() <= scales[2]
    int8_model = tflite.quantize_table_int8(_model(table))
    idx = np.array([[2, 3], [0, 2], [1, 4]], np.int32)
    w = np.ones_like(idx, np.float32)
    (out,) = tflite.run_tflite(int8_model, [idx, w])
    dequantized = q.astype(np.float64) * scales[:, None]
    np.testing.assert_allclose(out, dequantized[idx].sum(axis=1), rtol=1e-6, atol=1e-45)
    np.testing.assert_allclose(out[2], table[[1, 4]].sum(axis=0), rtol=0, atol=2 * scales[[1, 4]].max())
