"""tf.gather(params, ids, batch_dims=1) of params that are one shared [N, D] table broadcast over the batch:
tf.broadcast_to(t[None], [tf.shape(ids)[0], N, D]) or tf.tile(t[None], [tf.shape(ids)[0], 1, 1]). Row
[b, k] is params[b, ids[b, k]] = t[ids[b, k]]: the row gather t[ids]. The broadcast's batch must be the ids'
own (tf.shape(ids)[0]), as the composite's gather requires it to be; params of any other batch (a table per
request, or a constant batch the ids may not have) stay reported."""
from __future__ import annotations

from typing import Optional

import numpy as np

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import through_identity
from pkm_serve.export.position_slices import attr_value


def shared_table_of_batched_gather(fg: FunctionGraph, node) -> Optional[Ref]:
    """The [N, D] table of GatherV2(broadcast(table[None]), ids, axis 1, batch_dims 1), else None."""
    if node.op != "GatherV2" or "batch_dims" not in node.attr or node.attr["batch_dims"].i != 1:
        return None
    params, ids, axis = fg.inputs(node)
    axis = fg.const_value(axis)
    if axis is None or int(axis) != 1 or fg.shape(ids).rank is None or fg.shape(ids).rank < 2:
        return None
    broadcast = fg.producer(through_identity(fg, params, []))
    if broadcast is None or broadcast.op not in ("BroadcastTo", "Tile"):
        return None
    expanded, shape = fg.inputs(broadcast)
    table = _unexpanded_table(fg, through_identity(fg, expanded, []))
    pack = fg.producer(shape)
    if table is None or pack is None or pack.op != "Pack" or len(fg.inputs(pack)) != 3:
        return None
    rest = [fg.const_value(r) for r in fg.inputs(pack)[1:]]
    table_dims = fg.shape(table).as_list()
    wanted = [1, 1] if broadcast.op == "Tile" else table_dims
    if any(r is None for r in rest) or [int(r) for r in rest] != wanted or \
            not _is_batch_of(fg, fg.inputs(pack)[0], through_identity(fg, ids, [])):
        return None
    return table


def _unexpanded_table(fg: FunctionGraph, ref: Ref) -> Optional[Ref]:
    """t of t[None] / tf.expand_dims(t, 0) / tf.reshape(t, [1, N, D]) for a 2-D t of known shape, else None."""
    node = fg.producer(ref)
    if node is None or node.op not in ("StridedSlice", "ExpandDims", "Reshape"):
        return None
    table = fg.inputs(node)[0]
    shape = fg.shape(table)
    if shape.rank != 2 or not shape.is_fully_defined() or fg.shape(ref).as_list() != [1] + shape.as_list():
        return None
    if node.op == "ExpandDims":
        axis = fg.const_value(fg.inputs(node)[1])
        return table if axis is not None and int(axis) == 0 else None
    if node.op == "StridedSlice":  # a new leading axis, strides 1: with the static shape kept, every element
        strides = fg.const_value(fg.inputs(node)[3])
        masks = {k: node.attr[k].i if k in node.attr else 0 for k in ("new_axis_mask", "shrink_axis_mask")}
        if strides is None or np.any(np.asarray(strides) != 1) or masks != {"new_axis_mask": 1,
                                                                             "shrink_axis_mask": 0}:
            return None
    return table  # a Reshape to [1, N, D] of an [N, D] tensor adds the axis only


def _is_batch_of(fg: FunctionGraph, ref: Ref, ids: Ref) -> bool:
    """tf.shape(ids)[0]: StridedSlice(Shape(ids), [0], [1], [1]) shrunk to a scalar."""
    node = fg.producer(ref)
    if node is None or node.op != "StridedSlice" or not (attr_value(node, "shrink_axis_mask", "i") & 1):
        return False
    begin, end, strides = (fg.const_value(r) for r in fg.inputs(node)[1:])
    shape_of = fg.producer(fg.inputs(node)[0])
    return begin is not None and end is not None and strides is not None and \
        np.ravel(begin).tolist() == [0] and np.ravel(end).tolist() == [1] and np.ravel(strides).tolist() == [1] and \
        shape_of is not None and shape_of.op == "Shape" and through_identity(fg, fg.inputs(shape_of)[0], []) == ids
