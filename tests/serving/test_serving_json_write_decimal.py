"""REST float32 outputs, classification scores and regression values carry the digits TF
Serving's json_tensor.cc WriteDecimal<float> writes: printf "%g" (six significant digits)
where strtof reads that back as the value, else "%.9g"; ".0" is added to a text without "."
or "e". They were each value's shortest decimal (1.2345678 where TF Serving writes
1.23456776: another number for a client reading JSON into float64)."""
from fractions import Fraction

import numpy as np
import orjson

from pkm_serve.serving import rest_frontend, tensors
from pkm_serve.serving.json_floats import write_decimal_float32


def _strtof(text):
    """The float32 nearest the decimal (ties to even), decided exactly."""
    exact = Fraction(text)
    f = np.float32(float(exact))
    candidates = (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf)))
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact), int(np.float32(c).view(np.uint32)) & 1))


def _write_decimal_text(x):
    text = "%.6g" % x
    if _strtof(text) != np.float32(x):
        text = "%.9g" % x
    return text if "." in text or "e" in text else text + ".0"


def _sample():
    rng = np.random.default_rng(7)
    wide = (rng.standard_normal(4000) * 10.0 ** rng.integers(-45, 39, 4000)).clip(-3.4e38, 3.4e38)
    bits = rng.integers(0, 2 ** 32, 6000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    special = [0.1, 1 / 3, 1.2345678, 100000.5, 999999.5, 1e6, 16777217, 3.4028235e38, 1e-45,
               1.17549435e-38, 9.999995e-5, 1e-4, 0.3, 2.5, -7e-3]
    values = np.concatenate([wide.astype(np.float32), bits[np.isfinite(bits)],
                             rng.standard_normal(6000).astype(np.float32), np.array(special, np.float32)])
    return values


def test_float32_values_are_the_numbers_write_decimal_prints():
    values = _sample()
    got = write_decimal_float32(values)
    expected = np.array([float(_write_decimal_text(x)) for x in values.tolist()])
    np.testing.assert_array_equal(got, expected)
    # Where "%g" has no exponent, the JSON text itself is upstream's.
    fixed = (np.abs(values) >= 1e-4) & (np.abs(values) < 1e6)
    texts = orjson.dumps(got[fixed].tolist()).decode()[1:-1].split(",")
    assert texts == [_write_decimal_text(x) for x in values[fixed].tolist()]


def test_rest_float32_outputs_and_results_print_upstream_digits():
    out = np.array([[1.2345678, 0.1], [3.0, 16777217.0]], np.float32)
    # By hand: "%g" of float32 1.2345678 is 1.23457, not that float, so "%.9g"; 16777217 is
    # the float 16777216, whose "%g" 1.67772e+07 is another float.
    assert rest_frontend.dumps({"outputs": tensors.to_json("y", out)}) == \
        b'{"outputs":[[1.23456776,0.1],[3.0,16777216.0]]}'
    scores = rest_frontend._float32_json([float(np.float32(1 / 3)), 0.5, float("nan")])
    assert rest_frontend.dumps({"results": scores}).replace(b" ", b"") == b'{"results":[0.333333343,0.5,NaN]}'


def test_nonfinite_and_zero_float32_outputs_keep_their_spelling():
    arr = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    assert rest_frontend.dumps({"y": tensors.to_json("y", arr)}).replace(b" ", b"") == \
        b'{"y":[NaN,Infinity,-Infinity,0.0,-0.0]}'
