"""Asserts the fused graph adds where the fused op would compute something
other than the composite for ids the original refuses or reads otherwise:
negative ids (padding to the op, an error to the gather), ids >= N in the
positions a masked site makes padding (the composite gathers every id before
its tf.where, so its gather refuses them) and ids of another
rank than the site was matched at (the composite's reduction axis is fixed,
the op always reduces the ids' last axis), and a computed table's rows
where id counts set N (the composite's matmul refuses other rows). Each Assert is a control input of
the fused op. The TFLite converter drops Asserts."""
from __future__ import annotations

from typing import Optional

import numpy as np
from tensorflow.core.framework import attr_value_pb2, types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import DENSE_OP, RAGGED_OP, Site

I32 = DType(types_pb2.DT_INT32)
I64 = DType(types_pb2.DT_INT64)


def _non_negative(fg: FunctionGraph, ref: Ref, depth: int = 6) -> bool:
    """True where the graph itself proves every value of the int tensor >= 0
    (a composite that keeps negative ids from its gather: a constant, zeros,
    a hash bucket, max(ids, c >= 0), floormod(ids, c > 0), where(ids >= 0,
    ids, ...) with a non-negative other branch)."""
    node = fg.producer(ref)
    if node is None or depth == 0:
        return False
    ins = fg.inputs(node)
    if node.op == "Const":
        value = fg.const_value(ref)
        return value is not None and bool(np.all(np.asarray(value) >= 0))
    if node.op in ("ZerosLike", "OnesLike", "StringToHashBucketFast", "StringToHashBucketStrong",
                   "StringToHashBucket", "Size", "Shape", "Rank"):
        return True
    if node.op == "Identity":
        return _non_negative(fg, ins[0], depth - 1)
    if node.op == "Maximum":
        return any(_non_negative(fg, r, depth - 1) for r in ins)
    if node.op == "FloorMod":
        divisor = fg.const_value(ins[1])
        return divisor is not None and bool(np.all(np.asarray(divisor) > 0))
    if node.op in ("Select", "SelectV2"):
        cond, then_ref, else_ref = ins
        if _non_negative(fg, then_ref, depth - 1) and _non_negative(fg, else_ref, depth - 1):
            return True
        test = fg.producer(cond)
        if test is None or test.op not in ("GreaterEqual", "Greater", "Less", "LessEqual"):
            return False
        x, bound = fg.inputs(test)
        bound_value = fg.const_value(bound)
        if bound_value is None or np.asarray(bound_value).size != 1:
            return False
        bound_value = float(np.reshape(bound_value, []))
        # x >= b (b >= 0) or x > b (b >= -1) keeps x where true; x < b (b <= 0)
        # or x <= b (b <= -1) keeps x where false.
        keeps_x_if_true = (test.op == "GreaterEqual" and bound_value >= 0) or \
            (test.op == "Greater" and bound_value >= -1)
        keeps_x_if_false = (test.op == "Less" and bound_value <= 0) or \
            (test.op == "LessEqual" and bound_value <= -1)
        if keeps_x_if_true and then_ref == x:
            return _non_negative(fg, else_ref, depth - 1)
        if keeps_x_if_false and else_ref == x:
            return _non_negative(fg, then_ref, depth - 1)
    return False


def _reduce_ids(fg: FunctionGraph, prefix: str, ids: Ref, dtype: DType, op: str, name: str) -> Ref:
    """Min or Max over every id (a scalar; an empty request gives the reduction's identity)."""
    flat = fg.add_op(prefix + "/flat", "Reshape", [ids, fg.add_const(prefix + "/flat_shape", np.array([-1], np.int32))],
                     {"T": dtype, "Tshape": I32}, shapes=[[None]])
    return fg.add_op(prefix + name, op, [flat, fg.add_const(prefix + "/axis", np.array(0, np.int32))],
                     {"T": dtype, "Tidx": I32, "keep_dims": False}, shapes=[[]])


def _fused_op(site: Site) -> str:
    """The op the site is fused into: the dense one, or the ragged one for bags of a row partition."""
    ragged = site.segment_ids is not None or site.row_splits is not None or site.sparse_indices is not None
    return RAGGED_OP if ragged else DENSE_OP


def assert_ids_in_table(fg: FunctionGraph, site: Site, ids: Ref) -> Optional[str]:
    """An Assert that every id the composite gathered is >= 0: the composite's
    gather refuses a negative id ("indices[..] = -1 is not in [0, N)"), the
    fused op would take it as padding. One reduction (the smallest id; an empty
    request passes). None where the composite keeps negative ids from its
    gather itself (where(ids >= 0, ids, 0), max(ids, 0), ...): there the fused
    op's padding is what the composite computes. Returns the Assert's name (a
    control input of the fused op). The TFLite converter drops Asserts."""
    if site.pooled is not None or _non_negative(fg, ids):
        return None
    prefix = site.root + "/pkm_ids_check"
    dtype = DType(site.index_dtype)
    np_type = dtypes.as_dtype(site.index_dtype).as_numpy_dtype
    smallest = _reduce_ids(fg, prefix, ids, dtype, "Min", "/smallest")
    ok = fg.add_op(prefix + "/non_negative", "GreaterEqual",
                   [smallest, fg.add_const(prefix + "/zero", np.array(0, np_type))],
                   {"T": dtype}, shapes=[[]])
    rows = site.table_shape[0] if site.table_shape and site.table_shape[0] is not None else "N"
    return _assert(fg, prefix, ok,
                   f"{_fused_op(site)} (fused gather of {site.table or 'the table'} in {site.root}): an id is negative: "
                   f"indices[...] =", (smallest, site.index_dtype),
                   f"is not in [0, {rows}) (the original model's gather refuses it too; the fused op "
                   f"alone would have taken it as padding)", "/message_range")


def assert_masked_ids_below_rows(fg: FunctionGraph, site: Site, ids: Ref, params: Ref) -> Optional[str]:
    """An Assert that every id the composite gathered is < N, for a masked site
    (where(mask, rows, 0)): the composite gathers every id before the select,
    so its gather refuses an id >= N even in a masked position, while the
    fused op takes a masked position as padding (where(mask, ids, -1)) and
    never reads its id. Unmasked ids >= N the fused op refuses itself. One
    reduction (the largest id; an empty request passes). Returns the Assert's
    name (a control input of the fused op). The TFLite converter drops it. None where an id >= N is no error
    in the composite (a one-hot lookup's zero row, a count: ids_past_rows_padding)."""
    if site.mask is None or site.pooled is not None or site.ids_past_rows_padding:
        return None
    prefix = site.root + "/pkm_ids_bound_check"
    dtype = DType(site.index_dtype)
    largest = _reduce_ids(fg, prefix, ids, dtype, "Max", "/largest")
    rows = site.table_shape[0] if site.table_shape else None
    bound = _table_rows(fg, site, params, prefix)
    ok = fg.add_op(prefix + "/below_rows", "Less", [largest, bound], {"T": dtype}, shapes=[[]])
    return _assert(fg, prefix, ok,
                   f"{_fused_op(site)} (fused masked gather of {site.table or 'the table'} in {site.root}): an id is "
                   f"out of range: indices[...] =", (largest, site.index_dtype),
                   f"is not in [0, {rows if rows is not None else 'N'}) (the original model gathers every id "
                   f"before its mask and refuses it, masked or not; the fused op alone would have taken "
                   f"a masked one as padding)", "/message_range")


def _table_rows(fg: FunctionGraph, site: Site, params: Ref, prefix: str) -> Ref:
    """N, the table's rows, in the ids' dtype: a constant, or Shape(table)[0]."""
    dtype = DType(site.index_dtype)
    rows = site.table_shape[0] if site.table_shape else None
    if rows is not None:
        return fg.add_const(prefix + "/rows", np.array(rows, dtypes.as_dtype(site.index_dtype).as_numpy_dtype))
    shape = fg.add_op(prefix + "/table_shape", "Shape", [params],
                      {"T": DType(site.table_dtype), "out_type": dtype}, shapes=[[2]])
    return fg.add_op(prefix + "/rows", "GatherV2",
                     [shape, fg.add_const(prefix + "/zero", np.array(0, np.int32)),
                      fg.add_const(prefix + "/axis0", np.array(0, np.int32))],
                     {"Tparams": dtype, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[]])


def assert_table_rows(fg: FunctionGraph, site: Site, params: Ref) -> Optional[str]:
    """An Assert that a table whose rows were unknown at export has the N rows
    the counts have (counts [B, N] @ table): the original matmul refuses any
    other, the fused op would read the table whatever its rows. Returns the
    Assert's name (a control input of the fused op). The TFLite converter drops it."""
    if not site.rows_from_counts:
        return None
    prefix = site.root + "/pkm_table_rows_check"
    shape = fg.add_op(prefix + "/table_shape", "Shape", [params],
                      {"T": DType(site.table_dtype), "out_type": I64}, shapes=[[2]])
    rows = fg.add_op(prefix + "/rows", "GatherV2",
                     [shape, fg.add_const(prefix + "/zero", np.array(0, np.int32)),
                      fg.add_const(prefix + "/axis0", np.array(0, np.int32))],
                     {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[]])
    n = site.table_shape[0]
    ok = fg.add_op(prefix + "/same", "Equal", [rows, fg.add_const(prefix + "/expected", np.array(n, np.int64))],
                   {"T": I64, "incompatible_shape_error": True}, shapes=[[]])
    return _assert(fg, prefix, ok,
                   f"{DENSE_OP} (fused id counts times {site.table or 'the table'} in {site.root}): the table has",
                   (rows, types_pb2.DT_INT64),
                   f"rows, not the {n} the id counts have (the original model's matmul refuses it too)", "/message_rows")


def ids_below_rows(fg: FunctionGraph, site: Site, ids: Ref, params: Ref) -> Ref:
    """where(ids < N, ids, -1): a site whose composite counts the ids (bincount,
    one_hot) counts an id >= N nowhere, the op's padding; negative ids are
    padding to the op already."""
    prefix = site.root + "/pkm_ids_in_table"
    below = fg.add_op(prefix + "/below_rows", "Less", [ids, _table_rows(fg, site, params, prefix)],
                      {"T": DType(site.index_dtype)}, shapes=[None])
    pad = fg.add_const(prefix + "/padding_id", np.array(-1, dtypes.as_dtype(site.index_dtype).as_numpy_dtype))
    shape = fg.shape(ids)
    return fg.add_op(prefix, "SelectV2", [below, ids, pad], {"T": DType(site.index_dtype)},
                     shapes=[None if shape.rank is None else shape.as_list()])


def assert_ids_rank(fg: FunctionGraph, site: Site, ids: Ref) -> Optional[str]:
    """An Assert that the ids have the rank the site was matched at. The graph
    is built for the signature's shapes, but a server (TF Serving) feeds
    inputs of any shape: the composite's reduction (reduce_mean(rows, axis=1))
    then reads another axis of the rows, or gives another shape, while the
    fused op always reduces the ids' last axis. None where the rank is unknown
    (no site is matched there). Returns the Assert's name."""
    rank = fg.shape(ids).rank
    if rank is None:
        return None
    prefix = site.root + "/pkm_ids_rank_check"
    # Rank(ids) would be folded to the signature's rank (grappler, from the function's
    # argument shapes) and the Assert with it: the rank as the number of dims >= 0,
    # which a Where counts at run time.
    shape = fg.add_op(prefix + "/shape", "Shape", [ids], {"T": DType(site.index_dtype), "out_type": I32},
                      shapes=[[rank]])
    dims = fg.add_op(prefix + "/dims", "GreaterEqual", [shape, fg.add_const(prefix + "/zero", np.array(0, np.int32))],
                     {"T": I32}, shapes=[[rank]])
    where = fg.add_op(prefix + "/where", "Where", [dims], {"T": DType(types_pb2.DT_BOOL)}, shapes=[[None, 1]])
    got = fg.add_op(prefix + "/rank", "Size", [where], {"T": I64, "out_type": I32}, shapes=[[]])
    ok = fg.add_op(prefix + "/same", "Equal", [got, fg.add_const(prefix + "/expected", np.array(rank, np.int32))],
                   {"T": I32, "incompatible_shape_error": True}, shapes=[[]])
    return _assert(fg, prefix, ok,
                   f"{DENSE_OP} (fused gather of {site.table or 'the table'} in {site.root}): the ids have "
                   f"rank", (got, types_pb2.DT_INT32),
                   f"but the site was fused for ids of rank {rank} (the signature's), the only rank at "
                   f"which the fused op is known to reduce the axis the original model reduces; send "
                   f"ids of rank {rank}", "/message_rank")


def _assert(fg: FunctionGraph, prefix: str, ok: Ref, before: str, value, after: str, after_name: str) -> str:
    """Assert(ok, [before, value, after]) named `prefix`; value is (tensor, its dtype enum). Returns its name."""
    tensor, dtype = value
    string = types_pb2.DT_STRING
    check = fg.add_op(prefix, "Assert", [ok, fg.add_const(prefix + "/message", np.array(before.encode())), tensor,
                                         fg.add_const(prefix + after_name, np.array(after.encode()))],
                      {"T": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                          type=[string, dtype, string])), "summarize": 3})
    return check.node
