"""How a TensorProto's typed value fields (float_val, int_val, half_val, ...) become a tensor,
as TF's Tensor::FromProto reads them (tensorflow/core/framework/tensor.cc, FromProtoField)."""
import ml_dtypes
import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.serving.errors import invalid


# The repeated field Tensor::FromProto reads for each dtype when tensor_content is empty.
VALUE_FIELDS = {
    getattr(types_pb2, "DT_" + t): field
    for field, types in (
        ("float_val", "FLOAT"), ("double_val", "DOUBLE"), ("half_val", "HALF BFLOAT16"),
        ("float8_val", "FLOAT8_E5M2 FLOAT8_E4M3FN FLOAT4_E2M1FN"),
        ("int_val", "INT32 UINT8 UINT16 INT16 INT8 QINT32 QUINT8 QINT8 QINT16 QUINT16 INT4 UINT4 INT2 UINT2"),
        ("int64_val", "INT64"), ("uint32_val", "UINT32"), ("uint64_val", "UINT64"),
        ("scomplex_val", "COMPLEX64"), ("dcomplex_val", "COMPLEX128"), ("bool_val", "BOOL"),
        ("string_val", "STRING"))
    for t in types.split() if hasattr(types_pb2, "DT_" + t)}

# Dtypes narrower than the int32 field that carries them: FromProto keeps each value's low
# bits (a C++ narrowing copy), so 255 and -1 are the same uint8 or int8, and a half's bit
# pattern may come as a uint16 (tf.make_tensor_proto) or an int16 (a client's int16 view).
_NARROW = {types_pb2.DT_INT8: np.dtype("i1"), types_pb2.DT_UINT8: np.dtype("u1"),
           types_pb2.DT_INT16: np.dtype("<i2"), types_pb2.DT_UINT16: np.dtype("<u2"),
           types_pb2.DT_HALF: np.dtype("<f2"), types_pb2.DT_BFLOAT16: np.dtype(ml_dtypes.bfloat16)}


def sent_count(proto, field) -> int:
    """How many elements the typed field holds (complex numbers take two numbers each)."""
    values = getattr(proto, field)
    return len(values) // 2 if field.endswith("complex_val") else len(values)


def misplaced(proto, field) -> str:
    """Where a proto's values went instead of the dtype's field (half_val for a DT_FLOAT...)."""
    others = sorted(f.name for f, _ in proto.ListFields() if f.name.endswith("_val") and f.name != field)
    if field.endswith("complex_val") and len(getattr(proto, field)) % 2:
        return f" ({field} holds (real, imaginary) pairs: an odd count of {len(getattr(proto, field))} numbers)"
    name = types_pb2.DataType.Name(proto.dtype)
    return f" ({name} reads {field}; the values are in {', '.join(others)})" if others else ""


def narrow_values(name, proto):
    """The flat values of a narrow-dtype proto (see _NARROW), or None for other dtypes.
    A value that does not fit the dtype's width, as signed or unsigned, is refused: FromProto
    would keep its low bits (int8 300 -> 44), which no client means."""
    target = _NARROW.get(proto.dtype)
    if target is None:
        return None
    field = VALUE_FIELDS[proto.dtype]
    raw = np.fromiter(getattr(proto, field), dtype=np.int64)
    bits = 8 * target.itemsize
    low, high = -(1 << (bits - 1)), (1 << bits) - 1
    if raw.size and (raw.min() < low or raw.max() > high):
        wrong = int(raw[(raw < low) | (raw > high)][0])
        raise invalid(f"input '{name}': {field} holds {wrong}, which does not fit in {bits} bits "
                      f"for {types_pb2.DataType.Name(proto.dtype)} (each value must lie in [{low}, {high}]; "
                      "TF reads its low bits)")
    return raw.astype(np.dtype(f"<u{target.itemsize}")).view(target)


def fill_to(values: np.ndarray, count: int) -> np.ndarray:
    """FromProtoField: fewer values than the shape's elements repeat the last one."""
    if values.size >= count:
        return values[:count]
    return np.concatenate([values, np.repeat(values[-1:], count - values.size)])
