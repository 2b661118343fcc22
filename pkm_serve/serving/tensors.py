"""TensorProto <-> numpy and TF Serving's REST JSON <-> numpy."""
import base64
import json
import math

import ml_dtypes
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from pkm_serve.serving.errors import ServingError, invalid
from pkm_serve.serving.json_floats import json_number_text, shortest_float32_as_float64, write_decimal_float32
from pkm_serve.serving.json_keys import json_text
from pkm_serve.serving.limits import DEFAULT_MAX_REQUEST_BYTES
from pkm_serve.serving.proto_fields import VALUE_FIELDS, fill_to, misplaced, narrow_values, sent_count
from pkm_serve.serving.wire_formats import base64_as_tf_serving, string_list


# Fixed-width dtypes whose tensor_content is the raw little-endian array (the common
# case); decoding them with np.frombuffer skips tf.make_ndarray's generic path,
# which dominates small requests.
_FAST_DTYPES = {
    types_pb2.DT_FLOAT: np.dtype("<f4"), types_pb2.DT_DOUBLE: np.dtype("<f8"),
    types_pb2.DT_INT32: np.dtype("<i4"), types_pb2.DT_INT64: np.dtype("<i8"),
    types_pb2.DT_HALF: np.dtype("<f2"), types_pb2.DT_INT8: np.dtype("i1"),
    types_pb2.DT_UINT8: np.dtype("u1"), types_pb2.DT_INT16: np.dtype("<i2"),
    types_pb2.DT_BOOL: np.dtype("?"),
}
_FAST_ENUMS = {v: k for k, v in _FAST_DTYPES.items()}


_MAX_RANK = 254  # TensorShape::MaxDimensions() in TF
_NOT_IN_REQUESTS = {types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT}
_LAST_VALUE_DTYPE = 100   # 101 and up are the DT_*_REF reference types


def _dtype_name(enum):
    try:
        return types_pb2.DataType.Name(enum)
    except ValueError:   # a number no DataType has
        return str(enum)


def from_protos(protos, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> dict:
    """Decodes a request's input TensorProtos; malformed ones become INVALID_ARGUMENT.

    Shapes are checked against the values actually sent before anything is allocated: a
    few-byte proto must not expand into gigabytes, so all inputs together may decode to at
    most max_bytes (the request size limit)."""
    left = max_bytes
    arrays = {}
    for name, proto in protos.items():
        left -= _check(name, proto, left, max_bytes)
        arrays[name] = _decode(name, proto)
    return arrays


def from_proto(name: str, proto, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> np.ndarray:
    """One input, as from_protos."""
    return from_protos({name: proto}, max_bytes)[name]


def _check(name, proto, budget, limit) -> int:
    """Validates proto; returns the bytes it decodes to, which must not exceed budget."""
    if proto.dtype == types_pb2.DT_INVALID:
        raise invalid(f"input '{name}' has no dtype (DT_INVALID)")
    if proto.dtype in _NOT_IN_REQUESTS or proto.dtype > _LAST_VALUE_DTYPE:
        raise invalid(f"input '{name}' has dtype {_dtype_name(proto.dtype)}, which a request cannot "
                      "carry (resource handles, variants and reference types live only inside a graph)")
    try:
        tf_dtype = tf.dtypes.as_dtype(proto.dtype)
        itemsize = np.dtype(tf_dtype.as_numpy_dtype).itemsize   # object (strings): one pointer
    except (TypeError, KeyError, ValueError):
        raise invalid(f"input '{name}' has an unsupported dtype ({_dtype_name(proto.dtype)})") from None
    shape = [d.size for d in proto.tensor_shape.dim]
    text = str(shape[:8])[:-1] + ", ...]" if len(shape) > 8 else str(shape)
    if len(shape) > _MAX_RANK or any(d < 0 for d in shape):
        raise invalid(f"input '{name}' has an invalid shape {text} (rank {len(shape)})")
    count = math.prod(shape)   # Python ints: exact, cannot wrap around as np.prod can
    too_big = invalid(f"input '{name}' of shape {text} and dtype {tf_dtype.name} would take the decoded "
                      f"request past the limit of {limit} bytes (--max_request_bytes)")
    size = count * itemsize
    if size > budget:   # (size itself may have thousands of digits: not printed)
        raise too_big
    if proto.tensor_content and proto.dtype == types_pb2.DT_STRING:
        size += len(proto.tensor_content)   # checked against the shape by string_list
        if size > budget:
            raise too_big
    elif proto.tensor_content:
        if size != len(proto.tensor_content):
            raise invalid(f"input '{name}': tensor_content holds {len(proto.tensor_content)} bytes but "
                          f"shape {text} of {tf_dtype.name} needs {size}")
    else:
        field = VALUE_FIELDS.get(proto.dtype)
        if field is None:
            raise invalid(f"input '{name}' has dtype {tf_dtype.name}, which a request cannot carry")
        sent = sent_count(proto, field)
        # As Tensor::FromProto, fewer values than the shape needs repeat the last one
        # (tf.make_tensor_proto([1., 2.], shape=[2, 3]) sends two); none, or more than
        # needed, is refused where FromProto would zero-fill or drop values silently.
        if sent > count or (sent == 0 and count > 0):
            raise invalid(f"input '{name}' holds {sent} values but its shape {text} needs "
                          f"{count}{misplaced(proto, field)}")
        if field == "string_val" and count > sent:
            # each repeat of the last string becomes its own copy in the tensor
            size += (count - sent) * len(getattr(proto, field)[-1])
            if size > budget:
                raise too_big
    return size


def _decode(name, proto) -> np.ndarray:
    """Decodes a proto that passed _check."""
    fast = _FAST_DTYPES.get(proto.dtype)
    shape = [d.size for d in proto.tensor_shape.dim]
    if proto.dtype == types_pb2.DT_STRING and proto.tensor_content:
        strings = string_list(proto.tensor_content, math.prod(shape))
        if strings is None:
            raise invalid(f"input '{name}': tensor_content is not {math.prod(shape)} strings "
                          f"(shape {shape}) in TF's encoding (varint32 lengths, then the bytes)")
        return np.array(strings, dtype=object).reshape(shape)
    try:
        if fast is not None and proto.tensor_content:
            return np.frombuffer(proto.tensor_content, dtype=fast).reshape(shape)
        narrow = None if proto.tensor_content else narrow_values(name, proto)
        if narrow is not None:
            return fill_to(narrow, math.prod(shape)).reshape(shape)
        return tf.make_ndarray(proto)
    except ServingError:
        raise
    except Exception as e:  # make_ndarray/reshape raise TypeError/ValueError on bad content
        raise invalid(f"input '{name}' is not a valid TensorProto: {e}") from None


# How each dtype's values go into its typed field (TF's Tensor::AsProtoField): the
# 16-bit floats as their bit patterns, complex numbers as (real, imaginary) pairs.
def _typed_values(array):
    flat = np.ascontiguousarray(array).reshape(-1)
    if array.dtype == np.float16 or array.dtype.name == "bfloat16":
        return flat.view(np.uint16).tolist()
    if array.dtype.kind == "c":
        return flat.view(np.float32 if array.dtype.itemsize == 8 else np.float64).tolist()
    return flat.tolist()


def to_proto(array: np.ndarray, as_tensor_content: bool = False):
    """An output TensorProto. By default its values go in the typed field (float_val, ...),
    as TF Serving answers unless --enable_serialization_as_tensor_content is given."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    enum = _FAST_ENUMS.get(array.dtype)
    if as_tensor_content and enum is not None:
        proto = tensor_pb2.TensorProto(dtype=enum)
        for d in array.shape:
            proto.tensor_shape.dim.add(size=d)
        proto.tensor_content = np.ascontiguousarray(array).tobytes()
        return proto
    if array.dtype == object or array.dtype.kind in "SU":
        return tf.make_tensor_proto(array)   # strings always go in string_val
    try:
        enum = tf.as_dtype(array.dtype).as_datatype_enum
    except TypeError:
        raise invalid(f"the model returned an output of dtype {array.dtype}, which a TensorProto "
                      "cannot carry") from None
    proto = tensor_pb2.TensorProto(dtype=enum)
    for d in array.shape:
        proto.tensor_shape.dim.add(size=d)
    field = VALUE_FIELDS.get(enum)
    if field is None:   # dtypes without a typed field (e.g. resource): raw bytes
        proto.tensor_content = np.ascontiguousarray(array).tobytes()
    elif field == "float8_val":   # a bytes field, one byte per value (it raised AttributeError)
        proto.float8_val = np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes()
    else:
        getattr(proto, field).extend(_typed_values(array))
    return proto


def check_dtype(name: str, array: np.ndarray, expected: tf.DType, signature: str, arg: int = 0):
    """The input's dtype must be the signature's (TF does not cast fed tensors): refused in the
    words of the Session TF Serving feeds it to (FunctionCallFrame::SetArgs), `arg` being the
    input's place among the fed tensors' names, sorted as DirectSession sorts its feeds."""
    try:
        got = tf.as_dtype(array.dtype)
    except TypeError:
        raise invalid(f"input '{name}' has unsupported dtype {array.dtype}") from None
    if got != expected:
        raise invalid(f"Expects arg[{arg}] to be {tf_type_name(expected)} but {tf_type_name(got)} is "
                      f"provided (input '{name}' of signature '{signature}')")


# ---------------------------------------------------------------- REST JSON
def decode_b64(value):
    """{"b64": "..."} objects become bytes (TF Serving's binary encoding), strings UTF-8;
    anything malformed is INVALID_ARGUMENT."""
    if isinstance(value, dict):   # json_tensor.cc's JsonDecodeBase64Object, in its words
        shown = json_text(value)[:200]
        # (an object that spelled "b64" twice is no dict proper: IsValBase64Object counts members)
        if type(value) is not dict or len(value) != 1 or not isinstance(value.get("b64"), str):
            raise invalid(f"JSON Value: {shown} not formatted correctly for base64 data")
        decoded = base64_as_tf_serving(value["b64"])
        if decoded is None:
            raise invalid(f"Unable to base64 decode (JSON Value: {shown})")
        return decoded
    if isinstance(value, list):
        return [decode_b64(v) for v in value]
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            pass
        try:   # bytes of the body that were not UTF-8, kept as sent (rest_frontend's parse)
            return value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:   # JSON can spell a lone surrogate ("\ud800")
            raise invalid("a string value is not valid Unicode (lone surrogate)") from None
    return value


def _first_non_string(value):
    """The JSON text of the first leaf of decoded JSON (decode_b64) that is not a string, else None."""
    if isinstance(value, list):
        for item in value:
            wrong = _first_non_string(item)
            if wrong is not None:
                return wrong
        return None
    return None if isinstance(value, bytes) else json.dumps(value)


def _all_numbers(value) -> bool:
    if isinstance(value, list):
        return all(_all_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_MAX_JSON_RANK = 64   # numpy, which decodes the value, allows 64 dimensions (TF 254)


def _nesting(value) -> int:
    """How deep the first element's chain of lists goes (the rank the value claims)."""
    depth = 0
    while isinstance(value, list) and depth <= _MAX_JSON_RANK:
        depth += 1
        value = value[0] if value else None
    return depth


def from_json(name: str, value, spec: tf.TensorSpec, may_hold_bools: bool = True) -> np.ndarray:
    """Converts a JSON value to an array of the signature's dtype, refusing lossy casts.
    may_hold_bools=False (the body spells no true/false) skips the scan for JSON booleans."""
    dtype = spec.dtype
    if _nesting(value) > _MAX_JSON_RANK:
        raise invalid(f"input '{name}' is nested more than {_MAX_JSON_RANK} lists deep: more "
                      "dimensions than a served tensor may have")
    if dtype == tf.string:
        raw = decode_b64(value)
        wrong = _first_non_string(raw)
        if wrong is not None:
            raise invalid(f"input '{name}' holds {wrong}, which is not of the signature's "
                          "type string (a JSON string, or {\"b64\": ...} for bytes)")
        try:
            arr = np.array(raw, dtype=object)
        except ValueError:
            arr = None
        # dtype=object keeps rows of other lengths as list elements ([["a"], "b"]: 1-D, a list)
        if arr is None or arr.ndim != _nesting(raw) or (arr.size and list in set(map(type, arr.reshape(-1)))):
            raise invalid(f"input '{name}' is ragged: all rows must have the same shape")
        return arr
    try:
        arr = np.array(value)
    except ValueError:
        raise invalid(f"input '{name}' is ragged: all rows must have the same shape") from None
    if arr.dtype == object and _all_numbers(value):
        # An integer past 64 bits makes numpy keep Python objects: read every number as a
        # JSON double, as TF Serving's parser does (an integer signature then refuses the range).
        try:
            arr = np.array(value, dtype=np.float64)
        except OverflowError:   # rapidjson refuses such a literal: kParseErrorNumberTooBig
            raise invalid(f"JSON Parse error: Number too big to be stored in double (input '{name}')") from None
        except ValueError:
            raise invalid(f"input '{name}' is ragged: all rows must have the same shape") from None
    if arr.dtype == object:
        # ({"b64": ...} too: json_tensor.cc's TypeError, "Type: Object", for a non-string input)
        wrong = _first_wrong_leaf(value, dtype)
        if wrong is not _NO_LEAF:
            raise json_type_error(name, wrong, dtype)
        raise invalid(f"input '{name}' is ragged: all rows must have the same shape")
    if arr.dtype.kind in "US" or (arr.dtype.kind == "b" and not dtype.is_bool):
        raise json_type_error(name, _first_wrong_leaf(value, dtype), dtype)
    if may_hold_bools and arr.dtype.kind in "iuf" and not dtype.is_bool:
        _refuse_bools_among_numbers(name, value, dtype)
    if dtype.is_bool:
        if arr.dtype.kind != "b" and arr.size:
            raise json_type_error(name, _first_wrong_leaf(value, dtype), dtype)
        return arr.astype(bool)
    if dtype.is_integer:
        if arr.dtype.kind == "f":
            # TF Serving (json_tensor.cc) wants JSON integers here: a JSON 1.0 is a type error.
            wrong = next((v for v in _leaves(value) if isinstance(v, float)), None)
            if wrong is not None:
                raise invalid(f"JSON Value: {json_number_text(wrong)} Type: Number is not of expected "
                              f"type: {dtype.name} (input '{name}')")
            return _exact_integers(name, value, dtype)
        info = np.iinfo(dtype.as_numpy_dtype)
        # Floats (JSON integers past int64 turn the whole array float64) are compared with the
        # range's exact power-of-two ends: float64(int64 max) rounds up to 2^63.
        low, high = (float(info.min), float(info.max) + 1.0) if arr.dtype.kind == "f" \
            else (info.min, info.max + 1)
        if arr.size and (arr.min() < low or arr.max() >= high):
            raise _out_of_range(name, value, dtype)
        return arr.astype(dtype.as_numpy_dtype)
    if dtype.is_floating or dtype.is_complex:
        if dtype.is_floating:
            _check_lossless(name, value, arr, dtype)
        return arr.astype(dtype.as_numpy_dtype)
    raise invalid(f"input '{name}' has dtype {dtype.name}, which the REST API does not support")


# TF's DataTypeString where it differs from tf.DType.name (json_tensor.cc's TypeError prints it).
_TF_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half"}


def tf_type_name(dtype: tf.DType) -> str:
    """TF's DataTypeString: float, double, half, int32, string, ..."""
    return _TF_TYPE_NAMES.get(dtype.name, dtype.name)


def _refuse_bools_among_numbers(name, value, dtype):
    """json_tensor.cc refuses JSON true/false for a number (numpy read [true, 2] as [1, 2])."""
    if not isinstance(value, list):
        return
    if value and isinstance(value[0], list):
        for row in value:
            _refuse_bools_among_numbers(name, row, dtype)
        return
    if bool in set(map(type, value)):
        raise json_type_error(name, next(v for v in value if isinstance(v, bool)), dtype)


_JSON_TYPES = {bool: "Bool", type(None): "Null", str: "String", bytes: "String", dict: "Object",
               list: "Array", int: "Number", float: "Number"}


def json_type_error(name, leaf, dtype):
    """json_tensor.cc's TypeError for a JSON value of the wrong type for the input's dtype."""
    kind = _JSON_TYPES.get(type(leaf)) or ("Object" if isinstance(leaf, dict) else type(leaf).__name__)
    if kind == "Bool":
        kind = "True" if leaf else "False"
    text = leaf.decode("utf-8", "replace") if isinstance(leaf, bytes) else leaf
    shown = json_number_text(leaf) if kind == "Number" else json_text(text)[:200]
    return invalid(f"JSON Value: {shown} Type: {kind} is not of expected type: "
                   f"{tf_type_name(dtype)} (input '{name}')")


def _first_wrong_leaf(value, dtype):
    """The first leaf of a JSON value whose JSON type the dtype does not take, else _NO_LEAF
    (a mix numpy keeps as objects: [true, 2**70], [null, 1])."""
    for leaf in _leaves(value):
        if isinstance(leaf, bool) != dtype.is_bool or not isinstance(leaf, (bool, int, float)):
            return leaf
    return _NO_LEAF


_NO_LEAF = object()


def _exact_integers(name, value, dtype) -> np.ndarray:
    """JSON integers that numpy read as float64 (an int64 and a uint64 past 2^63 in one list,
    or an integer past 64 bits), converted from the Python ints themselves: through float64,
    [2**63 + 1, 1] became [2**63, 1] for a uint64 input, and 2**64 - 1 was out of range."""
    info = np.iinfo(dtype.as_numpy_dtype)
    if any(not info.min <= v <= info.max for v in _leaves(value)):
        raise _out_of_range(name, value, dtype)
    return np.array(value, dtype=dtype.as_numpy_dtype)


def _out_of_range(name, value, dtype):
    """json_tensor.cc's TypeError for the first JSON integer the input's type cannot hold (its
    IsInt/IsInt64/IsUint/IsUint64 test is false): "JSON Value: 1099511627776 Type: Number is
    not of expected type: int32" (the words were "holds values outside the range of int32")."""
    info = np.iinfo(dtype.as_numpy_dtype)
    leaf = next(v for v in _leaves(value) if not info.min <= v <= info.max)
    return json_type_error(name, leaf, dtype)


def _leaves(value):
    """The non-list values of nested JSON lists, in order."""
    if isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def lossy_decimal_error(v, target: str, name: str = ""):
    where = f" (input '{name}')" if name else ""
    return invalid(f"Cannot convert JSON value: {json_number_text(v)} to {target} "
                   f"without loss of precision.{where}")


# JSON integers that TF Serving's parser (rapidjson) keeps as integers: int64 and uint64.
# Larger ones it reads as doubles.
_JSON_INT_MIN, _JSON_INT_MAX = -(1 << 63), (1 << 64) - 1


def _is_json_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _JSON_INT_MIN <= v <= _JSON_INT_MAX


def lossless_float_limits(dtype: tf.DType):
    """(largest integer exactly held, largest finite value) of a float dtype: TF Serving's
    IsLosslessDecimal accepts a JSON integer up to the first in magnitude, a JSON double
    (or an integer past 64 bits, which it reads as one) up to the second; NaN/Infinity pass."""
    info = ml_dtypes.finfo(dtype.as_numpy_dtype)
    return (1 << (info.nmant + 1)) - 1, float(info.max)


def _check_lossless(name, value, arr, dtype):
    """TF Serving's IsLosslessDecimal (json_tensor.cc) over a numeric JSON value read as `arr`."""
    if not arr.size:
        return
    max_int, max_value = lossless_float_limits(dtype)
    target = {"float32": "float", "float64": "double"}.get(dtype.name, dtype.name)
    if arr.dtype.kind in "iu":   # every leaf is a JSON integer of at most 64 bits
        flat = arr.reshape(-1)
        too_big = flat > max_int
        if arr.dtype.kind == "i":
            too_big |= flat < -max_int
        if too_big.any():
            raise lossy_decimal_error(int(flat[np.argmax(too_big)]), target, name)
        return
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(np.where(np.isfinite(arr), arr, 0.0))
    if magnitude.max() > max_value:
        raise lossy_decimal_error(float(arr.reshape(-1)[np.argmax(magnitude.reshape(-1) > max_value)]),
                                  target, name)
    # Only an integral value past max_int can come from an integer leaf too large to hold exactly.
    if magnitude.max() > max_int and np.any((magnitude > max_int) & (magnitude == np.floor(magnitude))):
        wrong = next((v for v in _leaves(value) if _is_json_int(v) and abs(v) > max_int), None)
        if wrong is not None:
            raise lossy_decimal_error(wrong, target, name)


def _json_scalar_list(arr: np.ndarray, name: str):
    # json_tensor.cc writes no complex type (it was a 500 here) and no float8/float4/int4 one
    # (ml_dtypes' one-byte types: they were written as numbers); ml_dtypes names them as TF does.
    if arr.dtype.kind == "c" or (arr.dtype.kind in "fV" and arr.dtype.itemsize == 1):
        raise invalid(f"Failed to write JSON value for tensor type: {arr.dtype.name} "
                      f"(output '{name}'); the gRPC API returns it")
    if arr.dtype == object or arr.dtype.kind == "S":
        binary = name.endswith("_bytes")

        def enc(b):
            if isinstance(b, bytes):
                if binary:
                    return {"b64": base64.b64encode(b).decode("ascii")}
                try:
                    return b.decode("utf-8")
                except UnicodeDecodeError:
                    return {"b64": base64.b64encode(b).decode("ascii")}
            return b

        flat = [enc(b) for b in arr.reshape(-1)]
        return np.array(flat, dtype=object).reshape(arr.shape).tolist() if arr.ndim else flat[0]
    if arr.dtype == np.float16 or arr.dtype.name == "bfloat16":
        # (an extension: json_tensor.cc writes neither) Each by its own shortest decimal: a
        # bfloat16 0.1 printed as float32 was 0.100097656.
        return shortest_float32_as_float64(arr, like=arr.dtype.type).tolist()
    if arr.dtype == np.float32:
        # json_tensor.cc's digits (WriteDecimal<float>: 1.23456776, not the shortest
        # 1.2345678), not float64 noise (0.10000000149011612).
        return write_decimal_float32(arr).tolist()
    return arr.tolist()   # a double's shortest decimal reads back as upstream's 17 digits do


def to_json(name: str, arr: np.ndarray):
    return _json_scalar_list(np.asarray(arr), name)


def input_mismatch(expected, given) -> str:
    """"missing input(s) [...]" and/or "unknown input(s) [...]" between two name sets
    ("" where they are equal): only the parts that are not empty."""
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    parts = ([f"missing input(s) {missing}"] if missing else []) + ([f"unknown input(s) {extra}"] if extra else [])
    return " and ".join(parts)
