"""REST JSON prints float32 outputs by their shortest round-trip decimal (as
str(np.float32(x)) does); the vectorised conversion must agree with it everywhere."""
import numpy as np

from pkm_serve.serving import tensors


def test_shortest_float32_matches_numpy_str_over_all_magnitudes():
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(60000) * 10.0 ** rng.integers(-45, 39, 60000)).astype(np.float32)
    special = np.array([0.1, 0.5, 1 / 3, 100, 1e-8, 3.4e38, 0, -0.0, 1.17549435e-38, 1e-45, 16777217, 0.3,
                        1e-14, 9.999999e22, 1e23, np.inf, -np.inf], np.float32)
    values = np.concatenate([wide, rng.standard_normal(60000).astype(np.float32), special])
    got = tensors.shortest_float32_as_float64(values)
    expected = np.array([float(str(x)) for x in values])
    np.testing.assert_array_equal(got, expected)
    assert np.isnan(tensors.shortest_float32_as_float64(np.array([np.nan], np.float32))[0])


def test_to_json_keeps_shape_and_prints_short_decimals():
    import json
    arr = np.array([[0.1, 1 / 3], [2.5, -7e-3]], np.float32)
    assert json.dumps(tensors.to_json("y", arr)) == "[[0.1, 0.33333334], [2.5, -0.007]]"
    assert json.dumps(tensors.to_json("y", np.float32(0.1))) == "0.1"
