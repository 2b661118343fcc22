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

from typing import List, Optional

import numpy as np
from tensorflow.python.framework import tensor_shape

from pkm_serve.export import scales
from pkm_serve.export.dense import apply_rows, check_max_site, resolve_rows
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Site, Skip
from pkm_serve.export.unsorted_segments import match_any_segment_ids

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
    data, seg, num_segments = fg.inputs(node)
    site.combiner = "max" if node.op == "UnsortedSegmentMax" else "sum"  # reported so where a step below skips
    rows = resolve_rows(fg, data, site, scaling=scales)  # rows * w * mask: one weight (scales.py)
    site.pattern = "ragged-reduce"
    apply_rows(fg, site, rows, node.name, data)
    if rows.factors and rows.regathers:
        raise Skip("ragged-broadcast rows scaled by several factors, or divided by a ragged divisor (rt / d[..., None], "
                   "tf.math.divide_no_nan(rt, d[..., None])): not fused; rt * w[..., None] is")
    if rows.factors:
        scales.check_factors(fg, site, rows.factors, fg.shape(site.indices) if site.regroup_ids is None else
                             tensor_shape.TensorShape([None if d == -1 else d for d in site.regroup_ids]))
        site.weight_factors = tuple(rows.factors)
    if fg.shape(data).rank != 2:
        raise Skip("segment reduction of gathered rows that are not [ids, D]")
    if node.op == "UnsortedSegmentMax":
        check_max_site(site)
        # reduce_max of an empty ragged row is the dtype's lowest value; the
        # op gives an empty bag zeros, so the fused site writes it back.
        site.empty_bag_lowest = True
    splits = splits_of_segment_ids(fg, seg)
    if splits is None:  # ids in any order: sorted before the op
        return match_any_segment_ids(fg, site, rows, seg, num_segments)
    try:
        check_partition_of(fg, splits, seg, num_segments)
    except Skip:
        # other bags of the partition's values (reversed, a fixed num_segments): sorted before the op
        return match_any_segment_ids(fg, site, rows, seg, num_segments)
    site.row_splits = splits
    site.segment_ids = seg
    return site


# Row partitions the segment-id computation is run on (empty rows among them):
# the ids must be each value's row, and num_segments the row count.
_PROBE_SPLITS = ([0, 2, 2, 5], [0, 1, 2, 3], [0], [0, 0, 3], [0, 3, 3, 3, 4, 9])


def check_partition_of(fg: FunctionGraph, splits: Ref, seg: Ref, num_segments: Ref) -> None:
    """Skips the site unless `seg` is the value_rowids of `splits` and
    `num_segments` its row count. Both are computed from the splits (and
    constants) alone, so running that computation on a few row partitions shows
    what it is: a structural match alone also takes, say, nrows - 1 - rowids
    (bags written in reverse) or a fixed num_segments (a padded batch)."""
    if not _reads_only(fg, num_segments, splits, set()):
        raise Skip("num_segments is not the row partition's row count computed from its "
                   "row_splits (e.g. a fixed batch size): the output may have other rows than bags")
    values = [np.asarray(value) for value in _PROBE_SPLITS]
    results = _evaluate_from(fg, [seg, num_segments], splits, values)
    if results is None:
        raise Skip("the segment ids could not be checked against the row partition")
    for value, (got_seg, got_count) in zip(values, results):
        rowids = np.repeat(np.arange(len(value) - 1), np.diff(value))
        if not (np.array_equal(np.asarray(got_seg).reshape(-1), rowids) and
                np.size(got_count) == 1 and int(np.reshape(got_count, [])) == len(value) - 1):
            raise Skip("segment ids or num_segments are computed from the row partition but "
                       "are not its rows (value_rowids) and row count")


def _evaluate_from(fg: FunctionGraph, targets: List[Ref], source: Ref, values: List[np.ndarray]):
    """Runs the function's nodes that compute `targets` from `source` alone (and
    constants), once per value fed to `source` (one graph, one session); None
    when that fails."""
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    feed_name = "pkm_probe_source"
    names, stack = [], [t for t in targets if t != source]
    while stack:
        ref = stack.pop()
        if ref == source or ref.node in names:
            continue
        node = fg.producer(ref)
        if node is None:
            return None
        names.append(ref.node)
        stack.extend(fg.inputs(node))
    for dtype in (tf.int64, tf.int32):
        graph_def = graph_pb2.GraphDef()
        feed = graph_def.node.add(name=feed_name, op="Placeholder")
        feed.attr["dtype"].type = dtype.as_datatype_enum
        for name in names:
            node = graph_def.node.add()
            node.CopyFrom(fg.nodes[name])
            for key in [k for k in node.attr if k.startswith("_")]:
                del node.attr[key]
            del node.input[:]
            for ref in fg.inputs(fg.nodes[name]):
                node.input.append(f"{feed_name}:0" if ref == source else f"{ref.node}:{ref.index}")
        outputs = [f"{feed_name}:0" if t == source else f"{t.node}:{t.index}" for t in targets]
        graph = tf.Graph()
        try:
            with graph.as_default():
                tf.graph_util.import_graph_def(graph_def, name="")
            with tf.compat.v1.Session(graph=graph) as session:
                return [session.run(outputs, {f"{feed_name}:0": value.astype(dtype.as_numpy_dtype)})
                        for value in values]
        except (ValueError, TypeError, tf.errors.OpError):
            continue
    return None
