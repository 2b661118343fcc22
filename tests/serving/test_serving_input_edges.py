"""Edge cases of turning request inputs into tensors, against TF Serving 2.21's
json_tensor.cc (REST) and its TensorProto checks (gRPC): each bad input is
INVALID_ARGUMENT naming the problem, never a silently different value."""
import base64
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from pkm_serve.serving import rest_frontend, tensors
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.rest_frontend import RestFrontend, _may_spell_bools, loads


def _spec(dtype):
    return tf.TensorSpec(None, dtype)


# json_tensor.cc's TypeError: "JSON Value: <v> Type: <True|False> is not of expected type:
# <DataTypeString>"; AddValueToTensor takes only IsNumber()/IsInt64()... values for numbers.
@pytest.mark.parametrize("value, dtype, shown, type_name", [
    ([[True, 2]], tf.int64, "true", "int64"),
    ([[1], [False]], tf.int32, "false", "int32"),
    ([3, True, 2.5], tf.int64, "true", "int64"),
    ([True, 2.5], tf.float32, "true", "float"),
    ([[1.0, 2.0], [3.0, False]], tf.float64, "false", "double"),
    ([7, True], tf.uint64, "true", "uint64"),
])
def test_a_json_boolean_among_numbers_is_refused(value, dtype, shown, type_name):
    """numpy reads [true, 2] as [1, 2]: the model got 1 for a JSON true."""
    with pytest.raises(ServingError) as err:
        tensors.from_json("ids", value, _spec(dtype))
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert str(err.value.message) == (f"JSON Value: {shown} Type: {shown.capitalize()} is not of "
                                      f"expected type: {type_name} (input 'ids')")


def test_rest_predict_paths_refuse_booleans_in_both_formats():
    specs = {"ids": _spec(tf.int64)}
    for call, value in ((RestFrontend._rows_to_inputs, [{"ids": [True, 2]}]),
                        (RestFrontend._columns_to_inputs, {"ids": [[True, 2]]})):
        with pytest.raises(ServingError, match=r"JSON Value: true Type: True is not of expected type: int64"):
            call(value, specs, _may_spell_bools(json.dumps({"x": value}).encode()))


def test_the_boolean_scan_is_skipped_only_for_bodies_that_cannot_spell_one():
    assert not _may_spell_bools(b'{"inputs": [[1, 2], [3.5, -4e3]]}')
    assert _may_spell_bools(b'{"inputs": [true, 2]}') and _may_spell_bools(b'{"inputs": [false]}')
    # json.loads reads UTF-16 bodies too, where b"true" is not a substring: they are refused
    # before the scan, as rapidjson reads every body as UTF-8
    utf16 = '{"inputs": [true, 2]}'.encode("utf-16")
    assert json.loads(utf16) == {"inputs": [True, 2]}
    with pytest.raises(ServingError, match="JSON Parse error: Invalid value. at offset: 0$"):
        loads(utf16)
    assert tensors.from_json("ids", [1, 2], _spec(tf.int64), may_hold_bools=False).tolist() == [1, 2]


@pytest.mark.parametrize("value, dtype", [
    ([1, 2], tf.int64), ([[1.5, 2], [3, -4]], tf.float32), ([True, False], tf.bool),
    ([[0, 255]], tf.uint8), ([2 ** 63 + 1, 1], tf.uint64), (5, tf.int32), ([], tf.float32),
])
def test_well_typed_values_still_arrive_exactly(value, dtype):
    got = tensors.from_json("x", value, _spec(dtype))
    want = np.array(value, dtype=dtype.as_numpy_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("value, dtype, message", [
    ([1, "a"], tf.int64, 'JSON Value: "a" Type: String is not of expected type: int64'),
    (["1.0"], tf.float32, 'JSON Value: "1.0" Type: String is not of expected type: float'),
    ([1], tf.string, "holds 1, which is not of the signature's type string"),
    ([[1, 2], [3]], tf.float32, "ragged"),
    ([[1, 2], 3], tf.int64, "ragged"),
    ([None, 1], tf.int64, "JSON Value: null Type: Null is not of expected type: int64"),
    ([{"b64": "AA=="}], tf.int64, 'JSON Value: {"b64":"AA=="} Type: Object is not of expected type: int64'),
    ([1, 2 ** 31], tf.int32, "JSON Value: 2147483648 Type: Number is not of expected type: int32"),
    ([-(2 ** 31) - 1], tf.int32, "JSON Value: -2147483649 Type: Number is not of expected type: int32"),
    ([1e39], tf.float32, "Cannot convert JSON value: 1e+39 to float without loss of precision."),
    ([1.0], tf.int64, "JSON Value: 1.0 Type: Number is not of expected type: int64"),
    ([1, 0], tf.bool, "JSON Value: 1 Type: Number is not of expected type: bool"),
])
def test_json_inputs_tf_serving_refuses_are_invalid_argument(value, dtype, message):
    with pytest.raises(ServingError) as err:
        tensors.from_json("x", value, _spec(dtype))
    assert err.value.code.name == "INVALID_ARGUMENT" and message in err.value.message


@pytest.mark.parametrize("raw", [b"\x00", b"ab", b"abc", b"\xff\xfe\x00\x01\x02", b""])
def test_base64_without_padding_or_with_line_breaks_decodes_as_in_tf_serving(raw):
    """absl::Base64Unescape (json_tensor.cc) takes unpadded base64 and skips blanks; Python's
    strict decoder refused "AA" for b"\\x00" with a 400."""
    padded = base64.b64encode(raw).decode("ascii")
    for text in (padded, padded.rstrip("="), "\n".join(padded[i:i + 2] for i in range(0, len(padded), 2))):
        got = tensors.from_json("x_bytes", [{"b64": text}], _spec(tf.string))
        assert got.tolist() == [raw], text
    feature = rest_frontend._feature([{"b64": padded.rstrip("=")}], "f")
    assert list(feature.bytes_list.value) == [raw]


@pytest.mark.parametrize("text", ["A", "AA=", "AAAA=", "AA==AA", "-_8=", "QU JD*", "é"])
def test_base64_tf_serving_refuses_is_still_refused(text):
    with pytest.raises(ServingError, match="Unable to base64 decode"):
        tensors.from_json("x_bytes", [{"b64": text}], _spec(tf.string))


@pytest.mark.parametrize("value", [[["a"], "b"], [["a", "b"], ["c"]], [[], ["c"]], ["a", []], ["a", ["b"]],
                                   [[["a"]], [["b", "c"]]], [[{"b64": "AA=="}], "x"]])
def test_ragged_string_inputs_are_refused(value):
    """numpy's dtype=object kept the short rows as list elements: [["a"], "b"] became a
    1-D tensor holding a Python list (json_tensor.cc: "found at incorrect level")."""
    with pytest.raises(ServingError, match="input 's' is ragged: all rows must have the same shape"):
        tensors.from_json("s", value, _spec(tf.string))


@pytest.mark.parametrize("value, shape", [([], (0,)), ([[], []], (2, 0)), ("a", ()), ([["a", "b"]], (1, 2))])
def test_dense_string_inputs_keep_their_shape(value, shape):
    def utf8(v):
        return [utf8(x) for x in v] if isinstance(v, list) else v.encode("utf-8")

    got = tensors.from_json("s", value, _spec(tf.string))
    assert got.shape == shape and got.tolist() == utf8(value)


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400", b"1.5e310", b"1e0309", b"12.25e311", b"1" * 310 + b".5", b"1." + b"0" * 20 + b"e326",
                                     # an integer literal past DBL_MAX (it was read as an int; 4300+ digits a 500 ValueError)
                                     b"2" + b"0" * 308, b"-" + b"1" * 310, b"9" * 5000, b"1E+309"])
def test_a_number_literal_past_the_double_range_is_a_parse_error(literal):
    """rapidjson refuses it (kParseErrorNumberTooBig, at the literal's start: an exponent over
    308 less the fraction digits, an integer part past DBL_MAX); Python's json read 1e400 as
    Infinity and the model ran on it."""
    with pytest.raises(ServingError, match="JSON Parse error: Number too big to be stored in double. at offset: 17$"):
        rest_frontend.loads(b'{"inputs": [1.5, ' + literal + b"]}")


def test_numbers_of_a_body_python_reads_are_judged_only_where_one_may_be_too_big(monkeypatch):
    """A Python call for every number (a NaN among 200k floats such as 1.5e-06 or 1.5e+20)
    took 4-16x the parse: numbers are judged only where the body spells a 3-digit exponent or a
    309-digit run."""
    from pkm_serve.serving import json_body
    judged = []
    monkeypatch.setattr(json_body, "_rapidjson_float", lambda text: judged.append(text) or float(text))
    assert rest_frontend.loads(b'{"inputs": [NaN, 1.5e-06, 1.5e+20, 2.5E99, 3]}')["inputs"][1:] == [1.5e-06, 1.5e+20, 2.5e99, 3]
    assert judged == []
    assert rest_frontend.loads(b'{"inputs": [NaN, 1.5e-06, 1.5e+200]}')["inputs"][1:] == [1.5e-06, 1.5e+200]
    assert judged == ["1.5e-06", "1.5e+200"]


@pytest.mark.parametrize("literal, value", [(b"1" + b"0" * 308, 10 ** 308), (b"1.8e308", np.inf), (b"1.5e309", np.inf), (b"1." + b"0" * 20 + b"e325", np.inf), (b"-123456789e301", -np.inf), (b"1.25e308", 1.25e308)])
def test_a_literal_rapidjson_reads_past_the_double_range_is_infinity(literal, value):
    """Within ParseNumber's exponent limit its double overflows to infinity, which json_tensor.cc
    lets through (IsLosslessDecimal); Python's json gives the same double."""
    assert rest_frontend.loads(b'{"inputs": [1.5, ' + literal + b"]}")["inputs"] == [1.5, value]


@pytest.mark.parametrize("value, dtype", [([10 ** 400], tf.float32), ([1.5, -(10 ** 309)], tf.float64),
                                          ([[1, 2], [3, 10 ** 400]], tf.int64)])
def test_an_integer_past_the_double_range_is_named_not_called_ragged(value, dtype):
    with pytest.raises(ServingError, match=r"JSON Parse error: Number too big to be stored in double \(input 'x'\)"):
        tensors.from_json("x", value, _spec(dtype))


def test_literals_in_the_double_range_and_nan_infinity_still_parse():
    doc = rest_frontend.loads(b'{"inputs": [1.7976931348623157e308, -1e-400, Infinity, NaN, -Infinity]}')
    values = doc["inputs"]
    assert values[:2] == [1.7976931348623157e308, -0.0] and values[2] == float("inf")
    assert values[3] != values[3] and values[4] == float("-inf")


def test_nan_and_infinity_literals_pass_to_float_inputs():
    """IsLosslessDecimal returns true for a non-finite double."""
    got = tensors.from_json("x", [float("nan"), float("inf"), float("-inf")], _spec(tf.float32))
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got.dtype == np.float32


def _proto(dtype, shape, **fields):
    proto = tensor_pb2.TensorProto(dtype=dtype)
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    for field, value in fields.items():
        if isinstance(value, bytes):
            setattr(proto, field, value)
        else:
            getattr(proto, field).extend(value)
    return proto


@pytest.mark.parametrize("proto, message", [
    (_proto(types_pb2.DT_FLOAT, [1], tensor_content=b"abc"), "tensor_content holds 3 bytes"),
    (_proto(types_pb2.DT_FLOAT, [1], half_val=[1]),
     "holds 0 values but its shape [1] needs 1 (DT_FLOAT reads float_val; the values are in half_val)"),
    (_proto(types_pb2.DT_INT64, [2], bool_val=[True, False]),
     "holds 0 values but its shape [2] needs 2 (DT_INT64 reads int64_val; the values are in bool_val)"),
    (_proto(types_pb2.DT_COMPLEX64, [1], scomplex_val=[1.0]),
     "(scomplex_val holds (real, imaginary) pairs: an odd count of 1 numbers)"),
])
def test_malformed_tensor_protos_are_invalid_argument(proto, message):
    with pytest.raises(ServingError) as err:
        tensors.from_proto("x", proto)
    assert err.value.code.name == "INVALID_ARGUMENT" and message in err.value.message


def test_a_proto_dtype_other_than_the_signatures_is_refused():
    array = tensors.from_proto("x", tf.make_tensor_proto(np.array([1.0, 2.0], np.float64)))
    with pytest.raises(ServingError, match=r"Expects arg\[0\] to be float but double is provided "
                                           r"\(input 'x' of signature 'serving_default'\)"):
        tensors.check_dtype("x", array, tf.float32, "serving_default")


def _varint(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _string_content(strings):
    return b"".join(_varint(len(s)) for s in strings) + b"".join(strings)


@pytest.mark.parametrize("strings, shape", [
    ([b"ab", b"", b"x" * 300, b"\xff\x00"], [2, 2]), ([b"one"], []), ([], [0, 3])])
def test_string_tensor_content_decodes_as_tf_does(strings, shape):
    """Tensor::AsProtoTensorContent writes strings as varint32 lengths then the bytes, and TF
    Serving (Tensor::FromProto) reads it; it was a 400 "cannot create an OBJECT array"."""
    proto = _proto(types_pb2.DT_STRING, shape, tensor_content=_string_content(strings))
    reference = np.asarray(tf.io.parse_tensor(proto.SerializeToString(), tf.string).numpy())
    got = tensors.from_proto("s", proto)
    assert got.shape == reference.shape and got.tolist() == reference.tolist()


@pytest.mark.parametrize("content", [b"\x05ab", b"\x01\x01abc", b"\x80", b"\x02a"])
def test_malformed_string_tensor_content_is_invalid_argument(content):
    proto = _proto(types_pb2.DT_STRING, [2], tensor_content=content)
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.io.parse_tensor(proto.SerializeToString(), tf.string)   # TF refuses it too
    with pytest.raises(ServingError, match=r"input 's': tensor_content is not 2 strings"):
        tensors.from_proto("s", proto)
