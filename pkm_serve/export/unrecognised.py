"""Why a reduction of gathered rows was not taken: the report's reason for a
Sum/Mean over the bag axis that no matcher took, and the max_norm clip that
both the dense and the sparse search name."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from pkm_serve.export.dense import leads_to_gather, resolve_rows
from pkm_serve.export.graph import FunctionGraph
from pkm_serve.export.unflatten import WEIGHTED_BEFORE_RESHAPE
from pkm_serve.export.sites import GATHER_OPS, TABLE_DTYPES, NotASite, Site, Skip, through_identity

# Reductions of gathered rows that the op has no combiner for: reported when they pool a bag.
UNFUSABLE_REDUCE_OPS = ("Min", "Prod", "EuclideanNorm")
UNFUSABLE_SEGMENT_OPS = ("UnsortedSegmentMin", "UnsortedSegmentProd", "SegmentMin", "SegmentProd")
REDUCE_OPS = ("Sum", "Mean", "Max") + UNFUSABLE_REDUCE_OPS
_ND_GATHER_OPS = ("ResourceGatherNd", "GatherNd")
_REDUCTION_NAMES = {"Min": "reduce_min", "Prod": "reduce_prod", "EuclideanNorm": "reduce_euclidean_norm",
                    "UnsortedSegmentMin": "a ragged reduce_min",
                    "UnsortedSegmentProd": "a ragged reduce_prod", "SegmentMin": "tf.math.segment_min",
                    "SegmentProd": "tf.math.segment_prod"}


def _no_combiner(op: str) -> str:
    return (f"{_REDUCTION_NAMES[op]} over the bag axis of gathered rows: the op has no such "
            "combiner (sum, mean, sqrtn, max), so the site stays composite")


_STITCHED_REASON = (
    "the rows are gathered from a table split into shards (embedding_lookup over a list of tables: "
    "DynamicPartition, one gather per shard, DynamicStitch) before the reduction: a dense or ragged "
    "lookup over shards is not fused (embedding_lookup_sparse over shards is), so the site stays composite")


def stitches_table_rows(fg: FunctionGraph, node) -> bool:
    """A (Parallel)DynamicStitch of rows gathered from table shards."""
    if node.op not in ("DynamicStitch", "ParallelDynamicStitch"):
        return False
    count = node.attr["N"].i
    return any(leads_to_gather(fg, ref, depth=2) for ref in fg.inputs(node)[count:])


def segment_reason(fg: FunctionGraph, node) -> Optional[str]:
    """For a segment reduction no matcher took: the reason where it reduces rows stitched from
    table shards (a ragged lookup over shards), else None (not a bag of table rows)."""
    producer = fg.producer(fg.inputs(node)[0]) if fg.inputs(node) else None
    for _ in range(3):  # through the Identity / Reshape to the ids' shape + [D] that the lookup adds
        if producer is None or producer.op not in ("Identity", "Reshape"):
            break
        producer = fg.producer(fg.inputs(producer)[0])
    if producer is not None and producer.op in ("RealDiv", "DivNoNan") and \
            leads_to_gather(fg, fg.inputs(producer)[0]):
        return _DIVIDED_RAGGED_REASON
    return _STITCHED_REASON if producer is not None and stitches_table_rows(fg, producer) else None


_DIVIDED_RAGGED_REASON = (
    "ragged rows divided by a divisor that ragged broadcasting re-gathers along with them (rt / d[:, :1, None], "
    "tf.math.divide_no_nan(rt, d[:, :1, None]) with a dense d per bag): not fused; rt * w[..., None] is, and a "
    "division of the bag (divide_no_nan(reduce_sum(rt, 1), d)) stays outside the fused site")


def never_a_site(fg: FunctionGraph, node, site: Site) -> Site:
    """reduce_min / reduce_prod: never fused; unrecognised_reason reports a bag of them."""
    raise NotASite()


def match_unfusable_segment_reduce(fg: FunctionGraph, node, site: Site) -> Site:
    """A segment min/prod of gathered rows (ragged reduce_min/prod): reported."""
    resolve_rows(fg, fg.inputs(node)[0], site)  # NotASite where no table rows are reduced
    site.pattern = "ragged-reduce" if node.op.startswith("Unsorted") else "segment-reduce"
    raise Skip(_no_combiner(node.op))


POOLING_OPS = ("AvgPool", "MaxPool", "MaxPoolV2")


def match_windowed_pooling(fg: FunctionGraph, node, site: Site) -> Site:
    """tf.nn.avg_pool / max_pool of gathered rows (Keras AveragePooling1D / MaxPooling1D of an Embedding: the
    rows expanded to [B, 1, K, D]): a window over the bag axis, even one of the whole bag, is reported, not left
    out of the report. NotASite where the pooled tensor is no gathered rows."""
    ref, steps = fg.inputs(node)[0], 0
    while steps < 4 and fg.producer(ref) is not None and fg.producer(ref).op in ("ExpandDims", "Reshape", "Identity"):
        ref, steps = fg.inputs(fg.producer(ref))[0], steps + 1
    if not leads_to_gather(fg, ref):
        raise NotASite()
    resolve_rows(fg, ref, site)  # fills the site's table fields; NotASite where no table rows are pooled
    site.combiner = "mean" if node.op == "AvgPool" else "max"
    kind, reduce = ("avg", "reduce_mean") if node.op == "AvgPool" else ("max", "reduce_max")
    layer = "Average" if node.op == "AvgPool" else "Max"
    raise Skip(f"gathered rows pooled by a window (tf.nn.{kind}_pool, Keras {layer}Pooling1D): not fused; "
               f"a reduction over the bag axis ({reduce}, Global{layer}Pooling1D) is")


def clips_rows(fg: FunctionGraph, node) -> bool:
    """clip_by_norm(rows, max_norm): rows * max_norm / maximum(norm(rows), max_norm)."""
    if node.op != "RealDiv":
        return False
    num, den = (fg.producer(r) for r in fg.inputs(node))
    return num is not None and num.op == "Mul" and den is not None and \
        den.op == "Maximum" and any(leads_to_gather(fg, r) for r in fg.inputs(num))


# Reductions that pool gathered rows: a reduction reached through one of them sums bags, not rows.
_POOLING_OPS = ("Sum", "Mean", "Max", "Min", "Prod", "UnsortedSegmentSum", "UnsortedSegmentMax",
                "UnsortedSegmentMin", "UnsortedSegmentProd", "SegmentSum", "SegmentMean", "SegmentMax",
                "SegmentMin", "SegmentProd")


def unrecognised_reason(fg: FunctionGraph, node, depth: int = 3) -> Optional[str]:
    """For a Sum/Mean over axis -2 that is not a site: if float rows of a
    table are gathered a few same-rank steps above it ([..., K, D] all the
    way), the reason it was not taken, so no bag-like reduction is silent."""
    x, axis_ref = fg.inputs(node)[:2]
    rank = fg.shape(x).rank
    axes = fg.const_value(axis_ref)
    if rank is None or rank < 2 or axes is None or np.size(axes) < 1:
        return None
    axes = sorted(int(a) % rank for a in np.ravel(axes))  # several: the bag axis and those before it (flat_bags)
    if len(axes) > 1 and axes != list(range(rank - 1 - len(axes), rank - 1)):
        return None
    axis = axes[-1]
    if axis == rank - 1:
        return _transposed_table_reason(fg, node, x, rank)
    if axis != rank - 2:
        return None  # not over a bag axis: e.g. a LayerNorm mean over D after an embedding
    frontier = [(x, [])]
    for _ in range(depth):
        next_frontier = []
        for ref, path in frontier:
            ref = through_identity(fg, ref, [])  # an Identity is no step
            producer = fg.producer(ref)
            if producer is None or (fg.shape(ref).rank != rank and "Reshape" not in path):
                continue
            if producer.op == "RaggedTensorToTensor" and leads_to_gather(fg, fg.inputs(producer)[1]):
                return _padded_rows_reason(node.op, path)
            if stitches_table_rows(fg, producer):
                return _no_combiner(node.op) if node.op in UNFUSABLE_REDUCE_OPS else _STITCHED_REASON
            if path == ["Reshape"] and _flattened_one_hot_matmul(fg, producer):
                return _FLAT_ONE_HOT_REASON
            if clips_rows(fg, producer):
                return ("each gathered row is clipped to max_norm (embedding_lookup max_norm=, i.e. "
                        "clip_by_norm) before the reduction: PkmEmbeddingBag has no row-norm clip, so "
                        "the site stays composite")
            if producer.op in ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN") and \
                    fg.shape(fg.inputs(producer)[0]).rank == 2:
                return (f"the rows are a sparse lookup ({producer.op} of the table) reshaped to [..., L, D], "
                        "but not the reshape(safe_embedding_lookup_sparse(ids [B, L, ..]), [B, L, D]) "
                        "[* w[..., None]] summed over L that is fused (keras-rs EmbedReduce on a "
                        "SparseTensor); this pooling over L is not fused")
            if producer.op in _POOLING_OPS:
                continue  # the rows were pooled before: this reduces bags (a site of their own), not rows
            if producer.op in GATHER_OPS + _ND_GATHER_OPS:
                dtype = producer.attr["dtype" if producer.op.startswith("Resource")
                                      else "Tparams"].type
                if dtype not in TABLE_DTYPES:
                    continue
                if node.op in UNFUSABLE_REDUCE_OPS:
                    return _no_combiner(node.op)
                if producer.op in _ND_GATHER_OPS:
                    return ("the rows are gathered by tf.gather_nd: only tf.gather / embedding_lookup / "
                            "Keras Embedding row gathers (axis 0) and tf.gather_nd(table, ids[..., None]) "
                            "are fused")
                if not path or _gathers_other_than_rows(fg, producer):
                    return _not_a_row_gather(fg, producer)
                if "Reshape" in path and {"Mul", "MulNoNan", "SelectV2"} & set(path[path.index("Reshape"):]):
                    return WEIGHTED_BEFORE_RESHAPE
                steps = " -> ".join(reversed(path))
                return (f"{steps} between the gather and the reduction: only a cast, a "
                        "per-index multiply and a tf.where mask are fused")
            for r in fg.inputs(producer):
                next_frontier.append((r, path + [producer.op]))
        frontier = next_frontier
    return None


def _transposed_table_reason(fg: FunctionGraph, node, x, rank: int) -> Optional[str]:
    """A reduction `node` over the last axis of tf.gather(table_T [D, N], ids, axis=1) ([D, .., K]), or
    of gathered rows transposed to [..., D, K]: a bag, reported; None for any other last-axis
    reduction (over D: each row's own)."""
    producer = fg.producer(through_identity(fg, x, []))
    steps = _steps_after_transposed_rows(fg, x, rank)
    if steps and set(steps) == {"Cast"}:  # Keras mixed precision: float16 rows permuted, pooled in float32
        return _transposed_casts_reason(fg, node, x)
    if steps:
        return (f"the gathered rows are transposed to [..., D, K], then {' -> '.join(steps)} before the reduction "
                "over K: after the transpose only a multiplier of one weight per position ([..., 1, K], w[:, None, "
                ":]) or a scalar, read by the reduction, is fused, not a mask or a multiplier per feature")
    if producer is not None and producer.op == "Transpose" and leads_to_gather(fg, fg.inputs(producer)[0]):
        perm = fg.const_value(fg.inputs(producer)[1])
        if perm is not None and list(np.reshape(perm, [-1])) == list(range(rank - 2)) + [rank - 1, rank - 2]:
            return ("the gathered rows are transposed to [..., D, K] and reduced over K (the bag axis) with "
                    "keepdims=True ([..., D, 1], the fused bag's unit axis would come before D) or through "
                    "steps that are not fused: the site stays composite")
    if producer is None or producer.op != "GatherV2":
        return None
    params, _, axis_ref = fg.inputs(producer)[:3]
    axis = fg.const_value(axis_ref)
    if producer.attr["Tparams"].type not in TABLE_DTYPES or fg.shape(params).rank != 2 or \
            axis is None or int(np.reshape(axis, [])) % 2 != 1 or rank < 3:
        return None
    return ("the table is stored transposed ([D, N]) and gathered along axis 1, then reduced over "
            "the ids' last axis: the op reads rows of an [N, D] table, so the site stays composite "
            "(store the table as [N, D] and tf.gather its rows)")


def _transposed_casts_reason(fg: FunctionGraph, node, x) -> str:
    """Why a reduction of casts of gathered rows transposed to [..., D, K] stays composite: such casts are fused
    (transposed_rows.py) only without keepdims, at most two, each step read by the next one only."""
    head = ("the gathered rows are transposed to [..., D, K], then cast before the reduction over K (Keras mixed "
            "precision's Permute + channels_first pooling)")
    if "keep_dims" in node.attr and node.attr["keep_dims"].b:
        return head + (" with keepdims=True ([..., D, 1], the fused bag's unit axis would come before D): not "
                       "fused; without keepdims it is")
    ref, casts = through_identity(fg, x, []), 0
    while fg.producer(ref) is not None and fg.producer(ref).op == "Cast":
        below = fg.inputs(fg.producer(ref))[0]
        if len(fg.consumers(below)) != 1:
            return head + (f": {fg.render(below)} is read by another op too, so fusing would not save memory: "
                           "not fused")
        ref, casts = through_identity(fg, below, []), casts + 1
    if casts > 2:
        return head + f": {casts} casts in a row, of which at most two (a half rounding and back) are fused"
    return head + ": through steps that are not fused, so the site stays composite"


def _steps_after_transposed_rows(fg: FunctionGraph, x, rank: int, depth: int = 3) -> List[str]:
    """The elementwise ops (outermost last) between gathered rows transposed to [..., D, K] and `x`, else []."""
    producer = fg.producer(through_identity(fg, x, []))
    if producer is None or depth == 0 or producer.op not in ("Mul", "MulNoNan", "RealDiv", "SelectV2", "Cast", "Neg"):
        return []
    for ref in fg.inputs(producer):
        inner = fg.producer(through_identity(fg, ref, []))
        if inner is not None and inner.op == "Transpose" and leads_to_gather(fg, fg.inputs(inner)[0]) and \
                fg.shape(ref).rank == rank:
            perm = fg.const_value(fg.inputs(inner)[1])
            if perm is not None and list(np.reshape(perm, [-1])) == list(range(rank - 2)) + [rank - 1, rank - 2]:
                return [producer.op]
        below = _steps_after_transposed_rows(fg, ref, rank, depth - 1)
        if below:
            return below + [producer.op]
    return []


_FLAT_ONE_HOT_REASON = (
    "the rows are a one-hot matmul whose one-hot is reshaped to [-1, N] first and the product reshaped to a "
    "shape not proven to be the ids' shape + [D] (its axes transposed first, or read by more than the lookup): "
    "not fused; tf.tensordot(tf.one_hot(ids, N), table, 1) or keras.ops.matmul of them is")


def _flattened_one_hot_matmul(fg: FunctionGraph, matmul) -> bool:
    """MatMul(Reshape([Transpose](OneHot(ids))), table): a one-hot lookup of flattened one-hots (tensordot's)."""
    if matmul.op != "MatMul":
        return False
    node = fg.producer(through_identity(fg, fg.inputs(matmul)[0], []))
    if node is None or node.op != "Reshape":
        return False  # tf.matmul(tf.one_hot(reshape(ids, [-1]), N), table) is fused (one_hot_lookup.py)
    node = fg.producer(through_identity(fg, fg.inputs(node)[0], []))
    if node is not None and node.op == "Transpose":
        node = fg.producer(through_identity(fg, fg.inputs(node)[0], []))
    return node is not None and node.op == "OneHot"


def _gathers_other_than_rows(fg: FunctionGraph, gather) -> bool:
    """A GatherV2 with batch_dims, or along an axis other than 0 (or not constant)."""
    if gather.op != "GatherV2":
        return False
    axis = fg.const_value(fg.inputs(gather)[2])
    return ("batch_dims" in gather.attr and gather.attr["batch_dims"].i != 0) or axis is None or int(axis) != 0


def _not_a_row_gather(fg: FunctionGraph, gather) -> str:
    """Why a GatherV2 of table-typed params whose output is reduced is no row gather: its axis and batch_dims."""
    if gather.op != "GatherV2":
        return "the gather is not a row gather (axis 0, batch_dims 0)"
    batch_dims = int(gather.attr["batch_dims"].i) if "batch_dims" in gather.attr else 0
    axis = fg.const_value(fg.inputs(gather)[2])
    written = (f"tf.gather(params {fg.shape(fg.inputs(gather)[0])}, ids, axis={'?' if axis is None else int(axis)}, "
               f"batch_dims={batch_dims})")
    if batch_dims:
        return (f"the rows are {written}: each batch entry gathers from its own params (a table per request, "
                "or one broadcast to a batch not read off the ids), not rows of one table (axis 0, batch_dims 0): "
                "not fused; tf.gather(table, ids), or params broadcast_to(t[None], [tf.shape(ids)[0], N, D]), is")
    return f"the rows are {written}, not a row gather of one table (axis 0, batch_dims 0): not fused"


def _padded_rows_reason(op: str, path) -> str:
    """A reduction of ragged gathered rows padded by to_tensor() that match_padded_ragged did not take."""
    if op in UNFUSABLE_REDUCE_OPS:
        return _no_combiner(op)
    if not path and op == "Max":
        return ("reduce_max of ragged rows padded by to_tensor(): the zero padding rows take part in the "
                "max (a bag of negative values gives 0), which is no bag max: not fused; tf.reduce_max on "
                "the ragged rows is the bag max, and is fused")
    steps = " -> ".join(reversed(path))
    return (f"{steps} between to_tensor() of ragged gathered rows and the reduction: only a plain "
            "reduce_sum / reduce_mean of to_tensor() rows is fused; reducing the ragged rows themselves (times ragged "
            "weights) is fused")
