"""Ragged sites: a ragged gather reduced over its ragged axis.

  reduce_sum(embedding_lookup(table, ragged_ids) [* ragged_w[..., None]], axis=1)

is, in the graph, UnsortedSegmentSum(rows [* w], segment_ids(row_splits),
nrows) (reduce_max: UnsortedSegmentMax of unweighted rows, combiner 'max'): TF's tpu_embedding_for_serving CPU path (TFRS / tf-models-official
DLRM serving), keras-rs EmbedReduce and Keras ragged pooling write it. The
rows and weights may be re-gathered by ragged broadcasting (rows[perm] is
table[ids[perm]]). It becomes PkmRaggedEmbeddingBag on the row_splits the
segment ids were computed from; a div_no_nan by the weights' sum (a mean)
stays as written.
"""
from __future__ import annotations

from typing import Optional

from pkm_serve.export.dense import apply_rows, check_max_site, resolve_rows
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Site, Skip

# Ops of RaggedSplitsToSegmentIds (a Repeat of range(nrows) by the row
# lengths splits[1:] - splits[:-1]); all of them compute from the splits alone.
_SEGMENT_ID_OPS = {"StridedSlice", "Sub", "Shape", "Range", "Cast", "BroadcastTo", "Pack",
                   "Max", "Maximum", "ExpandDims", "Less", "Tile", "Reshape", "Where",
                   "Squeeze", "GatherV2", "ConcatV2", "Prod", "Identity", "Const",
                   "RaggedRange", "Cumsum", "Fill", "Size"}


def splits_of_segment_ids(fg: FunctionGraph, seg: Ref) -> Optional[Ref]:
    """The row_splits S that `seg` is computed from, when `seg` depends on S
    (and constants) only and S's row lengths S[1:] - S[:-1] are taken: the
    segment ids of a ragged row partition, sorted by construction."""
    for splits in _row_length_sources(fg, seg):
        if _reads_only(fg, seg, splits, set()):
            return splits
    return None


def _row_length_sources(fg: FunctionGraph, seg: Ref):
    """Every S with S[1:] - S[:-1] (two StridedSlices of S, subtracted) above `seg`."""
    seen, stack, found = set(), [seg], []
    while stack and len(seen) < 300:
        ref = stack.pop()
        node = fg.producer(ref)
        if ref.node in seen or node is None or node.op not in _SEGMENT_ID_OPS:
            continue
        seen.add(ref.node)
        ins = fg.inputs(node)
        if node.op == "Sub":
            a, b = (fg.producer(r) for r in ins)
            if a is not None and b is not None and a.op == b.op == "StridedSlice" and \
                    fg.inputs(a)[0] == fg.inputs(b)[0]:
                found.append(fg.inputs(a)[0])
        stack.extend(ins)
    return found


def _reads_only(fg: FunctionGraph, ref: Ref, splits: Ref, seen: set) -> bool:
    """`ref` is computed from `splits` and constants only."""
    if ref == splits or ref.node in seen:
        return True
    node = fg.producer(ref)
    if node is None or node.op not in _SEGMENT_ID_OPS or len(seen) > 300:
        return False
    seen.add(ref.node)
    return all(_reads_only(fg, r, splits, seen) for r in fg.inputs(node))


def match_unsorted_segment_sum(fg: FunctionGraph, node, site: Site) -> Site:
    """UnsortedSegmentSum (reduce_sum) or UnsortedSegmentMax (reduce_max,
    combiner 'max') of a ragged gather over its ragged rows."""
    data, seg, _ = fg.inputs(node)
    rows = resolve_rows(fg, data, site)
    site.pattern = "ragged-reduce"
    apply_rows(fg, site, rows, node.name, data)
    if fg.shape(data).rank != 2:
        raise Skip("segment reduction of gathered rows that are not [ids, D]")
    if node.op == "UnsortedSegmentMax":
        site.combiner = "max"
        check_max_site(site)
        # reduce_max of an empty ragged row is the dtype's lowest value; the
        # op gives an empty bag zeros, so the fused site writes it back.
        site.empty_bag_lowest = True
    splits = splits_of_segment_ids(fg, seg)
    if splits is None:
        raise Skip("segment ids are not those of a ragged row partition (row_splits), "
                   "so the bags may be unsorted")
    site.row_splits = splits
    site.segment_ids = seg
    return site
