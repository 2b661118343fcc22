"""The bag lookup in stock `keras.ops`: gather -> multiply -> reduce.

What a backend uses where it has no kernel (a device without our library, a
TPU): it materialises the [..., K, D] gather, so it costs K times the output's
memory in forward and backward. Semantics as the kernels': a negative index is
padding (adds nothing, not counted by mean/sqrtn), a zero denominator gives 0,
no bag with a row to read (ids [..., 0], no ragged values, a [0, D] table) gives zeros,
accumulation in float32, the result in the table's dtype; max's gradient goes
to the first row holding each maximum, as the kernels' (dense bags; ragged ones
split it evenly over tied rows, as segment_max does).

Ragged bags (values [V] + row_splits [B+1]) are refused as the kernels refuse
them: row_splits int32/int64 of shape [B+1] beside values [V], and, where
row_splits' values are known (eager; a numpy array; a constant under jax.jit
or tf.function), 0 first, non-decreasing and V last, each a ValueError with
the core's message. Traced row_splits (jax.jit, torch.compile, tf.function,
Keras' symbolic build) cannot be checked; there a value before row_splits[0]
or from row_splits[-1] on is dropped (no bag has it), and decreasing
row_splits give bags that are not their ranges (searchsorted of an unsorted
vector): no error, wrong bags.

An index >= N is refused the same way (a ValueError with the core's message)
where the indices' values are on the host (eager CPU arrays, numpy, a
constant under jit); ids on an accelerator are not copied back to check them,
and traced ids cannot be: there such an id is padding, as in the GPU kernels
(`take` alone would decide otherwise: JAX filled NaN rows, PyTorch's CUDA
gather a device-side assert that ends the process' CUDA context).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops


def embedding_bag_composite(params, indices, weights=None, combiner="sum", row_splits=None):
    """params [N, D]; indices [..., K] (or values [V] with row_splits [B+1]) -> [..., D]."""
    if combiner not in ("sum", "mean", "sqrtn", "max"):
        raise ValueError(f"combiner must be one of ('sum', 'mean', 'sqrtn', 'max'), got {combiner!r}")
    if row_splits is not None:
        row_splits = _checked_row_splits(indices, row_splits)
    _check_indices(indices, params.shape[0])
    if _no_rows_to_read(params, indices, row_splits):
        return _empty_bags(params, indices, row_splits)
    if combiner == "max":
        return _max_composite(params, indices, weights, row_splits)
    valid = _valid_ids(indices, params)
    keep = ops.cast(valid, "float32")
    w = keep if weights is None else ops.cast(weights, "float32") * keep
    rows = ops.cast(ops.take(params, ops.where(valid, indices, 0), axis=0), "float32") * w[..., None]
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
    valid = _valid_ids(indices, params)
    rows = ops.cast(ops.take(params, ops.where(valid, indices, 0), axis=0), "float32")
    masked = ops.where(valid[..., None], rows, ops.full_like(rows, float("-inf")))
    count = ops.cast(valid, "float32")
    if row_splits is None:
        top, nonempty = _first_max(masked), ops.sum(count, axis=-1) > 0
    else:  # ragged: segment_max's gradient splits ties evenly
        num_bags = row_splits.shape[0] - 1
        positions = ops.arange(indices.shape[0], dtype=row_splits.dtype)
        bag_of = ops.searchsorted(row_splits, positions, side="right") - 1
        top = ops.segment_max(masked, bag_of, num_segments=num_bags)
        nonempty = ops.segment_sum(count, bag_of, num_segments=num_bags) > 0
    out = ops.where(nonempty[..., None], top, ops.zeros_like(top))
    return ops.cast(out, keras.backend.standardize_dtype(params.dtype))


def _first_max(masked):
    """Max over the bag axis of [..., K, D] read at argmax's first position, so that the gradient goes
    to the first row holding each maximum (the kernels' and torch's mode="max"; ops.max split it evenly
    over tied rows, e.g. a zero-initialised table) and a NaN propagates from the first one."""
    # A one-hot select, not take_along_axis: that fixed the batch size under torch.export.
    positions = ops.arange(masked.shape[-2], dtype="int32")[:, None]
    first = ops.equal(positions, ops.expand_dims(ops.cast(ops.argmax(masked, axis=-2), "int32"), -2))
    return ops.sum(ops.where(first, masked, ops.zeros_like(masked)), axis=-2)


def _no_rows_to_read(params, indices, row_splits):
    """Whether no bag can hold a row (no table rows, a bag axis of length 0, no ragged values), where
    the gather and max's reductions had nothing to work on (take from an empty axis, max of an empty
    tensor raised); the kernels give zeros there."""
    bag_axis = indices.shape[-1] if row_splits is None else indices.shape[0]
    return params.shape[0] == 0 or bag_axis == 0


def _empty_bags(params, indices, row_splits):
    """Zeros [..., D] in the table's dtype: every bag empty. The table's empty slice is added so that
    autograd links the result to it (a zero gradient, not "does not require grad" under PyTorch)."""
    lead = tuple(indices.shape[:-1]) if row_splits is None else (row_splits.shape[0] - 1,)
    dtype = keras.backend.standardize_dtype(params.dtype)
    return ops.zeros(lead + (params.shape[1],), dtype) + ops.sum(params[:0], axis=0)


def _valid_ids(indices, params):
    """0 <= id < N: negative ids are padding, and so are ids >= N that _check_indices could not see."""
    num_rows = params.shape[0] if params.shape[0] is not None else ops.shape(params)[0]
    return ops.logical_and(ops.greater_equal(indices, 0), ops.less(indices, num_rows))


def _checked_row_splits(values, row_splits):
    """row_splits as a tensor, after the kernels' checks (see the module docstring)."""
    from pkm_serve.backends._native import row_splits_error

    host = _host_values(row_splits)
    row_splits = ops.convert_to_tensor(row_splits)
    dtype = keras.backend.standardize_dtype(row_splits.dtype)
    if dtype not in ("int32", "int64"):
        raise TypeError(f"row_splits must be int32 or int64, got {dtype}")
    if len(values.shape) != 1 or len(row_splits.shape) != 1 or row_splits.shape[0] < 1:
        raise ValueError("ragged bags need values [V] and row_splits [B+1] vectors, got "
                         f"{tuple(values.shape)} and {tuple(row_splits.shape)}")
    message = None if host is None else row_splits_error(host, values.shape[0])
    if message is not None:
        raise ValueError(message)
    return row_splits


def _check_indices(indices, num_rows):
    """The kernels' ValueError for an index >= num_rows, where the ids are on the host (module docstring)."""
    from pkm_serve.backends._native import index_error

    host = _host_values(indices, host_only=True)
    message = None if host is None or num_rows is None else index_error(host, num_rows)
    if message is not None:
        raise ValueError(message)


def _host_values(x, host_only=False):
    """x as a numpy array where its values are known now, else None (traced). host_only: None
    also for arrays on an accelerator (no device-to-host copy per call)."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple)):
        return np.asarray(x)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if isinstance(x, jax.core.Tracer):
            return None
        devices = getattr(x, "devices", None)
        if host_only and devices is not None and any(d.platform != "cpu" for d in devices()):
            return None
        return np.asarray(x)
    if backend == "torch":
        import torch

        if torch.compiler.is_compiling() or x.device.type == "meta" or (host_only and x.device.type != "cpu"):
            return None
        return x.detach().cpu().numpy()
    if backend == "tensorflow":
        import tensorflow as tf

        if host_only and "CPU" not in (getattr(x, "device", "") or "CPU"):
            return None
        return tf.get_static_value(x)  # None for a graph tensor that is not a constant
    return None


def _safe_divide(total, denom):
    denom = denom[..., None]
    nonzero = ops.not_equal(denom, 0.0)
    return ops.where(nonzero, total / ops.where(nonzero, denom, 1.0), 0.0)
