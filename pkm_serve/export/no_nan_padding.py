"""The ids whose tf.math.multiply_no_nan(rows, w) weight is 0 made padding before fusing (no_nan_multiply.py
finds the weights): the composite's entry is 0 there whatever the row, which padding gives, and w * row does
not for an inf or NaN row."""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.fuse import _cast, _squeeze_last
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import Site, dims, tensor_dtype


def zero_weights_as_padding(fg: FunctionGraph, site: Site) -> None:
    """Before fusing (before the weights' factors are folded into one): the ids where a multiply_no_nan weight
    is 0 become padding, through the site's mask (the existing one kept: both must keep an id)."""
    for i, (ref, squeeze, scalar) in enumerate(site.no_nan_weights):
        value = fg.const_value(ref)
        if value is not None and value.size and np.all(value != 0):
            continue
        prefix = f"{site.root}/pkm_no_nan_weights{i}"
        shape = dims(fg.shape(ref))
        dtype = tensor_dtype(fg, ref)
        if dtype in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):  # TFLite's NOT_EQUAL takes neither; exact in float32
            ref, dtype = _cast(fg, prefix + "/float", ref, dtype, types_pb2.DT_FLOAT, shape), types_pb2.DT_FLOAT
        zero = fg.add_const(prefix + "/zero", np.array(0, dtypes.as_dtype(dtype).as_numpy_dtype))
        kept = fg.add_op(prefix + "/nonzero", "NotEqual", [ref, zero], {"T": DType(dtype),
                         "incompatible_shape_error": True}, shapes=[shape])
        if squeeze:
            kept = _squeeze_last(fg, prefix + "/squeezed", kept, types_pb2.DT_BOOL)
        if scalar:
            kept = fg.add_op(prefix + "/scalar", "Reshape", [kept, fg.add_const(
                prefix + "/scalar_shape", np.zeros([0], np.int32))], {"T": DType(types_pb2.DT_BOOL), "Tshape": DType(
                    types_pb2.DT_INT32)}, shapes=[[]])
        _keep_only(fg, site, prefix, kept)


def _keep_only(fg: FunctionGraph, site: Site, prefix: str, kept: Ref) -> None:
    """site.mask and `kept` (bool, the weights' shape): an id is kept where both keep it."""
    if site.mask is None:
        site.mask, site.mask_keeps_true, site.mask_squeeze = kept, True, False
        return
    mask = site.mask
    if site.mask_squeeze:
        mask = _squeeze_last(fg, prefix + "/mask_squeezed", mask, types_pb2.DT_BOOL)
    if not site.mask_keeps_true:
        mask = fg.add_op(prefix + "/mask_kept", "LogicalNot", [mask], {}, shapes=[None])
    site.mask = fg.add_op(prefix + "/kept", "LogicalAnd", [mask, kept], {}, shapes=[None])
    site.mask_keeps_true, site.mask_squeeze = True, False

