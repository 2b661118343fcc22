"""TensorProto <-> numpy and TF Serving's REST JSON <-> numpy."""
import base64
import math

import numpy as np
import tensorflow as tf

from pkm_serve.serving.errors import invalid


def from_proto(name: str, proto) -> np.ndarray:
    """Decodes a request TensorProto; malformed protos become INVALID_ARGUMENT."""
    if proto.dtype == 0:
        raise invalid(f"input '{name}' has no dtype (DT_INVALID)")
    try:
        return tf.make_ndarray(proto)
    except Exception as e:  # make_ndarray raises TypeError/ValueError on bad content
        raise invalid(f"input '{name}' is not a valid TensorProto: {e}") from None


def to_proto(array: np.ndarray):
    return tf.make_tensor_proto(array)


def describe_shape(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def check_against_spec(name: str, array: np.ndarray, spec: tf.TensorSpec, signature: str):
    """Strict check used for gRPC: dtype must match exactly, shape be compatible."""
    try:
        got = tf.as_dtype(array.dtype)
    except TypeError:
        raise invalid(f"input '{name}' has unsupported dtype {array.dtype}") from None
    if got != spec.dtype:
        raise invalid(f"input '{name}' has dtype {got.name} but signature '{signature}' "
                      f"expects {spec.dtype.name}")
    if not spec.shape.is_compatible_with(array.shape):
        raise invalid(f"input '{name}' has shape {describe_shape(array.shape)} but signature "
                      f"'{signature}' expects {describe_shape(spec.shape.as_list() if spec.shape.rank is not None else [])}"
                      if spec.shape.rank is not None else
                      f"input '{name}' has an incompatible shape")


# ---------------------------------------------------------------- REST JSON
def _decode_b64(value):
    """{"b64": "..."} objects become bytes (TF Serving's binary encoding)."""
    if isinstance(value, dict):
        if set(value) != {"b64"}:
            raise invalid(f"a JSON object inside a tensor value must be {{\"b64\": ...}}, got keys {sorted(value)}")
        try:
            return base64.b64decode(value["b64"], validate=True)
        except Exception:
            raise invalid("a \"b64\" value is not valid base64") from None
    if isinstance(value, list):
        return [_decode_b64(v) for v in value]
    if isinstance(value, str):
        return value.encode("utf-8")
    return value


def from_json(name: str, value, spec: tf.TensorSpec) -> np.ndarray:
    """Converts a JSON value to an array of the signature's dtype, refusing lossy casts."""
    dtype = spec.dtype
    if dtype == tf.string:
        raw = _decode_b64(value)
        try:
            arr = np.array(raw, dtype=object)
        except ValueError:
            raise invalid(f"input '{name}' is ragged: all rows must have the same shape") from None
        return arr
    try:
        arr = np.array(value)
    except ValueError:
        raise invalid(f"input '{name}' is ragged: all rows must have the same shape") from None
    if arr.dtype == object:
        raise invalid(f"input '{name}' is ragged or mixes types: all rows must have the same shape")
    if arr.dtype.kind in "US":
        raise invalid(f"input '{name}' holds strings but the signature expects {dtype.name}")
    if dtype.is_bool:
        if arr.dtype.kind != "b":
            raise invalid(f"input '{name}' must hold true/false values (signature dtype bool)")
        return arr
    if dtype.is_integer:
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise invalid(f"input '{name}' holds non-integer numbers but the signature expects {dtype.name}")
        elif arr.dtype.kind == "b":
            raise invalid(f"input '{name}' holds booleans but the signature expects {dtype.name}")
        info = np.iinfo(dtype.as_numpy_dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise invalid(f"input '{name}' holds values outside the range of {dtype.name}")
        return arr.astype(dtype.as_numpy_dtype)
    if dtype.is_floating or dtype.is_complex:
        if arr.dtype.kind == "b":
            raise invalid(f"input '{name}' holds booleans but the signature expects {dtype.name}")
        return arr.astype(dtype.as_numpy_dtype)
    raise invalid(f"input '{name}' has dtype {dtype.name}, which the REST API does not support")


def _json_scalar_list(arr: np.ndarray, name: str):
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
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 8 or arr.dtype.name == "bfloat16":
        # Print float32/16 values by their own shortest repr, not float64 noise.
        return np.vectorize(lambda x: float(repr(np.float32(x))), otypes=[object])(arr).tolist() \
            if arr.ndim else float(repr(np.float32(arr)))
    return arr.tolist()


def to_json(name: str, arr: np.ndarray):
    return _json_scalar_list(np.asarray(arr), name)


def json_safe_float(x):
    return x if math.isfinite(x) else str(x)
