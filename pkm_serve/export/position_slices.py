"""Which position of an axis a tensor takes (x[..., k], x[..., k:k+1], tf.unstack(x, axis)[k],
tf.gather(x, k, axis)), and the ids keras.ops.take wraps (where(x < 0, x + N, x)): what the
per-position and running-sum matchers read their bags' positions off."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from tensorflow.python.framework import dtypes

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import dims


def attr_value(node, name: str, field: str):
    """An attr's value, its default (0 / False) where the SavedModel strips it; reading a missing
    key of the NodeDef's attr map would add an empty attr, which the TFLite converter refuses."""
    return getattr(node.attr[name], field) if name in node.attr else 0


def _slice_entries(fg: FunctionGraph, node, axis: int):
    """StridedSlice `node` -> (begin, end, shrink, begin_masked, end_masked, new_axis_after) of its
    entry for input axis `axis`, when every other input axis is taken whole; else None."""
    x, begin_ref, end_ref, strides_ref = fg.inputs(node)
    rank = fg.shape(x).rank
    begin, end, strides = (fg.const_value(r) for r in (begin_ref, end_ref, strides_ref))
    if rank is None or begin is None or end is None or strides is None:
        return None
    begin, end, strides = (np.ravel(v).tolist() for v in (begin, end, strides))
    mask = {k: node.attr[k].i if k in node.attr else 0 for k in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    found, dim, entries = None, 0, len(begin)
    for i in range(entries):
        bit = 1 << i
        if mask["ellipsis_mask"] & bit:
            dim = rank - sum(1 for j in range(i + 1, entries) if not mask["new_axis_mask"] & (1 << j))
            continue
        if mask["new_axis_mask"] & bit:
            if found is None or i != entries - 1 or found[5] or dim != rank:
                return None  # only a unit axis added last, after the position (w[:, k, None])
            found = found[:5] + (True,)
            continue
        if strides[i] != 1:
            return None
        if dim == axis:
            found = (begin[i], end[i], bool(mask["shrink_axis_mask"] & bit), bool(mask["begin_mask"] & bit),
                     bool(mask["end_mask"] & bit), False)
        elif not (mask["begin_mask"] & bit and mask["end_mask"] & bit) or mask["shrink_axis_mask"] & bit:
            return None
        dim += 1
    return found


def slice_position(fg: FunctionGraph, ref: Ref, axis: Optional[int] = None) -> Optional[Tuple[Ref, int, bool]]:
    """(source, k, kept) where `ref` is position k of `source`'s axis `axis` (its last by default)
    and every other axis whole: source[..., k] (kept False), source[..., k:k+1] or source[..., k, None]
    (kept True; a unit axis where the position was, or last), tf.unstack(source, axis=-1)[k],
    tf.gather(source, k, axis=-1). k is as written: -1 stays -1 whatever the declared length, since a
    server may feed another length (TF Serving does not check shapes) and -1 is then another position."""
    node = fg.producer(ref)
    if node is None or node.op not in ("StridedSlice", "Unpack", "GatherV2"):
        return None
    source = fg.inputs(node)[0]
    rank = fg.shape(source).rank
    if rank is None or rank == 0:
        return None
    axis = rank - 1 if axis is None else axis
    if node.op == "Unpack":
        return (source, ref.index, False) if attr_value(node, "axis", "i") % rank == axis else None
    if node.op == "GatherV2":
        index, gather_axis = fg.const_value(fg.inputs(node)[1]), fg.const_value(fg.inputs(node)[2])
        if index is None or gather_axis is None or int(gather_axis) % rank != axis or np.size(index) != 1 or \
                attr_value(node, "batch_dims", "i"):
            return None
        k = int(np.ravel(index)[0])
        return None if k < 0 else (source, k, np.ndim(index) == 1)
    entry = _slice_entries(fg, node, axis)
    if entry is None:
        return None
    begin, end, shrink, begin_masked, end_masked, new_axis_after = entry
    if shrink:
        return (source, begin, new_axis_after)
    if new_axis_after:
        return None
    if begin == -1 and end_masked:  # x[..., -1:]: the last position
        return (source, -1, True)
    first = 0 if begin_masked else begin
    # x[..., k:] is one position only at the declared length: not taken
    return (source, first, True) if not end_masked and first >= 0 and end - first == 1 else None


def _static_int(fg: FunctionGraph, ref: Ref) -> Optional[int]:
    """The value of a scalar int computed from constants alone (Cast(Const shape[0]), as Keras writes N)."""
    value = fg.const_value(ref)
    if value is not None:
        return int(value) if np.size(value) == 1 else None
    node = fg.producer(ref)
    if node is not None and node.op == "Cast":
        return _static_int(fg, fg.inputs(node)[0])
    if node is not None and node.op == "StridedSlice":
        source = fg.const_value(fg.inputs(node)[0])
        begin = fg.const_value(fg.inputs(node)[1])
        shrink = node.attr["shrink_axis_mask"].i if "shrink_axis_mask" in node.attr else 0
        if source is not None and begin is not None and np.ndim(source) == 1 and np.size(begin) == 1 and shrink == 1:
            return int(np.ravel(source)[int(np.ravel(begin)[0])])
    return None


def unwrapped(fg: FunctionGraph, ref: Ref, table_shape) -> Tuple[Ref, bool]:
    """keras.ops.take (Keras 3 Embedding) gathers where(x < 0, x + N, x): -> (x, True); else (ref, False)."""
    node = fg.producer(ref)
    rows = table_shape[0] if table_shape is not None and table_shape.rank == 2 else None
    if node is None or node.op != "SelectV2" or rows is None:
        return ref, False
    cond, then_ref, else_ref = (fg.producer(r) for r in fg.inputs(node))
    x = fg.inputs(node)[2]
    if cond is None or cond.op != "Less" or then_ref is None or then_ref.op != "AddV2" or \
            fg.inputs(cond)[0] != x or fg.const_value(fg.inputs(cond)[1]) is None or \
            np.any(fg.const_value(fg.inputs(cond)[1]) != 0) or x not in fg.inputs(then_ref):
        return ref, False
    other = [r for r in fg.inputs(then_ref) if r != x]
    return (x, True) if len(other) == 1 and _static_int(fg, other[0]) == int(rows) else (ref, False)


def wrap_negative(fg: FunctionGraph, name: str, site) -> Ref:
    """where(ids < 0, ids + N, ids) of the site's ids, as keras.ops.take does."""
    np_type = dtypes.as_dtype(site.index_dtype).as_numpy_dtype
    ids_type, shape = DType(site.index_dtype), dims(fg.shape(site.indices))
    negative = fg.add_op(name + "/negative", "Less", [site.indices, fg.add_const(name + "/zero", np.array(0, np_type))],
                         {"T": ids_type}, shapes=[shape])
    shifted = fg.add_op(name + "/shifted", "AddV2",
                        [site.indices, fg.add_const(name + "/rows", np.array(site.table_shape[0], np_type))],
                        {"T": ids_type}, shapes=[shape])
    return fg.add_op(name, "SelectV2", [negative, shifted, site.indices], {"T": ids_type}, shapes=[shape])
