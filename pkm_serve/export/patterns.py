"""Finds composite gather-sum sites in a FunctionDef and fuses them.

A site is a reduction over the bag axis whose input is (weighted, masked,
cast) rows gathered from a 2-D table: dense forms in `dense`, the
embedding_lookup_sparse family in `sparse`, the rewrite in `fuse`. Dense
sites become `PkmEmbeddingBag`, sparse ones `PkmRaggedEmbeddingBag`.
A reduction of gathered rows that is not fused is reported with its reason.
"""
from __future__ import annotations

from typing import List

from pkm_serve.export import (counts, dense, dropped_nan, einsum, flat_bags, fuse, half_division, labels, matmul_width,
                              padded_ragged, pooled, positions, ragged, ragged_range, running_sum, scales, sparse,
                              tensordot, unflatten, unrecognised, unsorted_segments,
                              whole_bag_pool, zero_fill)
from pkm_serve.export.graph import FunctionGraph
from pkm_serve.export.no_nan_multiply import check_no_nan_site
from pkm_serve.export.no_nan_padding import zero_weights_as_padding
from pkm_serve.export.one_hot_lookup import check_one_hot_combiner
from pkm_serve.export.sites import NotASite, Site, Skip, check_shared_weights_fixed
from pkm_serve.export.sparse import SEGMENT_PATTERN

# Kept for callers of the old single module.
DENSE_OP, RAGGED_OP = fuse.DENSE_OP, fuse.RAGGED_OP


def _pattern_of(node) -> str:
    if node.op == "Einsum":
        return "einsum"
    if node.op in einsum.MATMUL_OPS:
        return "matmul"
    if node.op in unrecognised.REDUCE_OPS + unrecognised.POOLING_OPS:
        return "gather-reduce"
    if node.op in ("UnsortedSegmentSum", "UnsortedSegmentMax"):
        return "ragged-reduce"
    if node.op in ("SegmentMax", "SegmentMean"):
        return SEGMENT_PATTERN  # embedding_lookup_sparse has no max and no unweighted SegmentMean
    return "embedding_lookup_sparse"


def check_half_table_widened(site: Site) -> None:
    """A float16 table whose rows the composite casts to float32 before weighting
    and summing: the fused op works in the table's dtype (weights cast to it, the
    bag rounded to it), where a weight, a product or a bag sum past 65504 becomes
    inf although the composite's float32 is finite. Kept: an unweighted mean or
    max, which the op computes inside and which stay within the rows' range.
    (bfloat16 has float32's range: only its rounding differs, within tolerance.)"""
    if site.dtype != "float16" or site.cast_to != "float32":
        return
    if site.weights is None and site.combiner in ("mean", "max") and not site.divide_by_bag:
        return
    raise Skip("a float16 table computed in float32: the fused op would weight and sum in "
               "float16, which overflows past 65504 where the composite does not")


def _check_matched(fg: FunctionGraph, site: Site) -> None:
    """Checks every matched site passes before it is fused (Skip otherwise)."""
    check_half_table_widened(site)
    check_one_hot_combiner(site)
    check_no_nan_site(site)
    check_shared_weights_fixed(fg, site)
    zero_fill.check_dense_bag(site)
    unflatten.check_regroup_without_span(site)
    dropped_nan.check_dropped_rows(fg, site)


# Sites ending in ops that mostly end no bag (an add, a slice, a reshape).
_QUIET_MATCHERS = {**{op: positions.match_positions_sum for op in positions.ADD_OPS},
                   "StridedSlice": running_sum.match_cumsum_last, "Reshape": tensordot.match_tensordot}


def find_sites(fg: FunctionGraph, batch_size: int) -> List[Site]:
    """Every site in one function, fusable or not, in graph order."""
    sites: List[Site] = []
    claimed: set = set()

    def attempt(node, matcher, report_not_a_site=True):
        if node.name in claimed:
            return
        site = Site(function=fg.fdef.signature.name, root=node.name,
                    pattern=_pattern_of(node))
        try:
            site = matcher(fg, node, site)
            _check_matched(fg, site)
        except NotASite:
            if not report_not_a_site:
                return
            reason = unrecognised.unrecognised_reason(fg, node) \
                if node.op in unrecognised.REDUCE_OPS else unrecognised.segment_reason(fg, node)
            if reason is not None:
                site.reason = reason
                sites.append(site)
            return
        except Skip as skip:
            site.status, site.reason = "skipped", str(skip)
            sites.append(site)
            claimed.add(node.name)  # reported once
            return
        site.status = "fused"
        claimed.update(site.internal)
        claimed.add(site.root)
        sites.append(site)

    order = list(fg.fdef.node_def)
    # Divisions first: their inner SegmentSum must not be taken as a plain sum.
    for node in order:
        if node.op in sparse.DIVISION_OPS:
            attempt(node, sparse.match_division)
    # Poolings of per-position sparse lookups before those lookups, which they contain.
    for node in order:
        if node.op == "Sum":
            attempt(node, pooled.match_pooled_positions, report_not_a_site=False)
    # Ragged rows padded by to_tensor() before the reduction: the dense matcher sees no gather there.
    for node in order:
        if node.op in ("Sum", "Mean"):
            attempt(node, padded_ragged.match_padded_ragged, report_not_a_site=False)
            attempt(node, positions.match_stacked_positions, report_not_a_site=False)
    for node in order:
        if node.op in ("Sum", "Mean"):
            attempt(node, scales.match_reduce)
        elif node.op == "Einsum":
            attempt(node, einsum.match_einsum)
        elif node.op in einsum.MATMUL_OPS:
            attempt(node, counts.match_matmul_site)
        elif node.op in sparse.SPARSE_SEGMENT_COMBINERS:
            attempt(node, sparse.match_sparse_segment)
        elif node.op in ("SegmentSum", "SegmentMean", "SegmentMax"):
            attempt(node, unsorted_segments.match_segment_reduce)
        elif node.op in ("UnsortedSegmentSum", "UnsortedSegmentMax"):
            attempt(node, ragged.match_unsorted_segment_sum)
        elif node.op == "SparseTensorDenseMatMul":
            attempt(node, counts.match_sparse_dense_matmul)
        elif node.op == "Max":
            attempt(node, scales.match_reduce_max)
        elif node.op in _QUIET_MATCHERS:  # most such nodes are no bag: not listed when not a site
            attempt(node, _QUIET_MATCHERS[node.op], report_not_a_site=False)
        elif node.op in unrecognised.POOLING_OPS:  # Keras AveragePooling1D of an Embedding
            if node.op == "AvgPool":  # one window of the whole bag: its mean
                attempt(node, whole_bag_pool.match_whole_bag_pool, report_not_a_site=False)
            attempt(node, unrecognised.match_windowed_pooling, report_not_a_site=False)
        elif node.op in unrecognised.UNFUSABLE_REDUCE_OPS:
            attempt(node, unrecognised.never_a_site)
        elif node.op in unrecognised.UNFUSABLE_SEGMENT_OPS:
            attempt(node, unrecognised.match_unfusable_segment_reduce)
    for site in sites:
        site.computes = labels.computes(fg, site)
        if site.status == "fused":
            _bytes(site, batch_size)
    return sites


def _bytes(site: Site, batch_size: int) -> None:
    """Bytes of the [.., K, D] intermediates the fused op no longer builds."""
    dim = site.table_shape[1] if site.table_shape else None
    sizes = site.intermediate_itemsizes or (1,)
    if dim is not None:
        site.bytes_per_index = int(sum(sizes)) * dim
    shape = site.gathered_shape
    if "sparse" in site.pattern or "ragged" in site.pattern or site.pattern == SEGMENT_PATTERN or not shape:
        return  # the number of ids per batch depends on the input
    elems = [batch_size if (i == 0 and d is None) else d for i, d in enumerate(shape)]
    if all(d is not None for d in elems):
        count = 1
        for d in elems:
            count *= d
        site.saved_bytes_at_batch = int(count * sum(sizes))


def rewrite_function(fdef, library_sigs, batch_size: int, fuse_sites: bool = True
                     ) -> List[Site]:
    """Finds the sites of one FunctionDef and, when `fuse_sites`, rewrites it
    in place."""
    fg = FunctionGraph(fdef, library_sigs)
    sites = find_sites(fg, batch_size)
    fused = [s for s in sites if s.status == "fused"]
    if fuse_sites and fused:
        seeds = []
        for site in fused:
            old_root_inputs = [fg.parse(t).node for t in fg.nodes[site.root].input
                               if not t.startswith("^")]
            dropped_nan.build_nan_term(fg, site)  # from the mask and ids as matched
            zero_weights_as_padding(fg, site)  # multiply_no_nan(rows, w): ids of w == 0 padding
            scales.fold_factors(fg, site)
            zero_fill.broadcast_ids_like_fill(fg, site)
            unsorted_segments.sort_by_segment(fg, site)
            if site.positions is not None:
                positions.take_positions(fg, site)
            if site.no_nan_positions:  # w[..., a:b]'s zeros padding, the ids sliced alike
                site.no_nan_weights = ((site.weights, False, False),)
                zero_weights_as_padding(fg, site)
            if site.pattern == "einsum":
                einsum.check_labelled_weights(fg, site)
            if site.flatten_bag_axes > 1:
                flat_bags.flatten_bag_axes(fg, site)
            if site.weights_unit_row:
                einsum.unit_row_weights(fg, site)
            if site.weights_to_vector:
                einsum.positional_weights_as_vector(fg, site)
            matmul_width.assert_matmul_widths(fg, site)
            fuse.fuse_site(fg, site)
            seeds.extend(half_division.widen_masked_mean_division(fg, site))
            seeds.extend(site.internal)
            seeds.extend(site.dead_after)
            seeds.extend(n for n in old_root_inputs if n in fg.nodes and
                         fg.nodes[n].op in ("Const", "Identity", "Reshape", "Cast"))
        if any(s.pattern == "safe_embedding_lookup_sparse" for s in fused):
            seeds.extend(sparse.bypass_identity_sparse_reshapes(fg))
        if any(s.pattern == "ragged-reduce" for s in fused):
            seeds.extend(ragged_range.rewrite_ragged_ranges(
                fg, [n.name for n in fg.fdef.node_def if n.op in (DENSE_OP, RAGGED_OP)]))
        fg.remove_dead(seeds)
        # What fed only the removed sites through ops that are not seeds
        # (ragged broadcasting's row partitions) is unused now too.
        fg.remove_dead(fg.unused_stateless())
    return sites
