"""tf.math.unsorted_segment_sum(rows [* w], segment_ids, num_segments) (or unsorted_segment_max(rows, ...)) of
gathered rows whose segment ids are not a row partition's (tf.repeat(tf.range(B), K) of flattened [B, K] ids,
ids grouped by a key, in any order): bag s is the sum (max) over the entries whose segment id is s, in
num_segments bags. A max bag with no entry kept is the dtype's lowest value, as unsorted_segment_max gives it
(counted from the kept entries: a negative segment id's entry is sorted into bag 0 as padding).

Fused as PkmRaggedEmbeddingBag after a stable sort of the entries by segment id (a TopK of the negated ids:
TOPK_V2 in a .tflite), with row_splits counted from the sorted ids and num_segments (fuse.row_splits). An
entry of a negative segment id, which unsorted_segment_sum drops, is masked (its id becomes padding, and its
id is still range-checked, as the composite's gather checks it); a segment id >= num_segments is refused by
the counting UnsortedSegmentSum as by the composite's."""
from __future__ import annotations

import dataclasses

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export import dense, scales, sparse
from pkm_serve.export.flat_bags import after
from pkm_serve.export.fuse import _regrouped_ids, _segment_count, _squeeze_last
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import _assert
from pkm_serve.export.segment_ids import int32_segment_ids
from pkm_serve.export.sites import NotASite, Site, Skip, tensor_dtype

I32 = DType(types_pb2.DT_INT32)
SEGMENT_PATTERN = "segment-reduce"


def match_any_segment_ids(fg: FunctionGraph, site: Site, rows, seg: Ref, num_segments: Ref) -> Site:
    """Fills `site` for an UnsortedSegmentSum whose segment ids are no row partition's; Skip where the entries
    are not one gathered row each ([nnz] ids, [nnz] segment ids) or the rows are masked per feature."""
    ids_rank = len(site.regroup_ids) if site.regroup_ids is not None else fg.shape(site.indices).rank
    seg_shape = fg.shape(seg)
    if rows.regathers or ids_rank != 1 or seg_shape.rank != 1 or fg.shape(num_segments).rank != 0:
        raise Skip("segment ids are neither a ragged row partition's nor one per gathered row of flat ids")
    site.pattern = SEGMENT_PATTERN
    site.segment_ids, site.num_segments, site.segments_unsorted = seg, num_segments, True
    return site


_SORTED_SEGMENT_COMBINERS = {"SegmentSum": "sum", "SegmentMean": "mean", "SegmentMax": "max"}


def match_segment_reduce(fg: FunctionGraph, node, site: Site) -> Site:
    """tf.math.segment_sum/mean/max (keras.ops.segment_sum/max(sorted=True)) of rows regrouped to [B * K, D]
    (rows of [B, K] ids flattened by a reshape, cast or not; weighted, masked or scaled for a sum), or of flat ids
    scaled by several factors (which the sparse matchers do not take): the bags of
    the flattened ids by the sorted segment ids (their order asserted, as for every segment reduction fused).
    Any other: sparse.match_segment_sum/mean/max."""
    data, seg = fg.inputs(node)
    site.combiner = _SORTED_SEGMENT_COMBINERS[node.op]  # the report's, where `scratch` is skipped
    scratch = dataclasses.replace(site)
    try:
        rows = dense.resolve_rows(fg, data, scratch, scaling=scales)  # rows * w * mask: one weight (scales.py)
    except (NotASite, Skip):
        rows = None
    scaled_flat_ids = rows is not None and bool(rows.factors) and fg.shape(rows.gather.indices).rank == 1
    if rows is None or rows.regathers or (rows.unflattened_rows is None and not scaled_flat_ids):
        fallback = {"SegmentSum": sparse.match_segment_sum, "SegmentMean": sparse.match_segment_mean}
        return fallback.get(node.op, sparse.match_segment_max)(fg, node, site)
    scratch.pattern, scratch.combiner = SEGMENT_PATTERN, _SORTED_SEGMENT_COMBINERS[node.op]
    dense.apply_rows(fg, scratch, rows, node.name, data)
    if node.op != "SegmentSum" and (scratch.weights is not None or scratch.mask is not None or rows.factors or
                                    scratch.ones is not None):
        raise Skip(f"a {scratch.combiner} by segment of weighted or masked flattened rows: a masked row counts in "
                   "the composite's mean and as a 0 in its max, and the op's weighted mean divides by the weights' "
                   "sum: not fused")
    if rows.factors:
        scales.check_factors(fg, scratch, rows.factors, dense.bag_ids_shape(fg, scratch, rows))
        scratch.weight_factors = tuple(rows.factors)
    ids_rank = fg.shape(scratch.indices).rank if scratch.regroup_ids is None else len(scratch.regroup_ids)
    if fg.shape(data).rank != 2 or ids_rank != 1:
        raise Skip(f"segment_{scratch.combiner} of gathered rows reshaped to other than [ids, D]")
    scratch.segment_ids, scratch.segments_counted = seg, True
    return scratch


def sort_by_segment(fg: FunctionGraph, site: Site) -> None:
    """Before fusing: the ids flattened as the rows were and checked to be one per segment id; unsorted
    segment ids: the entries (ids, weights, mask) in segment-id order, negative segment ids masked."""
    if not (site.segments_unsorted or site.segments_counted):
        return
    prefix = site.root + "/pkm_segment_order"
    if site.regroup_ids is not None:  # rows of [B, K] ids reshaped to [B * K, D]: the ids flattened first
        site.indices, site.regroup_ids = _regrouped_ids(fg, site), None
    _broadcast_entries(fg, site, prefix)
    site.indices = _check_one_segment_id_per_id(fg, site, prefix)
    site.segments_counted = False
    if not site.segments_unsorted:
        return
    seg = int32_segment_ids(fg, site.segment_ids, prefix)
    zero = fg.add_const(prefix + "/zero", np.array(0, np.int32))
    kept = fg.add_op(prefix + "/kept", "GreaterEqual", [seg, zero], {"T": I32}, shapes=[[None]])
    if site.mask is not None:
        mask = site.mask if site.mask_keeps_true else fg.add_op(
            prefix + "/mask_kept", "LogicalNot", [site.mask], {}, shapes=[[None]])
        kept = fg.add_op(prefix + "/kept_and_masked", "LogicalAnd", [kept, mask], {}, shapes=[[None]])
    seg = fg.add_op(prefix + "/seg_from_zero", "Maximum", [seg, zero], {"T": I32}, shapes=[[None]])
    if site.combiner == "max":
        site.empty_bags = _bags_without_entries(fg, site, prefix, seg, kept)
    negated = fg.add_op(prefix + "/negated", "Neg", [seg], {"T": I32}, shapes=[[None]])
    count = fg.add_op(prefix + "/count", "Size", [seg], {"T": I32, "out_type": I32}, shapes=[[]])
    order = Ref(fg.add_op(prefix + "/top", "TopKV2", [negated, count], {"T": I32, "sorted": True, "Tk": I32},
                          shapes=[[None], [None]]).node, 1)
    axis0 = fg.add_const(prefix + "/axis0", np.array(0, np.int32))

    def in_order(name: str, ref: Ref, dtype: int) -> Ref:
        shape = fg.shape(ref)
        return fg.add_op(f"{prefix}/{name}", "GatherV2", [ref, order, axis0],
                         {"Tparams": DType(dtype), "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                         shapes=[None if shape.rank is None else [None] + shape.as_list()[1:]])
    site.segment_ids = in_order("seg", seg, types_pb2.DT_INT32)
    site.indices = in_order("ids", site.indices, site.index_dtype)
    site.mask, site.mask_keeps_true, site.mask_squeeze = in_order("kept", kept, types_pb2.DT_BOOL), True, False
    if site.weights is not None and not site.weights_scalar:
        site.weights = in_order("weights", site.weights, tensor_dtype(fg, site.weights))
    site.segments_unsorted = False


def _bags_without_entries(fg: FunctionGraph, site: Site, prefix: str, seg: Ref, kept: Ref) -> Ref:
    """[num_segments, 1] bool: no kept entry has that segment id (`seg` >= 0)."""
    kept_count = fg.add_op(prefix + "/kept_each", "Cast", [kept], {"SrcT": DType(types_pb2.DT_BOOL), "DstT": I32,
                                                                   "Truncate": False}, shapes=[[None]])
    counts = fg.add_op(prefix + "/kept_counts", "UnsortedSegmentSum", [kept_count, seg, _segment_count(
        fg, site, prefix + "/kept_counts", seg)], {"T": I32, "Tindices": I32, "Tnumsegments": I32}, shapes=[[None]])
    zero = fg.add_const(prefix + "/no_entries/zero", np.array(0, np.int32))
    none_kept = fg.add_op(prefix + "/no_entries", "Equal", [counts, zero], {"T": I32, "incompatible_shape_error": True},
                          shapes=[[None]])
    last_axis = fg.add_const(prefix + "/no_entries/last_axis", np.array(-1, np.int32))
    return fg.add_op(prefix + "/bags_without_entries", "ExpandDims", [none_kept, last_axis],
                     {"T": DType(types_pb2.DT_BOOL), "Tdim": I32}, shapes=[[None, 1]])


def _broadcast_entries(fg: FunctionGraph, site: Site, prefix: str) -> None:
    """The ids, weights and mask broadcast against each other: the composite's rows * w and where(mask, rows, 0)
    broadcast them, so its segment sum takes one segment id per entry of that broadcast (one id fed against
    K weights is K entries), not one per id."""
    if site.weights is not None and not site.weights_scalar and site.weights_squeeze:
        site.weights, site.weights_squeeze = _squeeze_last(
            fg, prefix + "/weights_squeezed", site.weights, tensor_dtype(fg, site.weights)), False
    if site.mask is not None and site.mask_squeeze:  # where(mask [nnz, 1], rows, 0): one entry each
        site.mask, site.mask_squeeze = _squeeze_last(fg, prefix + "/mask_squeezed", site.mask,
                                                     types_pb2.DT_BOOL), False
    others = [ref for ref in (None if site.weights_scalar else site.weights, site.mask) if ref is not None]
    if not others:
        return

    def shape_of(name: str, ref: Ref) -> Ref:
        return fg.add_op(f"{prefix}/{name}_shape", "Shape", [ref], {"T": DType(tensor_dtype(fg, ref)),
                                                                    "out_type": I32}, shapes=[[1]])
    shape = shape_of("ids", site.indices)
    for i, ref in enumerate(others):
        shape = fg.add_op(f"{prefix}/entries_shape{i}", "BroadcastArgs", [shape, shape_of(f"other{i}", ref)],
                          {"T": I32}, shapes=[[1]])

    def broadcast(name: str, ref: Ref) -> Ref:
        return fg.add_op(f"{prefix}/{name}_broadcast", "BroadcastTo", [ref, shape],
                         {"T": DType(tensor_dtype(fg, ref)), "Tidx": I32}, shapes=[[None]])
    site.indices = broadcast("ids", site.indices)
    if site.weights is not None and not site.weights_scalar:
        site.weights = broadcast("weights", site.weights)
    if site.mask is not None:
        site.mask = broadcast("mask", site.mask)


def _check_one_segment_id_per_id(fg: FunctionGraph, site: Site, prefix: str) -> Ref:
    """The ids once an Assert that there are as many as segment ids: unsorted_segment_sum refuses segment ids
    that are not the rows' leading shape (ids fed wider than the K a tf.repeat of the segment ids assumes),
    where the sort would take as many ids as there are segment ids and drop the rest."""
    def size(name: str, ref: Ref) -> Ref:
        return fg.add_op(f"{prefix}/{name}_count", "Size", [ref], {"T": DType(tensor_dtype(fg, ref)), "out_type": I32},
                         shapes=[[]])
    ids_count, seg_count = size("ids", site.indices), size("seg", site.segment_ids)
    same = fg.add_op(prefix + "/same_count", "Equal", [ids_count, seg_count],
                     {"T": I32, "incompatible_shape_error": True}, shapes=[[]])
    counts = fg.add_op(prefix + "/counts", "Pack", [ids_count, seg_count], {"T": I32, "N": 2, "axis": 0},
                       shapes=[[2]])
    check = _assert(fg, prefix + "/count_check", same, f"segment {site.combiner} fused in {site.root}: the ids and "
                    "the segment ids have", (counts, types_pb2.DT_INT32), f"entries, but the original's segment "
                    f"{site.combiner} takes one segment id per gathered row", "/message_counts")
    return after(fg, prefix + "/ids_counted", site.indices, check)
