"""The bag lookup in stock `keras.ops`: gather -> multiply -> reduce.

What a backend uses where it has no kernel (a device without our library, a
TPU): it materialises the [..., K, D] gather, so it costs K times the output's
memory in forward and backward. Semantics as the kernels': a negative index is
padding (adds nothing, not counted by mean/sqrtn), a zero denominator gives 0,
accumulation in float32, the result in the table's dtype.
"""

from __future__ import annotations

import keras
from keras import ops


def embedding_bag_composite(params, indices, weights=None, combiner="sum", row_splits=None):
    """params [N, D]; indices [..., K] (or values [V] with row_splits [B+1]) -> [..., D]."""
    if combiner not in ("sum", "mean", "sqrtn", "max"):
        raise ValueError(f"combiner must be one of ('sum', 'mean', 'sqrtn', 'max'), got {combiner!r}")
    if combiner == "max":
        return _max_composite(params, indices, weights, row_splits)
    keep = ops.cast(ops.greater_equal(indices, 0), "float32")
    w = keep if weights is None else ops.cast(weights, "float32") * keep
    rows = ops.cast(ops.take(params, ops.maximum(indices, 0), axis=0), "float32") * w[..., None]
    if row_splits is None:
        total = ops.sum(rows, axis=-2)
        reduce = lambda x: ops.sum(x, axis=-1)  # noqa: E731  (the bag axis of [..., K])
    else:
        # Value v belongs to bag b where row_splits[b] <= v < row_splits[b + 1].
        num_bags = row_splits.shape[0] - 1
        positions = ops.arange(indices.shape[0], dtype=row_splits.dtype)
        bag_of = ops.searchsorted(row_splits, positions, side="right") - 1
        reduce = lambda x: ops.segment_sum(x, bag_of, num_segments=num_bags)  # noqa: E731
        total = reduce(rows)
    if combiner == "mean":
        total = _safe_divide(total, reduce(w))
    elif combiner == "sqrtn":
        total = _safe_divide(total, ops.sqrt(reduce(w * w)))
    return ops.cast(total, keras.backend.standardize_dtype(params.dtype))


def _max_composite(params, indices, weights, row_splits):
    """Elementwise max over each bag's valid rows, 0 for an empty bag (the fused op's max)."""
    from pkm_serve.backends._native import MAX_WITH_WEIGHTS_ERROR

    if weights is not None:
        raise ValueError(MAX_WITH_WEIGHTS_ERROR)
    valid = ops.greater_equal(indices, 0)
    rows = ops.cast(ops.take(params, ops.maximum(indices, 0), axis=0), "float32")
    masked = ops.where(valid[..., None], rows, ops.full_like(rows, float("-inf")))
    count = ops.cast(valid, "float32")
    if row_splits is None:
        top, nonempty = ops.max(masked, axis=-2), ops.sum(count, axis=-1) > 0
    else:
        num_bags = row_splits.shape[0] - 1
        positions = ops.arange(indices.shape[0], dtype=row_splits.dtype)
        bag_of = ops.searchsorted(row_splits, positions, side="right") - 1
        top = ops.segment_max(masked, bag_of, num_segments=num_bags)
        nonempty = ops.segment_sum(count, bag_of, num_segments=num_bags) > 0
    out = ops.where(nonempty[..., None], top, ops.zeros_like(top))
    return ops.cast(out, keras.backend.standardize_dtype(params.dtype))


def _safe_divide(total, denom):
    denom = denom[..., None]
    nonzero = ops.not_equal(denom, 0.0)
    return ops.where(nonzero, total / ops.where(nonzero, denom, 1.0), 0.0)
