"""Sparse sites: tf.nn.embedding_lookup_sparse and safe_embedding_lookup_sparse.

  unweighted  Unique -> gather(table, unique.y) -> SparseSegmentSum/Mean/SqrtN(.., unique.idx, seg)
              or, on a Tensor table, SparseSegmentSum/Mean/SqrtN(table, ids, seg)
  weighted    gather [-> re-gather by unique.idx] -> Mul by reshaped weights -> SegmentSum
              [-> DivNoNan by SegmentSum(w) (mean) or Sqrt(SegmentSum(w^2)) (sqrtn)]
  safe_       the above on SparseFillEmptyRows outputs, then Select(empty rows, 0, result)
  max         gather [-> re-gather by unique.idx] -> SegmentMax(rows, seg) (combiner 'max')

All become PkmRaggedEmbeddingBag. A safe_ site with default_id=None is fused
from the pruned ids *before* SparseFillEmptyRows (the op gives empty bags
zeros, which is what the Select writes), so SparseFillEmptyRows and the
Select leave the graph: that is what makes the site convertible to TFLite.
"""
from __future__ import annotations

from typing import List

import numpy as np

from pkm_serve.export.dense import Gather, apply_rows, check_max_site, fill_from_gather, resolve_gather, resolve_rows, \
    strip_trailing_unit_axis
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import (INDEX_DTYPES, TABLE_DTYPES, NotASite, Site, Skip, check_private,
                                    dtype_name, itemsize, tensor_dtype, through_identity)
from pkm_serve.export.unrecognised import clips_rows

SPARSE_SEGMENT_COMBINERS = {
    "SparseSegmentSum": "sum", "SparseSegmentMean": "mean", "SparseSegmentSqrtN": "sqrtn",
    # tf.sparse.segment_sum/mean/sqrt_n(.., num_segments=n): n bags, the last ones empty
    "SparseSegmentSumWithNumSegments": "sum", "SparseSegmentMeanWithNumSegments": "mean",
    "SparseSegmentSqrtNWithNumSegments": "sqrtn"}
DIVISION_OPS = ("DivNoNan", "RealDiv", "Div")
# tf.math.segment_sum/mean/max of gathered rows, as written by hand (not embedding_lookup_sparse)
SEGMENT_PATTERN = "segment-reduce"


def _resolve_sparse_rows(fg: FunctionGraph, ref: Ref):
    """Rows `table[ids]` as built by embedding_lookup_sparse: either a direct
    gather, or gather(table, unique.y) re-gathered by unique.idx. Over a list of
    shards the unique rows are stitched (DynamicStitch), no gather: the re-gather
    is then the gather, of the stitched rows as the table, on unique.idx (as the
    unweighted lookup's SparseSegment* on them is fused, _segment_of_table).
    Returns (gather, ids, nodes, private refs)."""
    nodes: List[str] = []
    ref = through_identity(fg, ref, nodes)
    node = fg.producer(ref)
    if node is not None and node.op == "GatherV2":
        ins = fg.inputs(node)
        axis = fg.const_value(ins[2])
        unique = fg.producer(ins[1])
        if unique is not None and unique.op == "Unique" and ins[1].index == 1 and \
                axis is not None and int(axis) == 0:
            try:
                inner = resolve_gather(fg, ins[0])
            except NotASite:
                inner = None
            if inner is not None and inner.indices == Ref(unique.name, 0):
                private = [ref, inner.output] + [Ref(n, 0) for n in nodes + inner.nodes]
                return inner, fg.inputs(unique)[0], nodes + [node.name] + inner.nodes, \
                    private
    gathered = resolve_gather(fg, ref)
    private = [gathered.output] + [Ref(n, 0) for n in nodes + gathered.nodes[:-1]]
    return gathered, gathered.indices, nodes + gathered.nodes, private


def match_sparse_segment(fg: FunctionGraph, node, site: Site) -> Site:
    data, seg_indices, segment_ids = fg.inputs(node)[:3]
    if node.op.endswith("WithNumSegments"):
        site.num_segments = fg.inputs(node)[3]
    nodes: List[str] = []
    data = through_identity(fg, data, nodes)
    site.combiner = SPARSE_SEGMENT_COMBINERS[node.op]
    try:
        gathered = resolve_gather(fg, data)
    except NotASite:
        reason = steps_before_segment(fg, data)
        if reason is not None:
            raise Skip(reason) from None
        return _segment_of_table(fg, node, site, data, seg_indices, segment_ids)
    fill_from_gather(site, gathered, fg)
    unique = fg.producer(seg_indices)
    if unique is None or unique.op != "Unique" or seg_indices.index != 1 or \
            gathered.indices != Ref(unique.name, 0):
        raise Skip("sparse segment indices are not the unique-inverse of the "
                   "gathered ids")
    site.indices = fg.inputs(unique)[0]
    site.index_dtype = unique.attr["T"].type
    if site.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(site.index_dtype)} is not int32/int64")
    site.segment_ids = segment_ids
    site.internal = tuple(nodes + gathered.nodes)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),)
    private = [gathered.output, data] + [Ref(n, 0) for n in nodes + gathered.nodes]
    check_private(fg, private, set(site.internal) | {node.name})
    return extend_to_safe(fg, site)


def _segment_of_table(fg: FunctionGraph, node, site: Site, table: Ref, ids: Ref, segment_ids: Ref) -> Site:
    """SparseSegment<combiner>(table, ids, seg) on a [N, D] table tensor itself
    (embedding_lookup_sparse's path for a Tensor table, no gather op): bag
    seg[i] holds row ids[i], the ragged bag of (ids, seg)."""
    shape, dtype = fg.shape(table), tensor_dtype(fg, table)
    if shape.rank != 2 or dtype not in TABLE_DTYPES or fg.shape(ids).rank != 1:
        raise NotASite()
    fill_from_gather(site, Gather(table, table, False, ids, [], shape, dtype, tensor_dtype(fg, ids)), fg)
    site.gathered_shape = None
    site.segment_ids = segment_ids
    site.intermediate_itemsizes = (0,)  # the composite builds no [ids, D] rows either
    return extend_to_safe(fg, site)


def steps_before_segment(fg: FunctionGraph, data: Ref, what: str = "sparse segment reduction", depth: int = 4):
    """Why rows reaching a segment reduction (`what`) were not taken, if they
    are gathered table rows a few steps up (None if they are not). A Select
    (tf.where) is followed through its two branches, not its condition."""
    frontier = [(data, [])]
    for _ in range(depth):
        next_frontier = []
        for ref, path in frontier:
            node = fg.producer(ref)
            if node is None:
                continue
            if clips_rows(fg, node):
                return ("each gathered row is clipped to max_norm (embedding_lookup_sparse "
                        "max_norm=, i.e. clip_by_norm) before the reduction: PkmEmbeddingBag "
                        "has no row-norm clip, so the site stays composite")
            if node.op in ("ResourceGather", "GatherV2"):
                return _steps_reason(path, what)
            ins = fg.inputs(node)
            follow = ins[1:3] if node.op in ("Select", "SelectV2") else ins[:1]
            next_frontier += [(r, path + [node.op]) for r in follow]
        frontier = next_frontier
    return None


def _steps_reason(path: List[str], what: str) -> str:
    steps = " -> ".join(reversed(path)) or "a gather that is not a row gather"
    if any(op in ("Select", "SelectV2") for op in path):
        return (f"{steps}: the gathered rows are masked (tf.where) before the {what}; a masked row "
                "still counts in a segment_mean's bag size and as a 0 in a segment_max, and masked "
                "rows are not fused in any segment reduction, so the site stays composite")
    if path == ["Mul"] and what in ("segment_mean", "segment_max"):
        return (f"the gathered rows are multiplied (per-id weights) before the {what}: the fused op's "
                "weighted combiners are a weighted sum and a mean divided by the weights' sum "
                f"(embedding_lookup_sparse), not a {what} of weighted rows, so the site stays composite")
    return (f"{steps} between the gather and the {what}: only the ids' unique-inverse and per-id "
            "weights are fused")


def _match_segment_sum(fg: FunctionGraph, node, site: Site, extra: List[str]):
    """Weighted embedding_lookup_sparse: SegmentSum(Mul(rows, reshape(w)), seg).
    Returns (site, the reshaped weights)."""
    mul_ref, segment_ids = fg.inputs(node)
    mul = fg.producer(mul_ref)
    if mul is None or mul.op != "Mul":
        raise NotASite()
    a, b = fg.inputs(mul)
    for rows_ref, w_ref in ((a, b), (b, a)):
        try:
            gathered, ids, rows_nodes, private = _resolve_sparse_rows(fg, rows_ref)
            break
        except NotASite:
            continue
    else:
        raise NotASite()
    site.weighted = True
    fill_from_gather(site, gathered, fg)
    site.indices = ids
    site.index_dtype = _ids_dtype(fg, ids, gathered)
    weights, strip_nodes, squeeze = strip_trailing_unit_axis(fg, w_ref)
    if fg.shape(weights).rank != 1 + squeeze:
        raise Skip("sparse weights are not one per id")
    site.weights, site.segment_ids = weights, segment_ids
    site.weights_squeeze = squeeze
    internal = rows_nodes + [mul.name, node.name] + strip_nodes + extra
    site.internal = tuple(n for n in internal if n != site.root)
    # gathered rows, re-gathered rows (when unique), weighted product
    copies = 2 + (len([n for n in rows_nodes if fg.nodes[n].op == "GatherV2"]) > 1)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),) * copies
    private = private + [mul_ref, rows_ref]
    check_private(fg, private, set(internal) | {site.root})
    if site.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(site.index_dtype)} is not int32/int64")
    return site, w_ref


def match_segment_sum(fg: FunctionGraph, node, site: Site) -> Site:
    producer = fg.producer(fg.inputs(node)[0])
    if producer is not None and producer.op == "SelectV2":
        site.combiner, site.pattern = "sum", SEGMENT_PATTERN
        return _segment_sum_of_masked_rows(fg, node, site)
    if producer is None or producer.op != "Mul":  # tf.math.segment_sum(gather(table, ids), segment_ids)
        site.combiner = "sum"
        site.pattern = SEGMENT_PATTERN
        return _segment_of_rows(fg, node, site, "segment_sum")
    site = _match_segment_sum(fg, node, site, [])[0]
    return extend_to_safe(fg, site)


def _segment_sum_of_masked_rows(fg: FunctionGraph, node, site: Site) -> Site:
    """segment_sum(tf.where(mask[:, None], gather(table, ids), 0), seg): a masked
    row adds 0, so the bag is that of where(mask, ids, -1) (padding; a bag all
    masked is 0, as the composite's). Only the mask between gather and sum."""
    data, segment_ids = fg.inputs(node)
    reason = steps_before_segment(fg, data, "segment_sum")
    try:
        rows = resolve_rows(fg, data, site)
    except NotASite:
        rows = None
    if rows is None or rows.mask is None or rows.weights is not None or rows.ones is not None or \
            rows.cast_enum or rows.regathers or rows.unflattened is not None or \
            fg.shape(rows.gather.indices).rank != 1:
        if reason is None:
            raise NotASite()
        raise Skip(reason)
    apply_rows(fg, site, rows, node.name, data)
    site.segment_ids = segment_ids
    site.internal = tuple(n for n in site.internal if n != site.root)
    return site


def _segment_of_rows(fg: FunctionGraph, node, site: Site, what: str) -> Site:
    """Segment<what>(gather(table, ids), segment_ids) of the rows as gathered (no
    multiplier): the bags of the sorted segment ids."""
    data, segment_ids = fg.inputs(node)
    try:
        gathered, ids, rows_nodes, private = _resolve_sparse_rows(fg, data)
    except NotASite:
        reason = steps_before_segment(fg, data, what)
        if reason is None:
            raise
        raise Skip(reason) from None
    fill_from_gather(site, gathered, fg)
    if fg.shape(gathered.output).rank != 2:
        raise Skip(f"{what} of gathered rows that are not [ids, D]")
    site.indices, site.segment_ids = ids, segment_ids
    site.index_dtype = _ids_dtype(fg, ids, gathered)
    site.internal = tuple(n for n in rows_nodes if n != site.root)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),)
    check_private(fg, private + [data], set(site.internal) | {site.root})
    if site.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(site.index_dtype)} is not int32/int64")
    return site


def match_segment_mean(fg: FunctionGraph, node, site: Site) -> Site:
    """tf.math.segment_mean(gather(table, values), segment_ids): combiner 'mean'
    on the sorted bag ids (an empty bag in between is 0, as the op gives)."""
    site.combiner = "mean"
    return _segment_of_rows(fg, node, site, "segment_mean")


def match_segment_max(fg: FunctionGraph, node, site: Site) -> Site:
    """tf.math.segment_max(gather(table, sp.values), sp.indices[:, 0]): combiner
    'max' on the sorted bag ids (an empty bag in between is 0, as the op gives;
    bags after the last id are not written, as the ragged rows derived from
    the last id + 1)."""
    site.combiner = "max"
    _segment_of_rows(fg, node, site, "segment_max")
    check_max_site(site)
    return site


def _ids_dtype(fg: FunctionGraph, ids: Ref, gathered: Gather) -> int:
    producer = fg.producer(ids)
    if producer is not None and producer.op == "Unique":
        return tensor_dtype(fg, ids)  # y is T, idx out_idx (int32 unless set)
    if ids == gathered.indices:
        return gathered.index_dtype
    unique_input_of = [n for n in fg.nodes.values()
                       if n.op == "Unique" and fg.inputs(n)[0] == ids]
    if unique_input_of:
        return unique_input_of[0].attr["T"].type
    return gathered.index_dtype


def match_division(fg: FunctionGraph, node, site: Site) -> Site:
    """mean: DivNoNan(SegmentSum(w*rows), SegmentSum(w)); sqrtn: the divisor is
    Sqrt(SegmentSum(Pow(w, 2)))."""
    num_ref, den_ref = fg.inputs(node)
    num = fg.producer(num_ref)
    den = fg.producer(den_ref)
    if num is None or num.op != "SegmentSum" or den is None:
        raise NotASite()
    extra = [num.name]
    combiner = "mean"
    if den.op == "Sqrt":
        combiner = "sqrtn"
        extra.append(den.name)
        den = fg.producer(fg.inputs(den)[0])
        if den is None:
            raise NotASite()
    if den.op != "SegmentSum":
        raise NotASite()
    extra.append(den.name)
    site.combiner = combiner
    site, w_reshaped = _match_segment_sum(fg, num, site, extra)
    den_data, den_seg = fg.inputs(den)
    if combiner == "sqrtn":
        power = fg.producer(den_data)
        if power is None or power.op != "Pow" or fg.inputs(power)[0] != w_reshaped:
            raise Skip("sqrtn divisor is not sqrt(segment_sum(w^2))")
        exponent = fg.const_value(fg.inputs(power)[1])
        if exponent is None or float(exponent) != 2.0:
            raise Skip("sqrtn divisor is not sqrt(segment_sum(w^2))")
        site.internal += (power.name,)
    elif den_data != w_reshaped:
        raise Skip("mean divisor is not segment_sum(w)")
    if den_seg != site.segment_ids:
        raise Skip("numerator and divisor use different segment ids")
    intermediates = [num_ref, den_ref] + [Ref(n, 0) for n in site.internal]
    check_private(fg, [r for r in intermediates if r.node in fg.nodes and
                       fg.nodes[r.node].op not in ("Reshape",)],
                  set(site.internal) | {node.name})
    return extend_to_safe(fg, site)


def extend_to_safe(fg: FunctionGraph, site: Site) -> Site:
    """A lookup on SparseFillEmptyRows outputs is safe_embedding_lookup_sparse:
    the site reads the ids (and weights) from before the fill. With
    default_id=None the empty rows are then zeroed by a Select, which the site
    grows to (the op gives empty bags zeros itself); with a default_id the
    fused op's empty bags get that table row instead (fuse.py)."""
    fill = fg.producer(site.indices)
    if fill is None or fill.op != "SparseFillEmptyRows" or site.indices.index != 1:
        return site
    inner = site.root
    fill_in = fg.inputs(fill)  # indices, values, dense_shape, default_value
    if fg.shape(fill_in[0]).rank != 2 or fg.shape(fill_in[0])[1] != 2:
        return site  # SparseFillEmptyRows always sees the ids reshaped to 2-D
    selects = [c for c, pos in fg.consumers(Ref(inner, 0))
               if fg.nodes[c].op in ("Select", "SelectV2") and pos == 2]
    zeroing = _zeroing_select(fg, selects, inner, fill) if len(selects) == 1 else None
    default_id = None
    if zeroing is None:
        # default_id given: empty rows hold one id, default_id, with weight 1.
        value = fg.const_value(fill_in[3])
        if value is None or value.size != 1 or fg.consumers(Ref(fill.name, 2)):
            return site
        default_id = int(np.reshape(value, []))
    dead = [fill.name]
    weights = site.weights
    if weights is not None:
        weights_fill = fg.producer(weights)
        if weights_fill is None or weights_fill.op != "SparseFillEmptyRows" or \
                weights.index != 1:
            return site
        weights = fg.inputs(weights_fill)[1]
        dead.append(weights_fill.name)
    seg = fg.producer(site.segment_ids)
    while seg is not None and seg.op in ("Cast", "StridedSlice", "Identity"):
        dead.append(seg.name)
        seg = fg.producer(fg.inputs(seg)[0])
    site.pattern = "safe_embedding_lookup_sparse"
    site.indices, site.weights = fill_in[1], weights
    site.sparse_indices, site.dense_shape = fill_in[0], fill_in[2]
    site.default_id = default_id
    if zeroing is not None:
        select, zeros_like, tile, reshape = zeroing
        site.root = select.name
        site.internal += (inner, zeros_like.name, tile.name)
        dead.append(reshape.name)
    site.dead_after += tuple(dead)
    return site


def _zeroing_select(fg: FunctionGraph, selects: List[str], inner: str, fill):
    """Select(Tile(Reshape(fill.empty_row_indicator)), ZerosLike(inner), inner):
    how safe_ with default_id=None zeroes the filled rows. Returns its nodes."""
    select = fg.nodes[selects[0]]
    cond, zeros, _ = fg.inputs(select)
    zeros_like = fg.producer(zeros)
    tile = fg.producer(cond)
    reshape = fg.producer(fg.inputs(tile)[0]) if tile is not None and tile.op == "Tile" \
        else None
    if zeros_like is None or zeros_like.op != "ZerosLike" or \
            fg.inputs(zeros_like)[0] != Ref(inner, 0) or reshape is None or \
            reshape.op != "Reshape" or fg.inputs(reshape)[0] != Ref(fill.name, 2):
        return None
    return select, zeros_like, tile, reshape


def bypass_identity_sparse_reshapes(fg: FunctionGraph) -> List[str]:
    """safe_embedding_lookup_sparse first reshapes the ids to 2-D with
    SparseReshape(ids, shape, [prod(shape[:-1]), shape[-1]]), which TFLite has
    no builtin for. For ids that are already 2-D that reshape is the identity:
    its consumers read the input indices and the new shape instead. Returns
    the bypassed nodes (left for remove_dead)."""
    bypassed = []
    for node in list(fg.nodes.values()):
        if node.op != "SparseReshape":
            continue
        indices, shape, new_shape = fg.inputs(node)
        if fg.shape(indices).rank != 2 or fg.shape(indices)[1] != 2 or \
                not _is_flattened_shape(fg, new_shape, shape):
            continue
        fg.redirect(Ref(node.name, 0), indices)
        fg.redirect(Ref(node.name, 1), new_shape)
        bypassed.append(node.name)
    return bypassed


def _is_flattened_shape(fg: FunctionGraph, new_shape: Ref, shape: Ref) -> bool:
    """new_shape == stack([reduce_prod(shape[:1]), shape[1]]) of a [2] shape."""
    if fg.shape(shape).rank != 1 or fg.shape(shape).as_list() != [2]:
        return False
    pack = fg.producer(new_shape)
    if pack is None or pack.op != "Pack" or len(fg.inputs(pack)) != 2:
        return False
    prod, last = (fg.producer(r) for r in fg.inputs(pack))
    if prod is None or prod.op != "Prod" or last is None or last.op != "GatherV2":
        return False
    head = fg.producer(fg.inputs(prod)[0])
    if head is None or head.op != "Slice" or fg.inputs(head)[0] != shape or \
            fg.inputs(last)[0] != shape:
        return False
    begin, size = (fg.const_value(r) for r in fg.inputs(head)[1:])
    index = fg.const_value(fg.inputs(last)[1])
    return begin is not None and size is not None and index is not None and \
        list(np.ravel(begin)) == [0] and list(np.ravel(size)) == [1] and int(index) == 1
