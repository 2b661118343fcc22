"""RaggedRange rebuilt from TFLite builtins, where it feeds a fused op.

Ragged broadcasting (`ragged_ids_rows * ragged_weights[..., None]` in TF's
tpu_embedding_for_serving CPU path when ids and weights are two RaggedTensors)
re-gathers both operands by positions that RaggedRange computes; after fusion
those positions still feed the fused op (they pick the ids and weights), and
RaggedRange has no TFLite builtin. With unit deltas it is, for row i,
range(starts[i], limits[i]):

  lengths = max(limits - starts, 0)        splits = [0, cumsum(lengths)]
  row[j]  = #{i >= 1 : splits[i] <= j}     (a cumsum of marks at the row starts)
  values[j] = starts[row[j]] + j - splits[row[j]]

which is what this module writes, with Cumsum, UnsortedSegmentSum, Range and
Gather. A RaggedRange with other deltas is left as it is (the converter then
names it).
"""
from __future__ import annotations

from typing import Iterable, List

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.graph import DType, FunctionGraph, Ref, output_arg_counts

I32 = DType(types_pb2.DT_INT32)
_INT_TYPES = (types_pb2.DT_INT32, types_pb2.DT_INT64)


def rewrite_ragged_ranges(fg: FunctionGraph, fused: Iterable[str]) -> List[str]:
    """Rewrites every unit-delta RaggedRange from which a node of `fused` is
    reachable; returns the names of the replaced nodes (now unused)."""
    targets = set(fused)
    replaced = []
    for node in list(fg.fdef.node_def):
        if node.op != "RaggedRange" or not _unit_deltas(fg, node) or \
                not _feeds(fg, node.name, targets):
            continue
        _rewrite(fg, node)
        replaced.append(node.name)
    return replaced


def _unit_deltas(fg: FunctionGraph, node) -> bool:
    value_type = node.attr["T"].type if "T" in node.attr else types_pb2.DT_INT32
    starts, limits, deltas = fg.inputs(node)
    delta = fg.const_value(deltas)
    ranks = {fg.shape(starts).rank, fg.shape(limits).rank}
    return value_type in _INT_TYPES and delta is not None and bool(np.all(delta == 1)) \
        and ranks <= {0, 1} and 1 in ranks and fg.shape(deltas).rank in (0, 1)


def _feeds(fg: FunctionGraph, start: str, targets: set, limit: int = 2000) -> bool:
    seen, stack = set(), [start]
    while stack and len(seen) < limit:
        name = stack.pop()
        if name in targets:
            return True
        if name in seen:
            continue
        seen.add(name)
        node = fg.nodes[name]
        outputs = sum(c for _, c in output_arg_counts(node, fg.library_sigs))
        for i in range(outputs):
            stack.extend(c for c, _ in fg.consumers(Ref(name, i)))
    return False


def _rewrite(fg: FunctionGraph, node) -> None:
    name = node.name
    value_type = node.attr["T"].type if "T" in node.attr else types_pb2.DT_INT32
    splits_type = node.attr["Tsplits"].type if "Tsplits" in node.attr \
        else types_pb2.DT_INT64
    T = DType(value_type)
    starts, limits, _ = fg.inputs(node)
    p = name + "/pkm_builtin"

    def const(suffix, value, np_type=np.int32):
        return fg.add_const(f"{p}/{suffix}", np.array(value, np_type))

    def op(suffix, op_name, inputs, attrs, shape):
        return fg.add_op(f"{p}/{suffix}", op_name, inputs, attrs, shapes=[shape])

    def slice1(suffix, ref, begin, end, begin_mask, end_mask):
        return op(suffix, "StridedSlice", [ref, const(suffix + "_b", [begin]),
                                           const(suffix + "_e", [end]),
                                           const(suffix + "_s", [1])],
                  {"T": I32, "Index": I32, "begin_mask": begin_mask, "end_mask": end_mask,
                   "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}, [None])

    def cast(suffix, ref, src, dst):
        return op(suffix, "Cast", [ref], {"SrcT": DType(src), "DstT": DType(dst),
                                          "Truncate": False}, [None])

    # Broadcast starts and limits to each other (either may be a scalar).
    starts_b = op("starts", "AddV2", [starts, op("zero_l", "Sub", [limits, limits],
                                                  {"T": T}, None)], {"T": T}, [None])
    limits_b = op("limits", "AddV2", [limits, op("zero_s", "Sub", [starts, starts],
                                                  {"T": T}, None)], {"T": T}, [None])
    np_value = dtypes.as_dtype(value_type).as_numpy_dtype
    lengths = op("lengths", "Maximum", [op("span", "Sub", [limits_b, starts_b], {"T": T},
                                           [None]), const("zero", 0, np_value)],
                 {"T": T}, [None])
    lengths = cast("lengths32", lengths, value_type, types_pb2.DT_INT32) \
        if value_type != types_pb2.DT_INT32 else lengths
    axis0 = const("axis0", 0)
    ends = op("ends", "Cumsum", [lengths, axis0], {"T": I32, "Tidx": I32,
                                                  "exclusive": False, "reverse": False}, [None])
    splits = op("splits", "ConcatV2", [const("first", [0]), ends, axis0],
                {"N": 2, "T": I32, "Tidx": I32}, [None])
    total = op("total", "Sum", [lengths, axis0], {"T": I32, "Tidx": I32,
                                                  "keep_dims": False}, [])
    positions = op("positions", "Range", [const("pos0", 0), total, const("pos1", 1)],
                   {"Tidx": I32}, [None])
    inner = slice1("inner_starts", splits, 1, -1, 0, 0)
    ones = op("ones", "Fill", [op("inner_shape", "Shape", [inner], {"T": I32, "out_type": I32},
                                  [1]), const("one", 1)], {"T": I32, "index_type": I32},
              [None])
    marks = op("marks", "UnsortedSegmentSum",
               [ones, inner, op("slots", "AddV2", [total, const("one_more", 1)], {"T": I32},
                                [])], {"T": I32, "Tindices": I32, "Tnumsegments": I32}, [None])
    rows_all = op("rows_all", "Cumsum", [marks, axis0], {"T": I32, "Tidx": I32,
                                                         "exclusive": False, "reverse": False},
                  [None])
    rows = op("rows", "Slice", [rows_all, const("rows_begin", [0]),
                                op("rows_size", "Reshape", [total, const("vec", [1])],
                                   {"T": I32, "Tshape": I32}, [1])],
              {"T": I32, "Index": I32}, [None])

    def gather(suffix, params, dtype):
        return op(suffix, "GatherV2", [params, rows, axis0],
                  {"Tparams": DType(dtype), "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                  [None])
    row_first = slice1("row_first", splits, 0, -1, 1, 0)
    offsets = op("offsets", "Sub", [positions, gather("row_offset", row_first,
                                                      types_pb2.DT_INT32)], {"T": I32}, [None])
    if value_type != types_pb2.DT_INT32:
        offsets = cast("offsets_t", offsets, types_pb2.DT_INT32, value_type)
    values = op("values", "AddV2", [gather("row_start", starts_b, value_type), offsets],
                {"T": T}, [None])
    out_splits = cast("splits_t", splits, types_pb2.DT_INT32, splits_type) \
        if splits_type != types_pb2.DT_INT32 else splits
    fg.redirect(Ref(name, 0), out_splits)
    fg.redirect(Ref(name, 1), values)
