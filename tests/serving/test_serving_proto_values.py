"""TensorProto typed fields (float_val, int_val, half_val, ...) read as TF's Tensor::FromProto
reads them. The reference is TF's own C++ FromProto, reached through tf.io.parse_tensor
(the ParseTensor kernel calls Tensor::FromProto on the serialized proto)."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError


def _proto(dtype, shape, field, values):
    proto = tensor_pb2.TensorProto(dtype=dtype)
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    getattr(proto, field).extend(values)
    return proto


def _from_proto_in_tf(proto):
    return tf.io.parse_tensor(proto.SerializeToString(), tf.as_dtype(proto.dtype)).numpy()


def _assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.kind == "f":
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("proto", [
    tf.make_tensor_proto([1.0, 2.0], shape=[2, 3]),                 # what a TF client builds
    tf.make_tensor_proto([7, -3], dtype=tf.int64, shape=[3, 2]),
    tf.make_tensor_proto([b"a", b"bc"], shape=[2, 2]),
    tf.make_tensor_proto([True, False], shape=[5]),
    tf.make_tensor_proto(np.array([0.5, -2.0], np.float16), shape=[4]),
    _proto(types_pb2.DT_UINT8, [2, 2], "int_val", [9, 200]),
    _proto(types_pb2.DT_DOUBLE, [1, 3], "double_val", [0.25]),
], ids=["float", "int64", "string", "bool", "half", "uint8", "double-one-value"])
def test_fewer_values_than_the_shape_repeat_the_last_as_tf_does(proto):
    want = _from_proto_in_tf(proto)
    _assert_same(tensors.from_proto("x", proto), want)


@pytest.mark.parametrize("proto", [
    _proto(types_pb2.DT_UINT8, [4], "int_val", [-1, -128, 255, 0]),    # Java's signed bytes
    _proto(types_pb2.DT_INT8, [4], "int_val", [255, 128, -128, 127]),
    _proto(types_pb2.DT_INT16, [2], "int_val", [65535, -32768]),
    _proto(types_pb2.DT_UINT16, [2], "int_val", [-1, 65535]),
    # a half's bits through an int16 view: -1.0 is 0xBC00, i.e. -17408
    _proto(types_pb2.DT_HALF, [3], "half_val",
           np.array([-1.0, 2.5, -0.1], np.float16).view(np.int16).tolist()),
    _proto(types_pb2.DT_BFLOAT16, [2], "half_val", [0xBF80, -16512]),
], ids=["uint8", "int8", "int16", "uint16", "half-int16-bits", "bfloat16"])
def test_narrow_values_given_signed_or_unsigned_keep_their_bits_as_tf_does(proto):
    want = _from_proto_in_tf(proto)
    _assert_same(tensors.from_proto("x", proto), want)


@pytest.mark.parametrize("proto, message", [
    (_proto(types_pb2.DT_INT8, [1], "int_val", [300]),
     "input 'x': int_val holds 300, which does not fit in 8 bits for DT_INT8 (each value must lie in [-128, 255]"),
    (_proto(types_pb2.DT_UINT8, [3], "int_val", [1, -129, 2]), "int_val holds -129, which does not fit in 8 bits"),
    (_proto(types_pb2.DT_HALF, [1], "half_val", [70000]),
     "half_val holds 70000, which does not fit in 16 bits for DT_HALF (each value must lie in [-32768, 65535]"),
])
def test_values_wider_than_the_dtype_are_refused_not_cut_to_their_low_bits(proto, message):
    """FromProto would keep the low bits (int8 300 -> 44): check that TF does, then that we refuse."""
    kept = _from_proto_in_tf(proto)
    bits = 8 * kept.itemsize
    wrong = next(v for v in getattr(proto, "half_val" if proto.dtype == types_pb2.DT_HALF else "int_val")
                 if not -(1 << (bits - 1)) <= v < 1 << bits)
    assert wrong % (1 << bits) in kept.view(f"u{kept.itemsize}").tolist()
    with pytest.raises(ServingError) as err:
        tensors.from_proto("x", proto)
    assert err.value.code.name == "INVALID_ARGUMENT" and message in err.value.message


@pytest.mark.parametrize("proto, message", [
    (_proto(types_pb2.DT_FLOAT, [2], "float_val", [1.0, 2.0, 3.0]), "holds 3 values but its shape [2] needs 2"),
    (tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape={"dim": [{"size": 2}]}),
     "holds 0 values but its shape [2] needs 2"),
])
def test_too_many_or_no_values_stay_refused(proto, message):
    """FromProto drops the extra values, or zero-fills: both would hide a client's mistake."""
    with pytest.raises(ServingError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tensors.from_proto("x", proto)


def test_a_single_string_repeated_past_the_size_limit_is_refused():
    proto = _proto(types_pb2.DT_STRING, [1000], "string_val", [b"a", b"x" * 1000])
    with pytest.raises(ServingError, match="past the limit of 100000 bytes"):
        tensors.from_proto("x", proto, max_bytes=100_000)
