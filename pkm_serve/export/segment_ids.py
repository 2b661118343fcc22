"""int64 segment ids narrowed to the int32 the fused ops and their counting take, without wrapping."""
from __future__ import annotations

from typing import Optional

import numpy as np
from tensorflow.core.framework import attr_value_pb2, types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import tensor_dtype

I32 = DType(types_pb2.DT_INT32)


def int32_segment_ids(fg: FunctionGraph, seg: Ref, prefix: str) -> Ref:
    """int64 segment ids as int32, clamped to [-1, 2**31 - 1] first: a cast alone wraps (-2**32 + 1, which
    the composite drops, would be 1), and an id past int32 is >= any num_segments, refused as it stays."""
    seg_type = tensor_dtype(fg, seg)
    if seg_type == types_pb2.DT_INT32:
        return seg
    numpy_type = np.int64 if seg_type == types_pb2.DT_INT64 else np.int32
    for op, bound in (("Maximum", -1), ("Minimum", np.iinfo(np.int32).max)):
        seg = fg.add_op(f"{prefix}/seg_{op.lower()}", op, [seg, fg.add_const(
            f"{prefix}/seg_{op.lower()}_bound", np.array(bound, numpy_type))], {"T": DType(seg_type)},
            shapes=[[None]])
    return fg.add_op(prefix + "/seg32", "Cast", [seg], {"SrcT": DType(seg_type), "DstT": I32, "Truncate": False},
                     shapes=[[None]])


def int32_segment_count(fg: FunctionGraph, count: Ref, prefix: str, what: str = "num_segments") -> Ref:
    """An int64 num_segments as int32 without wrapping: 2**32 + 2 cast alone is 2 (the fused model answered
    with 2 bags where the composite refuses). One past int32 is refused by an Assert naming it; the TFLite
    converter drops Asserts, so it also becomes -1, which the counting refuses as negative. `what` names the
    count in the message (a SparseTensor's dense_shape[0] is one too)."""
    count_type = tensor_dtype(fg, count)
    if count_type == types_pb2.DT_INT32:
        return count
    typed = DType(count_type)
    numpy_type = np.int64 if count_type == types_pb2.DT_INT64 else np.int32
    largest = fg.add_const(prefix + "/int32_max", np.array(np.iinfo(np.int32).max, numpy_type))
    fits = fg.add_op(prefix + "/fits_int32", "LessEqual", [count, largest], {"T": typed}, shapes=[[]])
    message = fg.add_const(prefix + "/fits_int32/message", np.array(
        f"{what} is past 2**31 - 1, the most bags the fused op (PkmRaggedEmbeddingBag) counts; {what} =".encode()))
    check = fg.add_op(prefix + "/fits_int32/assert", "Assert", [fits, message, count],
                      {"T": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                          type=[types_pb2.DT_STRING, count_type])), "summarize": 1})
    minus_one = fg.add_const(prefix + "/minus_one", np.array(-1, numpy_type))
    floored = fg.add_op(prefix + "/floored", "Maximum", [count, minus_one], {"T": typed}, shapes=[[]])
    kept = fg.add_op(prefix + "/in_range", "SelectV2", [fits, floored, minus_one], {"T": typed}, shapes=[[]])
    return fg.add_op(prefix + "/count32", "Cast", [kept], {"SrcT": typed, "DstT": I32, "Truncate": False},
                     shapes=[[]], control=[check.node])


ROOM_FOR_BAGS = "pkm_room_for_bags"


def with_room_for_bags(fg: FunctionGraph, count: Ref, prefix: str, width: Optional[int], dtype: int) -> Ref:
    """The int32 bag count once an uninitialised [count, D] tensor of the table's dtype was allocated and
    freed: the composite allocates its [count, D] output first and fails with ResourceExhausted where that
    cannot be had (num_segments = 2**31 - 1); the fused site's int32 [count] counts, touched as they are
    built, would run the process out of memory first (killed, or a ResourceExhausted naming int32 counts).
    Empty does not touch the memory; the .tflite, which has no Empty, is converted without it (check_then).
    A negative count allocates no rows: the segment op counting the bags refuses it naming num_segments,
    as the composite's does, where Empty would say only "Dimension -1 must be >= 0"."""
    rows = fg.add_op(prefix + "/rows", "Maximum", [count, fg.add_const(prefix + "/no_rows", np.array(0, np.int32))],
                     {"T": I32}, shapes=[[]])
    shape = fg.add_op(prefix + "/shape", "Pack", [rows, fg.add_const(prefix + "/width", np.array(
        width or 1, np.int32))], {"T": I32, "N": 2, "axis": 0}, shapes=[[2]])
    room = fg.add_op(prefix + "/" + ROOM_FOR_BAGS, "Empty", [shape], {"dtype": DType(dtype), "init": False},
                     shapes=[[None, width]])
    return fg.add_op(prefix + "/counted", "Identity", [count], {"T": I32}, shapes=[[]], control=[room.node])
