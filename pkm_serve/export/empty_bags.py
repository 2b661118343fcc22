"""Steps the fused site adds for bags without entries: which bags are empty (row_splits[1:] == row_splits[:-1]),
and the value the composite gives them selected in (the lowest value of a max, table[default_id] of safe_)."""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import I32
from pkm_serve.export.sites import Site, dims

_HALF = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)


def select_steps(fg: FunctionGraph, name: str, empty: Ref, value: Ref, dtype: int):
    """[(op, attrs, inputs(bag))] of SelectV2(empty, value, bag); a float16/bfloat16 bag is selected in float32
    and cast back (exact both ways): TFLite's SELECT_V2 takes neither."""
    if dtype not in _HALF:
        return [("SelectV2", {"T": DType(dtype)}, lambda bag: [empty, value, bag])]
    wide = fg.add_op(name + "/float", "Cast", [value], {"SrcT": DType(dtype), "DstT": DType(types_pb2.DT_FLOAT),
                                                         "Truncate": False}, shapes=[dims(fg.shape(value))])
    return [("Cast", {"SrcT": DType(dtype), "DstT": DType(types_pb2.DT_FLOAT), "Truncate": False}, lambda bag: [bag]),
            ("SelectV2", {"T": DType(types_pb2.DT_FLOAT)}, lambda bag: [empty, wide, bag]),
            ("Cast", {"SrcT": DType(types_pb2.DT_FLOAT), "DstT": DType(dtype), "Truncate": False}, lambda bag: [bag])]


def neighbours(fg: FunctionGraph, prefix: str, ref: Ref):
    """(v[1:], v[:-1]) of an int32 vector."""
    def const(name, value):
        return fg.add_const(f"{prefix}/{name}", np.array(value, np.int32))

    def strided(name, begin, end, begin_mask, end_mask):
        return fg.add_op(f"{prefix}/{name}", "StridedSlice",
                         [ref, const(name + "_begin", [begin]), const(name + "_end", [end]),
                          const(name + "_strides", [1])],
                         {"T": I32, "Index": I32, "begin_mask": begin_mask,
                          "end_mask": end_mask, "ellipsis_mask": 0, "new_axis_mask": 0,
                          "shrink_axis_mask": 0}, shapes=[[None]])
    return strided("later", 1, 0, 0, 1), strided("earlier", 0, -1, 1, 0)


def empty_bags(fg: FunctionGraph, site: Site, splits: Ref) -> Ref:
    """[rows, 1] bool: row_splits[1:] == row_splits[:-1]."""
    prefix = site.root + "/pkm_empty_bags"
    ends, starts = neighbours(fg, prefix, splits)
    same = fg.add_op(prefix + "/same", "Equal", [ends, starts],
                     {"T": I32, "incompatible_shape_error": True}, shapes=[[None]])
    last_axis = fg.add_const(prefix + "/last_axis", np.array(-1, np.int32))
    return fg.add_op(prefix, "ExpandDims", [same, last_axis],
                     {"T": DType(types_pb2.DT_BOOL), "Tdim": I32}, shapes=[[None, 1]])
