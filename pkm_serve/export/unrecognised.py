"""Why a reduction of gathered rows was not taken: the report's reason for a
Sum/Mean over the bag axis that no matcher took, and the max_norm clip that
both the dense and the sparse search name."""
from __future__ import annotations

from typing import Optional

import numpy as np

from pkm_serve.export.dense import leads_to_gather
from pkm_serve.export.graph import FunctionGraph
from pkm_serve.export.sites import GATHER_OPS, TABLE_DTYPES, through_identity


def clips_rows(fg: FunctionGraph, node) -> bool:
    """clip_by_norm(rows, max_norm): rows * max_norm / maximum(norm(rows), max_norm)."""
    if node.op != "RealDiv":
        return False
    num, den = (fg.producer(r) for r in fg.inputs(node))
    return num is not None and num.op == "Mul" and den is not None and \
        den.op == "Maximum" and any(leads_to_gather(fg, r) for r in fg.inputs(num))


def unrecognised_reason(fg: FunctionGraph, node, depth: int = 3) -> Optional[str]:
    """For a Sum/Mean over axis -2 that is not a site: if float rows of a
    table are gathered a few same-rank steps above it ([..., K, D] all the
    way), the reason it was not taken, so no bag-like reduction is silent."""
    x, axis_ref = fg.inputs(node)[:2]
    rank = fg.shape(x).rank
    axes = fg.const_value(axis_ref)
    if rank is None or rank < 2 or axes is None or np.size(axes) != 1 or \
            int(np.reshape(axes, [])) % rank != rank - 2:
        return None  # not over a bag axis: e.g. a LayerNorm mean over D after an embedding
    frontier = [(x, [])]
    for _ in range(depth):
        next_frontier = []
        for ref, path in frontier:
            ref = through_identity(fg, ref, [])  # an Identity is no step
            producer = fg.producer(ref)
            if producer is None or (fg.shape(ref).rank != rank and path[-1:] != ["Reshape"]):
                continue
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
            if producer.op in GATHER_OPS:
                dtype = producer.attr["dtype" if producer.op == "ResourceGather"
                                      else "Tparams"].type
                if dtype not in TABLE_DTYPES:
                    continue
                if not path:
                    return "the gather is not a row gather (axis 0, batch_dims 0)"
                steps = " -> ".join(reversed(path))
                return (f"{steps} between the gather and the reduction: only a cast, a "
                        "per-index multiply and a tf.where mask are fused")
            for r in fg.inputs(producer):
                next_frontier.append((r, path + [producer.op]))
        frontier = next_frontier
    return None
