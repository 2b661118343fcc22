"""Row gathers of a 2-D table: tf.gather(table, ids) and tf.gather_nd(table, ids[..., None]), which
gathers the rows tf.gather(table, ids) does (one index per row, the ids' own shape). Such a
gather_nd is a row gather for every matcher (resolve_gather); the per-position matcher also takes
gather_nd(table, ids[..., k:k+1]) (or ids[..., k, None]) as the rows of position k; any other
gather_nd of a table is reported."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
from tensorflow.python.framework import tensor_shape

from pkm_serve.export.batched_gather import shared_table_of_batched_gather
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.one_hot_lookup import one_hot_gather
from pkm_serve.export.position_slices import slice_position
from pkm_serve.export.sites import (GATHER_OPS, ND_GATHER_OPS, TABLE_DTYPES, NotASite, Skip, dtype_name,
                                    through_identity)


class Gather:
    """A row gather `table[indices]`, possibly behind Identity nodes. `nd_position`: a gather_nd whose
    indices are ids[..., k:k+1], one position kept as the index axis (the rows' ids are ids[..., k])."""

    def __init__(self, output: Ref, params: Ref, is_resource: bool, indices: Ref,
                 nodes: List[str], table_shape, dtype: int, index_dtype: int, nd_position: bool = False):
        self.output, self.params, self.is_resource = output, params, is_resource
        self.indices, self.nodes = indices, nodes
        self.table_shape, self.dtype, self.index_dtype = table_shape, dtype, index_dtype
        self.nd_position = nd_position
        self.one_hot = False  # a one-hot matmul (one_hot_lookup.py): ids outside [0, N) are zero rows

    def ids_shape(self, fg: FunctionGraph):
        """The shape of the ids one row each is gathered for (the index axis of gather_nd's left out)."""
        shape = fg.shape(self.indices)
        return shape[:-1] if self.nd_position and shape.rank else shape


def ids_expanded_to_last_axis(fg: FunctionGraph, indices: Ref, nd_positions: bool = False) -> Tuple[Ref, bool]:
    """(ids, False) where gather_nd's `indices` are ids[..., None] or tf.expand_dims(ids, -1); with
    `nd_positions`, (indices, True) where they are ids[..., k:k+1] or ids[..., k, None]."""
    node = fg.producer(indices)
    reason = "tf.gather_nd of indices that are not ids[..., None] (one index per row): not fused"
    if nd_positions:
        position = slice_position(fg, indices)
        if position is not None and position[2]:  # a negative k is reported by the positions matcher
            return indices, True
    if node is None or node.op not in ("ExpandDims", "StridedSlice"):
        raise Skip(reason)
    ids = fg.inputs(node)[0]
    rank = fg.shape(ids).rank
    if node.op == "ExpandDims":
        axis = fg.const_value(fg.inputs(node)[1])
        if rank is None or axis is None or int(np.reshape(axis, [])) not in (-1, rank):
            raise Skip(reason)
        return ids, False
    masks = {k: node.attr[k].i if k in node.attr else 0 for k in
             ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    strides = fg.const_value(fg.inputs(node)[3])
    if masks["ellipsis_mask"] != 1 or masks["new_axis_mask"] != 2 or masks["shrink_axis_mask"] or \
            strides is None or list(np.reshape(strides, [-1])) != [1, 1]:
        raise Skip(reason)
    return ids, False  # ids[..., None]: the ellipsis keeps every axis, one new axis last


def resolve_gather(fg: FunctionGraph, ref: Ref, nd_positions: bool = False, flat_one_hot: bool = False) -> Gather:
    """Raises NotASite unless `ref` is rows of a 2-D table gathered on axis 0 (`nd_positions`:
    ids_expanded_to_last_axis'; `flat_one_hot`: a flattened one-hot lookup, rows reshaped back, is taken too)."""
    nodes: List[str] = []
    ref = through_identity(fg, ref, nodes)
    node = fg.producer(ref)
    one_hot = one_hot_gather(fg, ref, Gather, nodes, flat_one_hot)
    if one_hot is not None:
        return one_hot
    if node is None or node.op not in GATHER_OPS + ND_GATHER_OPS:
        raise NotASite()
    nodes.append(node.name)
    ins = fg.inputs(node)
    if "batch_dims" in node.attr and node.attr["batch_dims"].i != 0:
        table = shared_table_of_batched_gather(fg, node)  # a table broadcast over the batch: t[ids]
        if table is None:
            raise NotASite()
        ins = [table, ins[1], None]
    nd_position = False
    if node.op in ND_GATHER_OPS:  # gather_nd(table, ids[..., None]) is gather(table, ids)
        ids, nd_position = ids_expanded_to_last_axis(fg, ins[1], nd_positions)
        ins = [ins[0], ids, None]
    if node.op in ("ResourceGather", "ResourceGatherNd"):
        params, indices, is_resource = ins[0], ins[1], True
        dtype = node.attr["dtype"].type
        var = fg.variable_shape_dtype(params)
        table_shape = var[0] if var is not None else None
    else:
        params, indices, axis = ins
        axis_value = 0 if axis is None else fg.const_value(axis)
        if axis_value is None or int(axis_value) != 0:
            raise NotASite()
        is_resource = False
        dtype = node.attr["Tparams"].type
        table_shape = fg.shape(params)
    index_dtype = node.attr["Tindices"].type
    if table_shape is None or table_shape.rank is None:
        # A resource passed through nested functions may have lost its handle
        # data: gathered rank = indices rank + 1 still proves a [N, D] table.
        out_shape, idx_shape = fg.shape(ref), fg.shape(indices)[:-1] if nd_position else fg.shape(indices)
        if out_shape.rank is not None and idx_shape.rank is not None and \
                out_shape.rank == idx_shape.rank + 1:
            table_shape = tensor_shape.TensorShape([None, out_shape[-1]])
    gathered = Gather(ref, params, is_resource, indices, nodes, table_shape, dtype, index_dtype, nd_position)
    if table_shape is None or table_shape.rank != 2:
        raise Skip("table is not known to be 2-D")
    if dtype not in TABLE_DTYPES:
        raise Skip(f"table dtype {dtype_name(dtype)} is not float32/float16/bfloat16")
    return gathered
