"""REST predict with 64-bit integer inputs (hashed ids are uint64) and outputs JSON cannot
hold, against what TF Serving's json_tensor.cc does: every JSON integer a uint64/int64
holds reaches the model exactly; a complex output is a 400 naming it."""

import numpy as np
import pytest

from serving_helpers import post_json, rest_predict_url

BIG = 2 ** 63 + 1   # a uint64 past int64: numpy mixes it with small ids into float64


def _write_model(path):
    import tensorflow as tf

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.uint64, name="ids")])
        def echo(self, ids):
            # Bitcast, not a numeric cast: the int64 bits show any rounding on the way in.
            return {"same": ids, "bits": tf.bitcast(ids, tf.int64)}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def to_complex(self, x):
            return {"c": tf.complex(x, x)}

    m = M()
    tf.saved_model.save(m, path, signatures={"serving_default": m.echo.get_concrete_function(),
                                             "complex": m.to_complex.get_concrete_function()})


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    base = tmp_path_factory.mktemp("ids") / "m"
    _write_model(str(base / "1"))
    with rest_predict_url(base) as url:
        yield url


@pytest.mark.parametrize("ids", [[BIG, 1], [2 ** 64 - 1, 0], [[2 ** 64 - 1], [5]]])
def test_uint64_ids_reach_the_model_exactly_in_both_formats(url, ids):
    """[2**63 + 1, 1] reached the model as [2**63, 1] (a float64 round trip), and
    [2**64 - 1, 0] was refused as out of the uint64 range."""
    flat = list(np.array(ids, dtype=object).reshape(-1))
    want_bits = np.array(flat, dtype=np.uint64).view(np.int64).tolist()
    status, body = post_json(url, {"inputs": {"ids": flat}})
    assert status == 200, body
    assert body["outputs"] == {"same": flat, "bits": want_bits}
    status, body = post_json(url, {"instances": [{"ids": v} for v in flat]})
    assert status == 200, body
    assert body["predictions"] == [{"same": v, "bits": b} for v, b in zip(flat, want_bits)]


# (2**64, past 64 bits, is a double to rapidjson: JsonValueToString prints it as a float, "%.9g")
@pytest.mark.parametrize("ids, first_outside", [([2 ** 64, 1], "1.84467441e+19"), ([-1, BIG], "-1")])
def test_ids_outside_uint64_are_refused(url, ids, first_outside):
    """In json_tensor.cc's words: the first value whose IsUint64() is false is a type error."""
    status, body = post_json(url, {"inputs": ids})
    assert (status, body["error"]) == (
        400, f"JSON Value: {first_outside} Type: Number is not of expected type: uint64 (input 'ids')")


def test_a_complex_output_is_a_400_naming_it(url):
    """json_tensor.cc: "Failed to write JSON value for tensor type: complex64" (was a 500,
    "internal error: TypeError: Object of type complex is not JSON serializable")."""
    status, body = post_json(url, {"signature_name": "complex", "inputs": [1.0]})
    assert status == 400
    assert body["error"].startswith("Failed to write JSON value for tensor type: complex64 (output 'c')")
