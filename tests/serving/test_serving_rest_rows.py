"""REST row-format answers ("instances" -> "predictions") as json_tensor.cc's
MakeRowFormatJsonFromTensors writes them: the rows are dimension 0 of the outputs, which must
agree with each other but need not be the count of instances; float16 in and out."""

import numpy as np
import pytest
import tensorflow as tf

from serving_helpers import post_json, rest_predict_url


class _Shapes(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def flat(self, x):
        return {"y": tf.reshape(x, [-1])}          # two rows per instance

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def first(self, x):
        return {"y": x[:1], "label": tf.constant([b"first"])}   # one row, whatever the instances

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def mixed(self, x):
        return {"a": x, "b": tf.reshape(x, [-1])}

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def total(self, x):
        return {"s": tf.reduce_sum(x)}

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def none(self, x):
        return {"y": x[:0]}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float16)])
    def half(self, x):
        return {"y": x * tf.constant(3.0, tf.float16)}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    base = tmp_path_factory.mktemp("rows") / "m"
    module = _Shapes()
    tf.saved_model.save(module, str(base / "1"), signatures={
        name: getattr(module, name) for name in ("flat", "first", "mixed", "total", "none", "half")})
    with rest_predict_url(base) as url:
        yield url


X = [[1.5, -2.0], [0.25, 4.0]]


def test_outputs_with_other_rows_than_the_instances_are_answered_by_their_own_rows(url):
    """It was a 400 (output 'y' does not have the 2 instances as dimension 0)."""
    status, body = post_json(url, {"signature_name": "flat", "instances": X})
    assert status == 200, body
    assert body == {"predictions": np.reshape(X, [-1]).tolist()}
    status, body = post_json(url, {"signature_name": "first", "instances": X})
    assert status == 200, body
    assert body == {"predictions": [{"y": X[0], "label": "first"}]}


@pytest.mark.parametrize("signature, message", [
    ("mixed", "Tensor name: b has inconsistent batch size: 4 expecting: 2"),
    ("total", "Tensor name: s has no shape information"),
    ("none", "Tensor name: y has invalid batch size: 0"),
])
def test_outputs_without_common_rows_are_refused_in_tf_servings_words(url, signature, message):
    status, body = post_json(url, {"signature_name": signature, "instances": X})
    assert status == 400 and body["error"].startswith(message), body
    status, body = post_json(url, {"signature_name": signature, "inputs": X})
    assert status == 200, body   # the columnar format answers them


def test_float16_inputs_and_outputs_round_trip(url):
    """An extension: json_tensor.cc refuses DT_HALF both ways (Conversion of JSON Value ...
    to type: half; Failed to write JSON value for tensor type: half)."""
    x = [0.1, -2.5, 1000 / 3, 1e-3]
    want = np.array(x, np.float16) * np.float16(3)
    for body in ({"signature_name": "half", "inputs": x}, {"signature_name": "half", "instances": x}):
        status, answer = post_json(url, body)
        assert status == 200, answer
        got = np.array(next(iter(answer.values())), np.float64).astype(np.float16)
        np.testing.assert_array_equal(got, want)


def test_float16_outputs_print_as_the_shortest_decimal_of_the_half():
    """numpy's repr of each half is the reference; they were printed by float32's shortest
    repr of the half's value (a half 0.1 as 0.099975586)."""
    from pkm_serve.serving import tensors
    values = np.array([0.1, -0.3, 65504, 6e-8, 1e-3, 2049, np.inf, 1 / 3, 0, 0.015625], np.float16)
    got = tensors.to_json("y", values)
    assert got[:6] == [0.1, -0.3, 65500.0, 6e-08, 0.001, 2048.0]
    # Every finite half (0.015625 is 0.01563: the decimal above it, not the nearest 0.01562,
    # is the one of four digits that reads back as it; it printed as 0.015625).
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    every = np.concatenate([values, every[np.isfinite(every)]])
    assert tensors.to_json("y", every) == [float(str(v)) for v in every]
