"""tf.gather_nd(table, ids[..., None]) gathers the rows tf.gather(table, ids) does:
one index per row, the ids' own shape. Such a gather_nd is a row gather for every
matcher (dense.resolve_gather); any other gather_nd of a table is reported."""
from __future__ import annotations

import numpy as np

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip


def ids_expanded_to_last_axis(fg: FunctionGraph, indices: Ref) -> Ref:
    """ids, where gather_nd's `indices` are ids[..., None] or tf.expand_dims(ids, -1)."""
    node = fg.producer(indices)
    reason = "tf.gather_nd of indices that are not ids[..., None] (one index per row): not fused"
    if node is None or node.op not in ("ExpandDims", "StridedSlice"):
        raise Skip(reason)
    ids = fg.inputs(node)[0]
    rank = fg.shape(ids).rank
    if node.op == "ExpandDims":
        axis = fg.const_value(fg.inputs(node)[1])
        if rank is None or axis is None or int(np.reshape(axis, [])) not in (-1, rank):
            raise Skip(reason)
        return ids
    masks = {k: node.attr[k].i if k in node.attr else 0 for k in
             ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    strides = fg.const_value(fg.inputs(node)[3])
    if masks["ellipsis_mask"] != 1 or masks["new_axis_mask"] != 2 or masks["shrink_axis_mask"] or \
            strides is None or list(np.reshape(strides, [-1])) != [1, 1]:
        raise Skip(reason)
    return ids  # ids[..., None]: the ellipsis keeps every axis, one new axis last
