"""The shortest round-trip decimal (as str(np.float32(x)) prints it), which REST JSON writes
for float16 and bfloat16 outputs: the vectorised conversion must agree with it everywhere.
float32 outputs take TF Serving's WriteDecimal digits (test_serving_json_write_decimal.py)."""
import numpy as np

from pkm_serve.serving import tensors


def test_shortest_float32_matches_numpy_str_over_all_magnitudes():
    rng = np.random.default_rng(0)
    wide = np.clip(rng.standard_normal(60000) * 10.0 ** rng.integers(-45, 39, 60000), -3.4e38, 3.4e38).astype(np.float32)
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
    # 1/3 as "%.9g" (WriteDecimal<float>: "%g"'s 0.333333 does not read back as the float)
    assert json.dumps(tensors.to_json("y", arr)) == "[[0.1, 0.333333343], [2.5, -0.007]]"
    assert json.dumps(tensors.to_json("y", np.float32(0.1))) == "0.1"


def test_rest_json_codec_keeps_stdlib_semantics_where_orjson_differs():
    import json
    import math
    from pkm_serve.serving import rest_frontend
    assert rest_frontend.loads(b'{"x": [1, 2.5]}') == {"x": [1, 2.5]}
    assert rest_frontend.loads(b'{"x": 1180591620717411303424}') == {"x": 2 ** 70}   # stays an int
    assert math.isnan(rest_frontend.loads(b"[NaN]")[0])
    assert rest_frontend.dumps({"y": [0.1, 2]}) == b'{"y":[0.1,2]}'
    assert json.loads(rest_frontend.dumps({"y": [float("nan"), float("inf")]}).decode("ascii"),
                      parse_constant=str) == {"y": ["NaN", "Infinity"]}
    assert rest_frontend.dumps({"big": 2 ** 70}) == b'{"big": 1180591620717411303424}'


def test_long_fractions_take_the_fast_decoder_and_long_integers_do_not():
    from pkm_serve.serving import json_body
    assert not json_body.has_long_integer(b"[0.00026772439014166594, -1.5e-300]")
    assert json_body.has_long_integer(b"[1, -12345678901234567890123]")
    assert json_body.has_long_integer(b'{"x":\n 12345678901234567890}')


class _FakeExampleService:
    """Answers classify/regress with float32 scores/values that float64 would print noisily."""

    def classify(self, request, deadline=None):
        from tensorflow_serving.apis import classification_pb2
        resp = classification_pb2.ClassificationResponse()
        c = resp.result.classifications.add()
        c.classes.add(label="a", score=0.3)
        c.classes.add(label="b", score=0.7)
        return resp

    def regress(self, request, deadline=None):
        from tensorflow_serving.apis import regression_pb2
        resp = regression_pb2.RegressionResponse()
        resp.result.regressions.add(value=0.1)
        resp.result.regressions.add(value=float("nan"))
        return resp


def test_rest_classify_and_regress_print_float32_results_shortest():
    """TF Serving writes ClassificationResult scores and RegressionResult values with
    WriteDecimal(float): 0.3, not 0.30000001192092896 (what float64 makes of float32 0.3)."""
    from tensorflow_serving.apis import model_pb2
    from pkm_serve.serving import rest_frontend

    class _Front:
        service = _FakeExampleService()
        _example_input = staticmethod(rest_frontend.RestFrontend._example_input)

    doc = {"examples": [{"x": [0.5, 1.5]}]}
    classified = rest_frontend.RestFrontend._classify(_Front(), model_pb2.ModelSpec(name="m"), doc, None)
    assert rest_frontend.dumps(classified) == b'{"results":[[["a",0.3],["b",0.7]]]}'
    regressed = rest_frontend.RestFrontend._regress(_Front(), model_pb2.ModelSpec(name="m"), doc, None)
    assert rest_frontend.dumps(regressed).replace(b" ", b"") == b'{"results":[0.1,NaN]}'
