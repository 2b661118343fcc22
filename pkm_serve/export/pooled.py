"""A per-position sparse lookup pooled over the positions (keras-rs EmbedReduce
on a SparseTensor [B, L]: Keras 3's Embedding / ops.take looks up ids
expand_dims(sp, -1), one id a position):

  P = safe_embedding_lookup_sparse(table, ids [B, L, K], default_id=d)   [B*L, D]
  reduce_sum(reshape(P, [B, L, D]) [* w[..., None]], axis=1)              [B, D]

Row r = b*L + l of P combines (sum / mean / sqrtn) the ids at position (b, l)
(after SparseFillEmptyRows: an empty position holds id d; with default_id=None
it is a zero row). The pooled bag b is therefore a sum over the ids of its
positions, each weighted by w[b, l] (1 without a multiplier) times 1, 1/count
or 1/sqrt(count) of its position: PkmRaggedEmbeddingBag (sum) on those ids,
bags cut at multiples of L. A division that follows (EmbedReduce's mean and
sqrtn divide by the multiplier's sum) stays as written. The [B*L, D] and
[B, L, D] rows are never built.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export import fuse, sparse
from pkm_serve.export.dense import _check_bag_axis, _not_over_features, strip_trailing_unit_axis
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import (TABLE_DTYPES, NotASite, Site, Skip, check_private, dims, dtype_name,
                                    itemsize, tensor_dtype, through_identity)

PATTERN = "pooled-sparse-lookup"
I32, I64 = DType(types_pb2.DT_INT32), DType(types_pb2.DT_INT64)


@dataclasses.dataclass
class Pooled:
    """What the fused bag is built from (see the module doc)."""
    entry_rows: Ref      # int64 [E, 2]: row r of each id (column 0)
    entry_ids: Ref       # [E]
    rows_shape: Ref      # int64 [2]: [B*L, K], the ids as the lookup reshaped them
    target: Ref          # the reshape's target shape [B, L, D]
    multiplier: Optional[Ref]
    multiplier_squeeze: bool
    position_combiner: str
    shape_nodes: List[str]  # Shape(P) nodes: [B*L, D], rebuilt without P
    empty_rows: Optional[Ref] = None  # bool [B*L]: positions whose row is zeros (default_id=None)

    def bag_inputs(self, fg: FunctionGraph, site: Site, params: Ref):
        """fuse.py's (op, inputs, row_splits, Asserts to wait for: none) for the site, built into fg."""
        b = _Builder(fg, site.root + "/pkm_pooled")
        const, op = b.const, b.op
        rows64 = op("rows64", "StridedSlice", [self.rows_shape, const("b0", [0]), const("e0", [1]),
                                               const("s0", [1])], _slice_attrs(I64, shrink=1), [])
        self._shapes_without_params(fg, b, rows64, site.table_shape[1])
        bl, bags, per_bag = self._bags_and_positions(fg, b, rows64)
        # Each id's row r and bag r // L (L floored at 1: with L = 0 there are no ids).
        row = op("row64", "GatherV2", [self.entry_rows, const("col0", 0), const("axis1", 1)],
                 {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, [None])
        row = fuse._cast(fg, f"{b.prefix}/row", row, types_pb2.DT_INT64, types_pb2.DT_INT32, [None])
        per_bag = op("positions_min1", "Maximum", [per_bag, const("one_l", 1)], {"T": I32}, [])
        bag = op("bag", "FloorDiv", [row, per_bag], {"T": I32}, [None])  # sorted: the fill sorts by row
        ids_shape = op("ids_shape", "Shape", [bag], {"T": I32, "out_type": I32}, [1])
        ones = op("ones", "Fill", [ids_shape, const("one_each", 1)], {"T": I32, "index_type": I32}, [None])
        counts = op("counts", "UnsortedSegmentSum", [ones, bag, bags],
                    {"T": I32, "Tindices": I32, "Tnumsegments": I32}, [None])
        ends = op("ends", "Cumsum", [counts, const("axis0c", 0)],
                  {"T": I32, "Tidx": I32, "exclusive": False, "reverse": False}, [None])
        splits = op("row_splits", "ConcatV2", [const("zero1", [0]), ends, const("axis0s", 0)],
                    {"N": 2, "T": I32, "Tidx": I32}, [None])
        weight = self._id_weights(fg, site, b, rows64, row, bl, ones)
        return fuse.RAGGED_OP, [params, self.entry_ids, splits, weight], splits, []

    def _shapes_without_params(self, fg: FunctionGraph, b, rows64: Ref, width: int):
        """Each Shape(P) node ([B*L, D]) rebuilt from the ids' row count and the table's width."""
        const, op = b.const, b.op
        for name in self.shape_nodes:  # Shape(P) == [B*L, D]
            attrs = fg.nodes[name].attr
            out_type = attrs["out_type"].type if "out_type" in attrs else types_pb2.DT_INT32
            count = fuse._cast(fg, f"{name}/pkm_rows", rows64, types_pb2.DT_INT64, out_type, [])
            count = op(f"{name}_rows1", "Reshape", [count, const(f"{name}_one", [1])],
                       {"T": DType(out_type), "Tshape": I32}, [1])
            fg.replace_node(name, "ConcatV2", [count, fg.add_const(
                f"{name}/pkm_width", np.array([width], np.int64 if out_type == types_pb2.DT_INT64 else np.int32)),
                const(f"{name}_axis", 0)], {"N": 2, "T": DType(out_type), "Tidx": I32})

    def _bags_and_positions(self, fg: FunctionGraph, b, rows64: Ref):
        """[B, L], B and L as the composite's reshape computes them (same -1 inference, same
        errors): a [B*L, 1] tensor of zeros reshaped to [target[0], target[1], 1]."""
        const, op = b.const, b.op
        t_type = DType(tensor_dtype(fg, self.target))
        t_np = np.int64 if t_type == I64 else np.int32
        rows_1 = op("rows_1", "StridedSlice", [self.rows_shape, const("b5", [0]), const("e5", [1]), const("s5", [1])],
                    _slice_attrs(I64), [1])
        rows_1 = op("rows_by_1", "ConcatV2", [rows_1, const("one64", [1], np.int64), const("axis0z", 0)],
                    {"N": 2, "T": I64, "Tidx": I32}, [2])
        zeros = op("zeros", "Fill", [rows_1, const("zero", 0)], {"T": I32, "index_type": I64}, [None, 1])
        head = op("target_bl", "StridedSlice", [self.target, const("b1", [0]), const("e1", [2]), const("s1", [1])],
                  _slice_attrs(t_type), [2])
        unit_target = op("target_bl1", "ConcatV2", [head, const("one", [1], t_np), const("axis0", 0)],
                         {"N": 2, "T": t_type, "Tidx": I32}, [3])
        grid = op("grid", "Reshape", [zeros, unit_target], {"T": I32, "Tshape": t_type}, [None, None, 1])
        grid_shape = op("grid_shape", "Shape", [grid], {"T": I32, "out_type": I32}, [3])
        bl = op("bl", "StridedSlice", [grid_shape, const("b2", [0]), const("e2", [2]), const("s2", [1])],
                _slice_attrs(I32), [2])
        bags = op("bags", "StridedSlice", [grid_shape, const("b3", [0]), const("e3", [1]), const("s3", [1])],
                  _slice_attrs(I32, shrink=1), [])
        per_bag = op("positions", "StridedSlice", [grid_shape, const("b4", [1]), const("e4", [2]),
                                                   const("s4", [1])], _slice_attrs(I32, shrink=1), [])
        return bl, bags, per_bag

    def _id_weights(self, fg: FunctionGraph, site: Site, b, rows64: Ref, row: Ref, bl: Ref, ones: Ref) -> Ref:
        """Each id's weight: w[b, l] times its position's 1, 1/count or 1/sqrt(count)."""
        const, op, prefix = b.const, b.op, b.prefix
        w_type = tensor_dtype(fg, self.multiplier) if self.multiplier is not None else types_pb2.DT_FLOAT
        if w_type not in TABLE_DTYPES:
            w_type = types_pb2.DT_FLOAT
        weight = None
        if self.multiplier is not None:
            w = self.multiplier
            if tensor_dtype(fg, w) != w_type:
                w = fuse._cast(fg, f"{prefix}/w_cast", w, tensor_dtype(fg, w), w_type, None)
            if self.multiplier_squeeze:
                w = fuse._squeeze_last(fg, f"{prefix}/w_squeezed", w, w_type)
            # Broadcast to [B, L] (an error, not a larger product, where w has more rows than the ids).
            w = op("w_bl", "BroadcastTo", [w, bl], {"T": DType(w_type), "Tidx": I32}, [None, None])
            w = op("w_flat", "Reshape", [w, const("minus1", [-1])], {"T": DType(w_type), "Tshape": I32}, [None])
            weight = op("w_of_ids", "GatherV2", [w, row, const("axis0w", 0)],
                        {"Tparams": DType(w_type), "Tindices": I32, "Taxis": I32, "batch_dims": 0}, [None])
        if self.position_combiner != "sum":
            rows32 = fuse._cast(fg, f"{prefix}/rows32", rows64, types_pb2.DT_INT64, types_pb2.DT_INT32, [])
            at_position = op("position_counts", "UnsortedSegmentSum", [ones, row, rows32],
                             {"T": I32, "Tindices": I32, "Tnumsegments": I32}, [None])
            count = op("count_of_ids", "GatherV2", [at_position, row, const("axis0p", 0)],
                       {"Tparams": I32, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, [None])
            count = fuse._cast(fg, f"{prefix}/count", count, types_pb2.DT_INT32, w_type, [None])
            if self.position_combiner == "mean":
                one = fg.add_const(f"{prefix}/one_weight", np.ones([], dtypes.as_dtype(w_type).as_numpy_dtype))
                scale = op("position_scale", "RealDiv", [one, count], {"T": DType(w_type)}, [None])
            else:
                scale = op("position_scale", "Rsqrt", [count], {"T": DType(w_type)}, [None])
            weight = scale if weight is None else op("weights", "Mul", [weight, scale], {"T": DType(w_type)}, [None])
        if weight is None:
            weight = op("weights", "Cast", [ones], {"SrcT": I32, "DstT": DType(w_type), "Truncate": False}, [None])
        if self.empty_rows is not None:
            empty = op("empty_of_ids", "GatherV2", [self.empty_rows, row, const("axis0e", 0)],
                       {"Tparams": DType(types_pb2.DT_BOOL), "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                       [None])
            zero = fg.add_const(f"{prefix}/zero_weight", np.zeros([], dtypes.as_dtype(w_type).as_numpy_dtype))
            weight = op("weights_of_filled", "SelectV2", [empty, zero, weight], {"T": DType(w_type)}, [None])
        if w_type != site.table_dtype:
            weight = fuse._cast(fg, f"{prefix}/weights_cast", weight, w_type, site.table_dtype, [None])
        return weight


class _Builder:
    """Nodes of one site's rewrite, named under `prefix`."""

    def __init__(self, fg: FunctionGraph, prefix: str):
        self.fg, self.prefix = fg, prefix

    def const(self, name, value, dtype=np.int32) -> Ref:
        return self.fg.add_const(f"{self.prefix}/{name}", np.array(value, dtype))

    def op(self, name, op_name, inputs, attrs, shape) -> Ref:
        return self.fg.add_op(f"{self.prefix}/{name}", op_name, inputs, attrs, shapes=[shape])


def _slice_attrs(dtype: DType, shrink: int = 0) -> dict:
    return {"T": dtype, "Index": I32, "begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0,
            "new_axis_mask": 0, "shrink_axis_mask": shrink}


def _is_position_mask(fg: FunctionGraph, ref: Ref) -> bool:
    """SparseToDense(ids, shape, ones, 0): 1 where a position holds an id, else 0
    (keras-rs EmbedReduce's multiplier without weights)."""
    from pkm_serve.export.dense import is_ones
    node = fg.producer(ref)
    if node is None or node.op != "SparseToDense":
        return False
    default = fg.const_value(fg.inputs(node)[3])
    return is_ones(fg, fg.inputs(node)[2]) and default is not None and not np.any(default)


def _per_position_lookup(fg: FunctionGraph, ref: Ref):
    """(reshape node, the per-position lookup's Site, nodes on the way) when `ref`
    is reshape(safe_embedding_lookup_sparse(...)); None otherwise."""
    nodes: List[str] = []
    ref = through_identity(fg, ref, nodes)
    reshape = fg.producer(ref)
    if reshape is None or reshape.op != "Reshape":
        return None
    lookup = through_identity(fg, fg.inputs(reshape)[0], nodes)
    node = fg.producer(lookup)
    if node is not None and node.op in ("Select", "SelectV2"):  # default_id=None zeroes empty positions
        node = fg.producer(fg.inputs(node)[2])
    if node is None or node.op not in sparse.SPARSE_SEGMENT_COMBINERS:
        return None
    inner = Site(function=fg.fdef.signature.name, root=node.name, pattern="embedding_lookup_sparse")
    try:
        inner = sparse.match_sparse_segment(fg, node, inner)
    except NotASite:
        return None
    except Skip as e:
        raise Skip(f"the per-position sparse lookup pooled here is not fusable: {e}") from None
    if Ref(inner.root, 0) != lookup:
        return None
    if inner.num_segments is not None:
        raise Skip("the per-position sparse lookup pooled here sets num_segments: not fused with the pooling")
    if inner.pattern != "safe_embedding_lookup_sparse":
        raise Skip("the rows pooled over L are embedding_lookup_sparse without SparseFillEmptyRows: "
                   "only safe_embedding_lookup_sparse, which gives every position its row, is fused "
                   "with the pooling")
    return reshape, lookup, inner, nodes


def match_pooled_positions(fg: FunctionGraph, node, site: Site) -> Site:
    """Sum over axis 1 of reshape(per-position sparse lookup, [B, L, D]) [* w[..., None]]."""
    x, axis_ref = fg.inputs(node)
    _not_over_features(fg, x, fg.const_value(axis_ref))
    nodes: List[str] = []
    x = through_identity(fg, x, nodes)
    product = fg.producer(x)
    found, multiplier = None, None
    if product is not None and product.op == "Mul":
        for rows_ref, m_ref in (fg.inputs(product), reversed(fg.inputs(product))):
            found = _per_position_lookup(fg, rows_ref)
            if found is not None:
                multiplier, private = m_ref, [x, rows_ref]
                nodes.append(product.name)
                break
    else:
        found, private = _per_position_lookup(fg, x), [x]
    if found is None:
        raise NotASite()
    reshape, lookup, inner, inner_nodes = found
    site.pattern = PATTERN
    for key in ("params", "params_is_resource", "table", "table_shape", "dtype", "table_dtype", "index_dtype"):
        setattr(site, key, getattr(inner, key))
    rows_shape = fg.shape(Ref(reshape.name, 0))
    site.gathered_shape = dims(rows_shape)
    _check_bag_axis(fg, node, x, fg.const_value(axis_ref), site)
    width = site.table_shape[1] if site.table_shape else None
    if rows_shape.rank != 3 or width is None or rows_shape[-1] != width:
        raise Skip(f"the per-position sparse lookup is reshaped to {rows_shape}, not proven to be "
                   f"[B, L, {width}]: only a pooling over the positions of [B, L] ids is fused")
    if inner.combiner not in ("sum", "mean", "sqrtn") or inner.cast_enum or inner.divide_by_bag or \
            inner.weights is not None:
        raise Skip(f"the per-position lookup is not an unweighted sum, mean or sqrtn ({inner.combiner})")
    squeeze, strip_nodes = False, []
    if multiplier is not None:
        multiplier, strip_nodes, squeeze = strip_trailing_unit_axis(fg, multiplier)
        site.masked = _is_position_mask(fg, multiplier)
        site.weighted = not site.masked
        w_shape = fg.shape(multiplier)
        if w_shape.rank is None or w_shape.rank - squeeze != 2:
            raise Skip(f"the multiplier {w_shape} of the pooled positions is not one weight per "
                       "position ([B, L])")
        if tensor_dtype(fg, multiplier) not in TABLE_DTYPES:
            raise Skip(f"the multiplier is {dtype_name(tensor_dtype(fg, multiplier))}, not a float")
    if site.masked:
        site.mask = multiplier  # for the report; the bag is built from Pooled.multiplier
    else:
        site.weights = multiplier
    fill = [c for c, pos in fg.consumers(inner.sparse_indices)
            if fg.nodes[c].op == "SparseFillEmptyRows" and pos == 0]
    if len(fill) != 1:
        raise Skip("the per-position lookup's ids are not filled once (SparseFillEmptyRows)")
    # The filled ids, grouped by position as the composite reads them (SparseFillEmptyRows
    # sorts by row). With default_id=None an empty position is a zero row: its filled id weighs 0.
    entry_rows, entry_ids = Ref(fill[0], 0), Ref(fill[0], 1)
    empty = Ref(fill[0], 2) if inner.default_id is None else None
    shape_nodes = [c for c, _ in fg.consumers(lookup) if fg.nodes[c].op == "Shape"]
    internal = list(inner.internal) + [inner.root] + inner_nodes + [reshape.name] + nodes + strip_nodes
    site.internal = tuple(n for n in dict.fromkeys(internal) if n != node.name)
    site.intermediate_itemsizes = (itemsize(site.table_dtype),) * (2 + (multiplier is not None))
    check_private(fg, [lookup, Ref(reshape.name, 0)] + private,
                  set(site.internal) | {node.name} | set(shape_nodes))
    site.pooled = Pooled(entry_rows, entry_ids, inner.dense_shape, fg.inputs(reshape)[1], multiplier,
                         squeeze, inner.combiner, shape_nodes, empty)
    return site
