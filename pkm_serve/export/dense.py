"""Dense sites: rows gathered from a 2-D table, reduced over the bag axis.

  GatherV2/ResourceGather (or gather_nd of ids[..., None]) [-> Cast] [-> Mul by w[..., None]] [-> tf.where(mask, rows, 0)]
      -> Sum / Mean over axis -2          (the steps above in any order, each at most once)
  a gather of reshape(ids, [-1]) reshaped back to ids.shape + [D] is a gather of ids (einsum: einsum.py)

Keras writes these too: `Embedding` is a gather, `mask_zero=True` + `GlobalAveragePooling1D` is `where(mask, rows,
0)` summed and divided by the mask's sum (the division stays), mixed precision casts the rows.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
from tensorflow.python.framework import tensor_shape

from pkm_serve.export.gather_nd import Gather, resolve_gather  # noqa: F401 (the matchers import them from here)
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.half_rounding import rounds_to_half
from pkm_serve.export.no_nan_multiply import multiply_op, note_zero_weights
from pkm_serve.export.one_hot_lookup import flattened_one_hot_lookup, one_hot_lookup
from pkm_serve.export.per_index import (check_mask_reads_rows, check_weights_and_mask, may_broadcast_ids,
                                        per_index_shape)
from pkm_serve.export.sites import (GATHER_OPS, INDEX_DTYPES, ND_GATHER_OPS, TABLE_DTYPES, NotASite, Site, Skip,
                                    check_private, dims, dtype_name, itemsize, same_dims,
                                    tensor_dtype, through_identity)
from pkm_serve.export.transposed_rows import check_transposed_shape_unread, reduced_rows, weigh_after_transpose
from pkm_serve.export.unflatten import WEIGHTED_BEFORE_RESHAPE, check_flattened, unflattened_ids, weights_per_flat_id
from pkm_serve.export import masked_max
from pkm_serve.export.zero_fill import _is_zero, zeros_like_another


def leads_to_gather(fg: FunctionGraph, ref: Ref, depth: int = 8) -> bool:
    """True if `ref` is gathered rows behind the steps resolve_rows accepts."""
    node = fg.producer(ref)
    if node is None or depth == 0:
        return False
    if node.op in GATHER_OPS + ND_GATHER_OPS or one_hot_lookup(fg, node) is not None or \
            flattened_one_hot_lookup(fg, node) is not None:
        return True
    ins = fg.inputs(node)
    if node.op in ("Identity", "Cast", "Reshape"):
        return leads_to_gather(fg, ins[0], depth - 1)
    if node.op == "Mul":
        return any(leads_to_gather(fg, r, depth - 1) for r in ins)
    if node.op in ("Neg", "RealDiv", "MulNoNan", "DivNoNan"):  # -rows, rows / d (scales.py), the *_no_nan of them
        return leads_to_gather(fg, ins[0], depth - 1)
    if node.op == "SelectV2":
        return any(leads_to_gather(fg, r, depth - 1) for r in ins[1:])
    return False


def strip_trailing_unit_axis(fg: FunctionGraph, ref: Ref, what: str = "multiplier"
                             ) -> Tuple[Ref, List[str], bool]:
    """A per-index multiplier (or mask) broadcast to the rows' shape ->
    (per-index tensor, nodes, squeeze). w[..., None], w[:, :, None],
    expand_dims(w, -1) and reshape(w, shape + [1]) give w itself; any other
    tensor of shape [..., K, 1] (a re-gathered or cast expansion) is per-index
    too, and `squeeze` says the op must drop its last axis. A Tile or
    BroadcastTo of such a tensor onto the rows' width is looked through."""
    nodes: List[str] = []
    ref = _through_width_broadcast(fg, ref, nodes)
    node = fg.producer(ref)
    out_shape = fg.shape(ref)
    reason = f"{what} is not per-index (broadcast on the last axis of the rows)"
    if out_shape.rank is None or out_shape.rank == 0 or out_shape[-1] != 1:
        raise Skip(reason)
    if node is not None:
        ins = fg.inputs(node)
        if node.op == "ExpandDims":
            axis = fg.const_value(ins[1])
            if axis is not None and int(axis) in (-1, out_shape.rank - 1):
                return ins[0], nodes + [node.name], False
        elif node.op == "StridedSlice" and adds_unit_axis(fg, node, ins, -1):
            return ins[0], nodes + [node.name], False
        elif node.op == "Reshape":
            in_shape = fg.shape(ins[0])
            # [n] -> [n, 1] is exact whatever n is; higher ranks only when every
            # dim is known (a reshape could otherwise also permute the leading dims).
            if (in_shape.rank == 1 and out_shape.rank == 2) or (
                    out_shape.is_fully_defined() and
                    same_dims(in_shape.concatenate([1]), out_shape)):
                return ins[0], nodes + [node.name], False
    return ref, nodes, True


def _through_width_broadcast(fg: FunctionGraph, ref: Ref, nodes: List[str]) -> Ref:
    """Tile(x, [1, .., 1, D]) / BroadcastTo(x, [..., D]) of an x whose last
    axis is 1 and rank is the same -> x (the broadcast is what Mul does anyway)."""
    node = fg.producer(ref)
    while node is not None and node.op in ("Tile", "BroadcastTo", "Identity"):
        x = fg.inputs(node)[0]
        x_shape, out_shape = fg.shape(x), fg.shape(ref)
        if node.op != "Identity":
            if x_shape.rank is None or x_shape.rank != out_shape.rank or x_shape[-1] != 1:
                return ref
            if node.op == "Tile":
                multiples = fg.const_value(fg.inputs(node)[1])
                if multiples is None or np.any(np.asarray(multiples)[:-1] != 1):
                    return ref
        nodes.append(node.name)
        ref, node = x, fg.producer(x)
    return ref


def is_ones(fg: FunctionGraph, ref: Ref, depth: int = 6) -> bool:
    """True if `ref` is all ones whatever the input: a constant, OnesLike,
    Fill(shape, 1), or any of those expanded, cast, reshaped or re-gathered."""
    node = fg.producer(ref)
    if node is None or depth == 0:
        return False
    value = fg.const_value(ref)
    if value is not None:
        return value.size > 0 and bool(np.all(value == 1))
    ins = fg.inputs(node)
    if node.op == "OnesLike":
        return True
    if node.op == "Fill":
        fill = fg.const_value(ins[1])
        return fill is not None and bool(np.all(fill == 1))
    if node.op in ("ExpandDims", "Reshape", "Cast", "Identity", "Tile", "BroadcastTo",
                   "Squeeze", "GatherV2", "StridedSlice"):
        return is_ones(fg, ins[0], depth - 1)
    return False


def adds_unit_axis(fg: FunctionGraph, node, ins, position: int) -> bool:
    """A StridedSlice that keeps every axis whole and adds one new axis at slice
    entry `position` (negative): -1 is x[..., None] or x[:, :, None], -2 is
    x[..., None, :] or x[:, None, :]."""
    begin, strides = fg.const_value(ins[1]), fg.const_value(ins[3])
    if begin is None or strides is None or np.any(np.asarray(strides) != 1):
        return False
    masks = {k: node.attr[k].i if k in node.attr else 0 for k in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    n = len(np.ravel(begin))
    new_at = n + position
    if new_at < 0 or masks["shrink_axis_mask"] or masks["new_axis_mask"] != 1 << new_at:
        return False
    for i in range(n):
        bit = 1 << i
        whole = masks["begin_mask"] & bit and masks["end_mask"] & bit
        if i != new_at and not (masks["ellipsis_mask"] & bit or whole):
            return False
    return True


def is_scalar(fg: FunctionGraph, ref: Ref, rows_rank: Optional[int]) -> bool:
    """One value for every row ([] or [1, .., 1], no more axes than the rows):
    a scalar weight, which the op takes broadcast to the ids."""
    shape = fg.shape(ref)
    return shape.rank is not None and rows_rank is not None and shape.rank <= rows_rank and \
        all(d == 1 for d in shape.as_list())


class Rows:
    """Gathered rows on their way to a reduction, with what was done to them."""

    def __init__(self):
        self.gather: Optional[Gather] = None
        self.weights: Optional[Ref] = None
        self.mask: Optional[Ref] = None
        self.mask_keeps_true = True
        self.cast_enum = 0
        self.rounded_enum = 0  # an inner cast to a half dtype (cast_enum is the outer one)
        self.weights_squeeze = self.mask_squeeze = self.weights_after_mask = False
        self.weights_scalar = False
        self.weights_unit_row = False  # weights [..., 1, K] applied after a transpose: read without axis -2
        self.ones: Optional[Ref] = None  # a multiplier that is all ones
        self.ones_squeeze = False
        self.zero_fill = None  # zero_fill.zeros_like_another's: the ids are broadcast like it
        self.max_fill: Optional[Ref] = None  # a max's constant fill of masked rows (masked_max.py)
        self.factors: list = []  # scales.Factor: more multipliers, divisors, negations (fold_scales)
        self.multiplied: List[Ref] = []  # refs from the multiply on (toward the reduction)
        self.regathers: List[Ref] = []  # GatherV2(rows, perm) steps, outermost first
        self.as_gathered: List[Ref] = []  # refs below the last re-gather (rows as gathered)
        self.unflattened: Optional[Ref] = None  # ids whose flattened rows were reshaped back
        self.unflattened_rows: Optional[Ref] = None  # that reshape's output
        self.flat_from = 0              # rows.private[flat_from:] are the flattened rows
        self.weighted_before_reshape = False  # weights or mask applied to the rows before that reshape
        self.flat_ids: Optional[Ref] = None  # the ids the flattened rows were gathered for
        self.nodes: List[str] = []      # steps between gather and reduction
        self.private: List[Ref] = []    # their outputs: only the site may read them
        self.itemsizes: List[int] = []  # one per [..., K, D] tensor they build


def resolve_rows(fg: FunctionGraph, ref: Ref, site: Site, nd_positions: bool = False, scaling=None,
                 transposed: Optional[Ref] = None) -> Rows:
    """Walks from the reduction's input down to the gather through at most one
    Cast (and an inner Cast to a half dtype that it undoes), one Mul by per-index weights and one tf.where mask (in any order);
    with `scaling` (the scales module), also more multipliers, divisors and negations.
    Fills `site` as it learns, so a Skip reports what was found. `transposed`: the output of a Transpose
    of the rows that the caller read the reduction's axes through (transposed_rows.py), a shape-only step."""
    rows = Rows()
    while True:
        node = fg.producer(ref)
        if node is None:
            raise NotASite()
        ins = fg.inputs(node)
        op = multiply_op(fg, node, ins, leads_to_gather, rows)
        weights_before, factors_before = rows.weights, len(rows.factors)
        rows.as_gathered.append(ref)
        flat_one_hot = rows.unflattened_rows is not None and flattened_one_hot_lookup(fg, node) is not None
        if (node.op in GATHER_OPS + ND_GATHER_OPS or one_hot_lookup(fg, node) or flat_one_hot) and \
                not _is_regather(fg, node, ins):
            rows.gather = resolve_gather(fg, ref, nd_positions, flat_one_hot)
            if rows.unflattened_rows is not None and rows.unflattened is None:  # rows of its ids regrouped
                rows.unflattened = rows.gather.indices
            if rows.unflattened is not None:
                rows.flat_ids, rows.gather.indices = rows.gather.indices, rows.unflattened
                if site.regroup_ids is None and rows.flat_ids != rows.unflattened:  # a one-hot's are the ids
                    check_flattened(fg, rows.flat_ids, rows.unflattened)
            rows.private.append(rows.gather.output)
            rows.private.extend(Ref(n, 0) for n in rows.gather.nodes[:-1])
            rows.itemsizes.append(itemsize(rows.gather.dtype))
            return rows
        if node.op == "Identity":
            rows.nodes.append(node.name)
            rows.private.append(ref)
            ref = ins[0]
            continue
        if ref == transposed:  # shape-only; the refs above it are not shaped as the rows gathered
            rows.as_gathered = []
            step_input = ins[0]
        elif node.op == "GatherV2":
            # rows[perm] = table[ids[perm]]: ragged broadcasting re-gathers the rows.
            rows.regathers.append(ins[1])
            rows.as_gathered = []
            step_input = ins[0]
        elif node.op == "Cast" and not rows.cast_enum:
            if node.attr["DstT"].type not in TABLE_DTYPES or not (ins[0] == transposed or leads_to_gather(fg, ins[0])):
                raise NotASite()
            # Walking down, the first cast met is the outermost: its dtype is
            # what the reduction sees.
            rows.cast_enum = node.attr["DstT"].type
            site.cast_to = dtype_name(rows.cast_enum)
            step_input = ins[0]
        elif node.op == "Cast" and rounds_to_half(fg, node, ins, rows, leads_to_gather):
            # Keras mixed precision: rows cast to float16/bfloat16 (the layer's compute
            # dtype) and back to float32 for the reduction. The op skips that rounding:
            # it sums the rows as they are (in float32) and the bag gets the outer cast.
            rows.rounded_enum = node.attr["DstT"].type
            site.rounded_to = dtype_name(rows.rounded_enum)
            step_input = ins[0]
        elif op == "Mul" and rows.weights is None and rows.ones is None:
            step_input = _resolve_weights(fg, ins, rows, site)
        elif scaling is not None and op in scaling.SCALE_OPS:
            step_input = scaling.resolve_scale(fg, node, ins, rows, site, op)
        elif node.op == "SelectV2" and rows.mask is None:
            step_input = _resolve_mask(fg, ins, rows, site)
        elif node.op == "Reshape" and rows.unflattened_rows is None and not rows.regathers:
            rows.unflattened, site.regroup_ids = unflattened_ids(fg, ins)
            rows.unflattened_rows, rows.flat_from = ref, len(rows.private) + 1
            step_input = ins[0]
        else:
            raise NotASite()
        note_zero_weights(node, rows, site, weights_before, factors_before)  # multiply_no_nan's w
        if rows.unflattened_rows is not None and node.op in ("Mul", "MulNoNan", "SelectV2"):
            rows.weighted_before_reshape = True
        rows.nodes.append(node.name)
        rows.private.append(ref)
        rows.itemsizes.append(itemsize(tensor_dtype(fg, ref)))
        if op in ("Mul", "RealDiv", "Neg"):
            rows.multiplied = list(rows.private)
        ref = step_input


def _is_regather(fg: FunctionGraph, node, ins: List[Ref]) -> bool:
    """GatherV2(rows, perm, axis 0) of rows that are themselves gathered."""
    if node.op != "GatherV2" or ("batch_dims" in node.attr and node.attr["batch_dims"].i):
        return False
    axis = fg.const_value(ins[2])
    return axis is not None and int(axis) == 0 and leads_to_gather(fg, ins[0])


def _resolve_weights(fg: FunctionGraph, ins: List[Ref], rows: Rows, site: Site) -> Ref:
    """Mul(rows, w[..., None]): returns the rows side; records w."""
    problem = None
    for rows_ref, w_ref in ((ins[0], ins[1]), (ins[1], ins[0])):
        if not leads_to_gather(fg, rows_ref):
            continue
        if is_scalar(fg, w_ref, fg.shape(rows_ref).rank):
            if not is_ones(fg, w_ref):  # x * 1 changes nothing
                site.weighted = True
                rows.weights, rows.weights_scalar, rows.weights_after_mask = w_ref, True, rows.mask is None
            return rows_ref
        try:
            weights, strip_nodes, squeeze = strip_trailing_unit_axis(fg, w_ref)
        except Skip as e:
            site.weighted = True
            problem = e
            continue
        rows.nodes.extend(strip_nodes)
        if is_ones(fg, weights):  # a multiply by ones (keras-rs, ragged ones_like)
            rows.ones, rows.ones_squeeze = weights, squeeze
            return rows_ref
        site.weighted = True
        rows.weights, rows.weights_squeeze, rows.weights_after_mask = weights, squeeze, rows.mask is None
        return rows_ref
    if problem is not None:
        raise problem
    raise NotASite()


def _resolve_mask(fg: FunctionGraph, ins: List[Ref], rows: Rows, site: Site) -> Ref:
    """tf.where(mask[..., None], rows, 0) (or the mask inverted): returns the
    rows side; records the mask."""
    cond, then_ref, else_ref = ins
    if leads_to_gather(fg, then_ref):
        rows_ref, fill, keeps_true = then_ref, else_ref, True
    elif leads_to_gather(fg, else_ref):
        rows_ref, fill, keeps_true = else_ref, then_ref, False
    else:
        raise NotASite()
    site.masked = True
    fill_node = fg.producer(fill)
    max_fill = masked_max.constant_fill(fg, fill, rows_ref, rows.nodes) if site.combiner == "max" else None
    if max_fill is not None:
        rows.max_fill = max_fill
    elif fill_node is not None and fill_node.op == "ZerosLike" and fg.inputs(fill_node)[0] == rows_ref:
        rows.nodes.append(fill_node.name)  # tf.zeros_like(rows): goes with the site
    elif not _is_zero(fg, fill):  # zeros shaped like another tensor: the ids may be broadcast like them
        rows.zero_fill = zeros_like_another(fg, fill, rows_ref, rows.nodes)
    check_mask_reads_rows(fg, cond, rows_ref)
    mask, strip_nodes, rows.mask_squeeze = strip_trailing_unit_axis(fg, cond, what="mask")
    rows.mask, rows.mask_keeps_true = mask, keeps_true
    rows.nodes.extend(strip_nodes)
    return rows_ref


def fill_from_gather(site: Site, gathered: Gather, fg: FunctionGraph) -> None:
    site.params, site.params_is_resource = gathered.params, gathered.is_resource
    site.indices, site.index_dtype, site.table_dtype = (
        gathered.indices, gathered.index_dtype, gathered.dtype)
    site.table = gathered.params.node
    table_node = fg.producer(gathered.params)
    if table_node is not None and table_node.op == "ReadVariableOp":
        site.table = fg.inputs(table_node)[0].node
    site.table_shape = dims(gathered.table_shape)
    site.dtype = dtype_name(gathered.dtype)
    site.gathered_shape = dims(fg.shape(gathered.output))
    site.negative_ids_padding = site.ids_past_rows_padding = gathered.one_hot  # a one-hot lookup's zero rows
    if gathered.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(gathered.index_dtype)} is not int32/int64")


def apply_rows(fg: FunctionGraph, site: Site, rows: Rows, root: str, data: Ref) -> None:
    """Fills `site` from the resolved rows: table, ids (re-gathered as the rows
    were), per-index weights and mask (shapes checked against the ids), the
    cast, the nodes the site owns; then checks that only the site reads them."""
    gathered = rows.gather
    fill_from_gather(site, gathered, fg)
    ids_shape = fg.shape(rows.regathers[0]) if rows.regathers else gathered.ids_shape(fg)
    if rows.unflattened is not None and site.regroup_ids is not None:  # the op reads reshape(ids, regroup_ids)
        ids_shape = tensor_shape.TensorShape([None if d == -1 else d for d in site.regroup_ids])
    site.regathers = tuple(rows.regathers)
    site.gather_refs = tuple(rows.as_gathered) + (gathered.output,) + tuple(
        Ref(n, 0) for n in gathered.nodes)
    try:
        site.weights_per_flat_id = weights_per_flat_id(fg, rows, site)
        if site.weights_per_flat_id is None:
            check_weights_and_mask(fg, rows, ids_shape)
    except Skip as skip:  # per row of the flat ids: the reason says so
        raise Skip(f"{WEIGHTED_BEFORE_RESHAPE} ({skip})") if rows.weighted_before_reshape else skip from None
    if rows.weights is not None:
        site.weights, site.weights_squeeze = rows.weights, rows.weights_squeeze
        site.weights_scalar, site.weights_unit_row = rows.weights_scalar, rows.weights_unit_row
        site.weights_after_mask = rows.weights_after_mask
    if rows.mask is not None:
        site.mask, site.mask_keeps_true = rows.mask, rows.mask_keeps_true
        site.mask_squeeze, site.max_fill = rows.mask_squeeze, rows.max_fill
    if rows.ones is not None and may_broadcast_ids(per_index_shape(fg, rows.ones, rows.ones_squeeze), ids_shape):
        site.ones, site.ones_squeeze = rows.ones, rows.ones_squeeze  # the ids are broadcast like them
    site.multiplied_refs = tuple(rows.multiplied)
    site.cast_enum = rows.cast_enum if rows.cast_enum != gathered.dtype else 0
    site.internal = tuple(rows.nodes + gathered.nodes)
    site.intermediate_itemsizes = tuple(rows.itemsizes)
    check_private(fg, [data] + rows.private, set(site.internal) | {root}, site)
    if rows.zero_fill is not None and (site.shape_consumers or rows.unflattened is not None):
        raise Skip("masked rows filled with zeros shaped like another tensor, whose shape is read")
    site.zero_fill = rows.zero_fill
    if rows.unflattened is not None:
        site.gathered_shape = dims(fg.shape(rows.unflattened_rows))
        flat = set(rows.private[rows.flat_from:])
        if any(ref in flat for _, ref in site.shape_consumers):
            raise Skip("the shape of the flattened gathered rows is read")


def _not_over_features(fg: FunctionGraph, x: Ref, axes) -> None:
    """A reduction over the feature axis alone (a row norm, a LayerNorm) is no bag."""
    rank = fg.shape(x).rank
    if rank is not None and rank >= 2 and axes is not None and np.size(axes) == 1 and \
            int(np.reshape(axes, [])) % rank == rank - 1:
        raise NotASite()


def _check_bag_axis(fg: FunctionGraph, node, x: Ref, axes, site: Site) -> None:
    rank = fg.shape(x).rank
    if rank is None:
        raise Skip("rank of the gathered tensor is unknown")
    # keepdims=True: the bag, then its unit bag axis back ([..., 1, D])
    site.expand_bag_axis = "keep_dims" in node.attr and node.attr["keep_dims"].b
    if axes is not None and np.size(axes) > 1:
        _check_bag_axes(fg, [int(a) % rank for a in np.ravel(axes)], rank, site)
        return
    if axes is None or np.size(axes) != 1:
        raise Skip("reduction is not over exactly one constant axis")
    if int(np.reshape(axes, [])) % rank != rank - 2:
        raise Skip(f"reduction axis {int(np.reshape(axes, []))} is not the bag axis "
                   f"(-2) of a rank-{rank} gather")


def _check_bag_axes(fg: FunctionGraph, axes, rank: int, site: Site) -> None:
    """A reduction over the bag axis and the axes just before it ([1, 2] of [B, F, K, D]): one bag of
    the ids' last len(axes) axes, fused on the ids flattened over them (flat_bags.py)."""
    if sorted(axes) != list(range(rank - 1 - len(axes), rank - 1)):
        raise Skip(f"reduction over axes {sorted(axes)} of a rank-{rank} gather is not over exactly one constant "
                   "axis, nor over the bag axis (-2) and the axes just before it (one bag of those ids)")
    if site.expand_bag_axis:
        raise Skip("keepdims=True over several bag axes: the fused bag gets one unit axis back only")
    if any(f.squeeze or not (f.scalar or f.ref is None or same_dims(fg.shape(f.ref), fg.shape(site.indices)))
           for f in site.weight_factors) or \
            site.weights_squeeze or site.mask_squeeze or site.ones is not None or site.regroup_ids is not None or \
            site.shape_consumers or (site.weights is not None and not site.weights_scalar and
                                     not same_dims(fg.shape(site.weights), fg.shape(site.indices))):
        raise Skip(f"a reduction over axes {sorted(axes)} of rows weighted or masked by other than a tensor "
                   "shaped like the ids, or whose shape is read: not fused")
    site.flatten_bag_axes = len(axes)


def match_reduce_max(fg: FunctionGraph, node, site: Site, scaling=None) -> Site:
    """reduce_max over the bag axis of gathered rows: combiner 'max'."""
    site.combiner = "max"
    site.empty_axis_max = True
    _bag_of_rows(fg, node, site, scaling)
    check_max_site(site, dense=True)
    return site


def _bag_of_rows(fg: FunctionGraph, node, site: Site, scaling=None) -> Ref:
    """Fills `site` from the rows a bag-axis reduction `node` reads; returns them."""
    x, axes, untransposed = reduced_rows(fg, node, leads_to_gather)  # transpose(rows): x the rows
    _not_over_features(fg, x, axes)
    transposed = None if untransposed is None else untransposed.transposed
    rows = resolve_rows(fg, x if untransposed is None else untransposed.walk_from, site, scaling=scaling,
                        transposed=transposed)
    if rows.regathers:
        raise Skip("the gathered rows are re-gathered before a dense reduction")
    if untransposed is not None and untransposed.multiply is not None:
        weigh_after_transpose(fg, rows, untransposed.multiply, site, adds_unit_axis)
    apply_rows(fg, site, rows, node.name, fg.inputs(node)[0])
    if transposed is not None:  # the Transpose (and casts of its output) are the site's, read by it only
        check_transposed_shape_unread(site, rows.private[:rows.private.index(transposed) + 1])
    if rows.factors:
        scaling.check_factors(fg, site, rows.factors, bag_ids_shape(fg, site, rows))
        site.weight_factors = tuple(rows.factors)
    _check_bag_axis(fg, node, x, axes, site)
    return x


def bag_ids_shape(fg: FunctionGraph, site: Site, rows: Rows):
    """The shape of the ids the op reads: reshape(ids, T) for rows regrouped by a reshape to T + [D], whose
    multipliers are of that shape (one of the ids as fed scales the rows before the reshape)."""
    if rows.unflattened is not None and site.regroup_ids is not None:
        return tensor_shape.TensorShape([None if d == -1 else d for d in site.regroup_ids])
    return rows.gather.ids_shape(fg)


def check_max_site(site: Site, dense: bool = False) -> None:
    """A max bag the op's 'max' combiner computes: unweighted, unmasked (or, in a `dense` bag, masked with a
    constant fill: masked_max.py)."""
    if site.weights is not None or site.weight_factors:
        raise Skip("max of weighted rows: the op's max combiner takes no weights")
    masked_max.check_masked_max(site, dense)
    if site.mask is not None and site.max_fill is None:
        raise Skip("max of masked rows: tf.where puts 0 rows in the max, the op's "
                   "padding would leave them out")


def match_reduce(fg: FunctionGraph, node, site: Site, scaling=None) -> Site:
    """Sum/Mean over the bag axis of (cast, weighted, masked) gathered rows; with `scaling` (the scales
    module), rows scaled by several factors too."""
    site.combiner = "sum" if node.op == "Sum" else "mean"
    x = _bag_of_rows(fg, node, site, scaling)
    if node.op == "Mean" and (site.weights is not None or site.mask is not None or site.weight_factors or
                              site.ids_past_rows_padding):  # a one-hot lookup's zero rows count in the mean
        # mean over K of w*x is the sum with weights w / K: fused as the sum,
        # then divided by K exactly as Mean does. K is read off the ids at run
        # time: a server feeds bags of any length to a signature that declares
        # one (TF Serving does not check the declared shape), and Mean divides
        # by the length it gets. `divisor` only reports the declared K.
        bag = fg.shape(x).as_list()[-1 - site.flatten_bag_axes:-1]
        site.combiner, site.divide_by_bag = "sum", True
        site.divisor = None if None in bag else int(np.prod(bag))
    return site


