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
    with pytest.raises(ValueError, match=r"table 'params' \(float32\): row 4 of the table holds .*column 3.*NaN or infinity"):
        tflite.quantize_table_int8(_model(table))
    with pytest.raises(ValueError, match="row 4"):
        tflite.quantize_rows_int8(table)


def test_rows_too_small_for_a_float32_scale_still_run():
    table = np.random.default_rng(1).uniform(-1, 1, (5, 8)).astype(np.float32)
    table[2] *= np.float32(1e-44) / np.abs(table[2]).max()  # max|row| / 127 is 0 in float32
    table[3] = 0.0
    for q, scales in [tflite.quantize_rows_int8(table)]:   # the symmetric form
        assert np.all(scales > 0) and np.all(np.isfinite(scales))
        assert np.abs(q[2].astype(np.float32) * scales[2] - table[2]).max() <= scales[2]
    q, scales, zero_points = tflite.quantize_rows_int8_affine(table)   # the .tflite's
    assert np.all(scales > 0) and np.all(np.isfinite(scales))
    dequantized = scales[:, None].astype(np.float64) * (q.astype(np.float64) - zero_points[:, None])
    assert np.abs(dequantized[2] - table[2]).max() <= scales[2]
    int8_model = tflite.quantize_table_int8(_model(table))
    idx = np.array([[2, 3], [0, 2], [1, 4]], np.int32)
    w = np.ones_like(idx, np.float32)
    (out,) = tflite.run_tflite(int8_model, [idx, w])
    np.testing.assert_allclose(out, dequantized[idx].sum(axis=1), rtol=1e-6, atol=1e-45)
    np.testing.assert_allclose(out[2], table[[1, 4]].sum(axis=0), rtol=0, atol=2 * scales[[1, 4]].max())


def _offset_table():
    """Rows away from 0 (the case symmetric int8 rows lose most on), mixed-sign rows,
    a constant row, a zero row and a row of two float32 neighbours near 1e6 (its zero
    point would pass int32 with a scale of (max - min) / 255)."""
    rng = np.random.default_rng(5)
    table = np.concatenate([rng.uniform(5, 6, (8, 16)), rng.uniform(-40, -39.5, (4, 16)),
                            rng.standard_normal((2, 16)), np.full((1, 16), 7.25),
                            np.zeros((1, 16)), 1e6 + 0.0625 * rng.integers(0, 2, (1, 16))])
    return table.astype(np.float32)


def test_affine_rows_keep_half_a_step_of_their_own_range():
    table = _offset_table()
    q, scales, zero_points = tflite.quantize_rows_int8_affine(table)
    x = table.astype(np.float64)
    step = (x.max(axis=1) - x.min(axis=1)) / 255.0
    s = scales.astype(np.float64)
    assert np.all(s > 0) and np.all(np.isfinite(s))
    assert np.all(s <= np.maximum(step * (1 + 1e-6), np.abs(x).max(axis=1) * 2.0 ** -23 * (1 + 1e-6))
                  + (step == 0))
    err = np.abs(s[:, None] * (q.astype(np.float64) - zero_points[:, None]) - x)
    assert np.all(err <= s[:, None] / 2 * (1 + 1e-9)), err.max()
    assert err[14].max() == 0 and err[15].max() == 0   # constant and zero rows: exact
    assert np.abs(zero_points).max() < 2 ** 24   # an int32 in TFLite, exact as float32


def test_offset_rows_in_a_tflite_within_half_a_step_in_every_interpreter(tmp_path):
    """The .tflite's int8 rows carry zero points: a row in [5, 6] keeps 1/510 per value
    (symmetric rows, zero point 0, kept 6/254 and failed this bound by 12x)."""
    from tests.reference import embedding_bag
    from tests.tflite.test_tflite import ALL_INTERPRETERS, run_in
    table = _offset_table()
    path = tmp_path / "int8.tflite"
    path.write_bytes(tflite.quantize_table_int8(_model(table)))
    rng = np.random.default_rng(6)
    idx = rng.integers(0, table.shape[0], (9, 2)).astype(np.int32)
    idx[0] = [0, 1]
    idx[1] = [9, 14]
    w = rng.uniform(0.5, 2.0, idx.shape).astype(np.float32)
    x = table.astype(np.float64)
    want = embedding_bag(x, idx, w)   # numpy float64 over the float table
    half_step = (x.max(axis=1) - x.min(axis=1)) / 510.0
    bound = (np.abs(w) * half_step[idx]).sum(axis=1)[:, None] * (1 + 1e-5) + \
        4 * np.finfo(np.float32).eps * (np.abs(w)[..., None] * np.abs(x)[idx]).sum(axis=1)
    outs = {}
    for interp in ALL_INTERPRETERS:
        (outs[interp],) = run_in(interp, str(path), [idx, w], tmp_path)
        err = np.abs(outs[interp].astype(np.float64) - want)
        assert np.all(err <= bound), (interp, float((err - bound).max()), float(err.max()))
    np.testing.assert_array_equal(outs["litert"], outs["tflite_runtime"])
    np.testing.assert_array_equal(outs["litert"], outs["tf"])


def test_quantizing_twice_says_the_tables_already_are_int8():
    once = tflite.quantize_table_int8(_model(_offset_table()))
    with pytest.raises(ValueError, match=r"1 int8 table\(s\) already: this model was quantized before"):
        tflite.quantize_table_int8(once)
