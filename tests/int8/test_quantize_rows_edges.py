"""quantize_rows keeps its promise (every value within row_scales / 2 of the table) where the
row parameters' dtype rounds the natural scale to 0 (a range under its smallest step: the
division by 0 gave garbage int8) or rounds the bias so far that [min, max] no longer fits 256
steps around it (float16 parameters of rows near 1000 were 61x past the bound)."""
import numpy as np
import pytest

from pkm_serve.quantized import quantize_rows

RNG = np.random.default_rng(0)
CASES = {
    "range under float16's smallest scale": (RNG.uniform(-1, 1, (4, 8)) * 1e-30, "float16"),
    "range under float32's smallest scale": (RNG.uniform(-1, 1, (4, 8)) * 1e-44, "float32"),
    "rows near 1000, float16 bias": (1000 + RNG.uniform(0, 1, (4, 8)), "float16"),
    "rows near 1000 of width 1e-5, float32 bias": (1000 + RNG.uniform(0, 1e-5, (4, 8)), "float32"),
    "ordinary rows": (RNG.uniform(-1, 1, (4, 8)), "float32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_value_within_half_a_scale(case):
    table, dtype = CASES[case]
    q, scales, biases = quantize_rows(table, dtype)
    s64, b64 = scales.astype(np.float64), biases.astype(np.float64)
    assert np.all(np.isfinite(s64)) and np.all(s64 > 0)
    err = np.abs(q * s64[:, None] + b64[:, None] - table).max(axis=1)
    assert np.all(err <= s64 / 2 * (1 + 1e-9)), (err, s64 / 2)
