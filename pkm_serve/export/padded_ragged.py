"""Ragged bags padded to a dense tensor, then reduced over the bag axis:

  reduce_sum(tf.gather(table, ragged_ids).to_tensor(), axis=1)

is, in the graph, Sum(RaggedTensorToTensor(shape, rows, default, row_splits), 1)
with `rows` gathered by ragged_ids.values. to_tensor() pads each bag with
zero rows up to the longest, so the sum is the ragged bag sum: fused as
PkmRaggedEmbeddingBag 'sum' on those row_splits (as ragged.py fuses the
unpadded form). reduce_mean of the padded tensor divides each bag sum by the
longest bag's length, not by the bag's own: that is no bag mean, so it is
reported, as are a fixed `shape=` (which may cut bags or add rows), a nonzero
`default_value`, and `keepdims`.
"""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.dense import apply_rows, leads_to_gather, resolve_rows
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import NotASite, Site, Skip, check_private, through_identity


def padded_rows_node(fg: FunctionGraph, node):
    """The RaggedTensorToTensor of gathered rows that `node` reduces, or None."""
    producer = fg.producer(through_identity(fg, fg.inputs(node)[0], []))
    if producer is None or producer.op != "RaggedTensorToTensor" or \
            not leads_to_gather(fg, fg.inputs(producer)[1]):
        return None
    return producer


def match_padded_ragged(fg: FunctionGraph, node, site: Site) -> Site:
    """Sum over axis 1 of ragged gathered rows padded with zeros by to_tensor()."""
    padded = padded_rows_node(fg, node)
    if padded is None:
        raise NotASite()
    site.pattern = "ragged-reduce"
    shape_ref, values, default = fg.inputs(padded)[:3]
    partitions = fg.inputs(padded)[3:]
    rows = resolve_rows(fg, values, site)
    apply_rows(fg, site, rows, padded.name, values)
    axes = fg.const_value(fg.inputs(node)[1])
    kinds = [bytes(k) for k in padded.attr["row_partition_types"].list.s]
    if fg.shape(values).rank != 2 or kinds != [b"ROW_SPLITS"] or axes is None or \
            np.size(axes) != 1 or int(np.reshape(axes, [])) not in (1, -2):
        raise Skip("to_tensor() of ragged gathered rows reduced over another axis than the "
                   "bag axis, or of rows with more than one ragged dimension")
    if "keep_dims" in node.attr and node.attr["keep_dims"].b:
        raise Skip("reduction of to_tensor() rows with keepdims=True: not fused")
    shape = fg.const_value(shape_ref)
    width = site.table_shape[1] if site.table_shape else None
    if shape is not None and np.ndim(shape) == 1 and np.size(shape) == 3 and width is not None and \
            shape[-1] == width:
        shape = shape[:-1]  # to_tensor(shape=[None, None, D]): the rows' own width
    if shape is None or np.any(np.asarray(shape) != -1):
        raise Skip("to_tensor(shape=...) with a fixed shape: it may cut bags short or add rows, "
                   "which the op's bags do not")
    fill = fg.const_value(default)
    if fill is None or np.any(np.asarray(fill) != 0):
        raise Skip("to_tensor(default_value=...) pads with nonzero rows, which the bag would count")
    if node.op == "Mean":
        if site.dtype != "float32" or site.cast_enum not in (0, types_pb2.DT_FLOAT):
            raise Skip("reduce_mean of half-precision ragged rows padded by to_tensor(): its division "
                       "by the longest bag is not fused (TFLite has no half DIV)")
        site.divide_by_longest_bag = True  # the padded mean: every bag's sum / the longest bag's length
    site.combiner = "sum"
    site.internal = site.internal + (padded.name,)
    check_private(fg, [fg.inputs(node)[0]], set(site.internal) | {node.name}, site)
    site.row_splits = partitions[0]
    return site


def longest_bag_division(fg: FunctionGraph, site: Site, splits: Ref, out_dtype: int):
    """Steps dividing each float32 bag by the longest bag's length, the padded axis
    to_tensor() made: max(0, row_splits[1:] - row_splits[:-1]) of the int32 splits."""
    prefix = site.root + "/pkm_longest_bag"
    i32 = DType(types_pb2.DT_INT32)

    def piece(name, begin, end, begin_mask, end_mask):
        consts = [fg.add_const(f"{prefix}/{name}_{k}", np.array([v], np.int32))
                  for k, v in (("begin", begin), ("end", end), ("strides", 1))]
        return fg.add_op(f"{prefix}/{name}", "StridedSlice", [splits] + consts,
                         {"T": i32, "Index": i32, "begin_mask": begin_mask, "end_mask": end_mask,
                          "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}, shapes=[[None]])
    lengths = fg.add_op(prefix + "/lengths", "Sub", [piece("ends", 1, 0, 0, 1), piece("starts", 0, -1, 1, 0)],
                        {"T": i32}, shapes=[[None]])
    axis0 = fg.add_const(prefix + "/axis0", np.array(0, np.int32))
    with_zero = fg.add_op(prefix + "/with_zero", "ConcatV2",
                          [fg.add_const(prefix + "/zero", np.array([0], np.int32)), lengths, axis0],
                          {"N": 2, "T": i32, "Tidx": i32}, shapes=[[None]])
    longest = fg.add_op(prefix, "Max", [with_zero, axis0], {"T": i32, "Tidx": i32, "keep_dims": False},
                        shapes=[[]])
    as_float = fg.add_op(prefix + "/float", "Cast", [longest],
                         {"SrcT": i32, "DstT": DType(out_dtype), "Truncate": False}, shapes=[[]])
    return [("RealDiv", {"T": DType(out_dtype)}, lambda bag: [bag, as_float])]
