"""The composite: ``embedding_bag`` written with stock TF ops (gather ->
multiply -> reduce), with the fused op's semantics; the tests' reference and
the fallback where the op library cannot run."""

from __future__ import annotations

import tensorflow as tf

from pkm_serve import _loss_scale_check, _xla
from pkm_serve._op_args import (MISMATCHED_WEIGHTS_SPLIT, _as_indices, _as_table, _as_weights, _check_combiner,
                                _ragged_weights_and_splits, _refuse_sparse_tensors, may_mark_mismatched_weights)

@tf.autograph.experimental.do_not_convert
def embedding_bag_composite(params, indices, weights=None, combiner="sum", name=None,
                            sparse_gradient=False):
    """``embedding_bag`` written as gather -> multiply -> reduce_sum.

    Materialises the ``[..., K, D]`` gather; use it as a reference, or where
    the op library is unavailable. Accumulates in float32 like the fused op.
    ``sparse_gradient`` is accepted for parity with ``embedding_bag``: the
    gather's gradient is an ``IndexedSlices`` either way (one row per index,
    not row-unique). An index >= N is an ``InvalidArgumentError``, except under
    XLA, which drops the check: there it is padding, as on the GPU.
    """
    _check_combiner(combiner, weights)
    _refuse_sparse_tensors(indices, weights)
    _loss_scale_check.install()  # Keras' finiteness check missed an inf in a row listed twice
    with tf.name_scope(name or "embedding_bag_composite"):
        params = _as_table(params)
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_composite(params, indices, weights, combiner)
        indices = _as_indices(indices)
        valid = _valid_ids(indices, params)
        w = tf.where(valid, _weights_like(weights, indices), 0.0)
        rows = tf.gather(params, tf.where(valid, indices, tf.zeros_like(indices)))
        if combiner == "max":
            out = _masked_max(tf.cast(rows, tf.float32), valid, axis=-2)
        else:
            summed = tf.reduce_sum(tf.cast(rows, tf.float32) * w[..., None], axis=-2)
            out = _combine(summed, w, combiner, axis=-1)
        return tf.cast(_xla.refusing_second_order_across_jit(out, [indices]), params.dtype)


def _weights_like(weights, ids):
    """float32 weights (ones for None) refused, as by the fused op, unless shaped
    like the ids, also where that is known only at run time: AddN does not
    broadcast (tf.where would)."""
    if weights is None:
        return tf.ones(tf.shape(ids), tf.float32)
    w, _ = _as_weights(weights, tf.float32, ids)
    return tf.math.add_n([w, tf.zeros(tf.shape(ids), tf.float32)])


def _valid_ids(ids, params):
    """ids >= 0 and < N, after an Assert that none is >= N. XLA drops the Assert
    and clamps a gather's ids: there an id >= N is padding, as on the GPU."""
    num_rows = tf.cast(tf.shape(params)[0], ids.dtype)
    tf.debugging.assert_less(ids, num_rows, message="embedding_bag: index out of range")
    return (ids >= 0) & (ids < num_rows)


def _masked_max(rows, valid, axis):
    """reduce_max over the bag axis of the valid rows only; 0 for an empty bag, NaN where a
    valid row holds one (XLA's reduce_max skips NaN: written out, so jit gives eager's answer).
    (reduce_max's gradient splits ties evenly; the fused op gives them to the
    first position. A NaN column's NaN rows share its gradient evenly, like ties.)"""
    kinds = _row_kinds(rows, valid[..., None])
    # Per bag column: 2 where a valid row holds NaN, else 1 where one is above -inf, else 0.
    kind = tf.reduce_max(kinds, axis=axis, keepdims=True)
    # NaN rows (where any), or every valid row of a column of -inf rows (reduce_max shared their
    # gradient with the padding's -inf) share the column's gradient evenly.
    tied = tf.where(kind == 2, kinds == 2, valid[..., None] & (kind == 0))
    tied_count = tf.reduce_sum(tf.cast(tied, rows.dtype), axis=axis)
    tied_mean = tf.reduce_sum(tf.where(tied, rows, tf.zeros([], rows.dtype)), axis=axis) / tf.maximum(tied_count, 1.0)
    top = tf.reduce_max(tf.where(kinds == 1, rows, tf.fill(tf.shape(rows), float("-inf"))), axis=axis)
    top = tf.where(tf.squeeze(kind, axis) > 0, top, tf.zeros_like(top))  # an empty bag: 0
    return tf.where(tied_count > 0, tied_mean, top)


def _row_kinds(rows, valid):
    """2 for a valid NaN, 1 for a valid value above -inf, 0 for -inf or padding (int32)."""
    nan = tf.math.is_nan(rows) & valid
    return tf.where(nan, 2, tf.cast(valid & (rows > float("-inf")), tf.int32))


def _ragged_masked_max(rows, valid, seg, nrows):
    """_masked_max of ragged bags with segment ops. unsorted_segment_max starts from the lowest
    finite value (a bag of -inf rows gave -3.4e38) and skips or keeps NaN by its position (eager)
    or always (XLA): -inf and NaN are written out, their rows sharing the gradient like ties.
    Two segment maxima (the columns' kinds, the largest value above -inf) and a gradient written
    out: differentiating the written-out ties took four segment reductions and a gather more."""
    valid = valid[:, None]
    seg_valid = tf.where(valid[:, 0], seg, tf.fill(tf.shape(seg), nrows))  # padding: a segment past the last bag
    kinds = _row_kinds(rows, valid)
    bag_kind = tf.math.unsorted_segment_max(kinds, seg_valid, nrows + 1)[:-1]
    nonempty = tf.math.unsorted_segment_max(tf.cast(valid[:, 0], tf.int32), seg_valid, nrows + 1)[:-1] > 0

    @tf.custom_gradient
    def bag_max(rows):
        above = tf.where(kinds == 1, rows, tf.fill(tf.shape(rows), float("-inf")))
        top = tf.math.unsorted_segment_max(above, seg_valid, nrows + 1)[:-1]
        # A column of -inf rows is -inf; an empty bag 0.
        low = tf.where(nonempty, float("-inf"), 0.0)[:, None]
        out = tf.where(bag_kind == 2, float("nan"), tf.where(bag_kind == 1, top, low))

        def grad(d_out):
            kind, winner = tf.gather(bag_kind, seg), tf.gather(top, seg)
            # The rows that share a column's gradient: its NaN rows, else its maxima, else (a column
            # of -inf rows) its valid rows.
            tied = tf.where(kind == 2, kinds == 2, tf.where(kind == 1, (kinds == 1) & (rows == winner), valid))
            count = tf.math.unsorted_segment_sum(tf.cast(tied, rows.dtype), seg, nrows)
            share = tf.gather(d_out / tf.maximum(count, 1.0), seg)
            return tf.where(tied, share, tf.zeros([], rows.dtype))

        return out, grad

    return bag_max(rows)


def _combine(summed, w, combiner, axis):
    if combiner == "mean":
        return tf.math.divide_no_nan(summed, tf.reduce_sum(w, axis=axis)[..., None])
    if combiner == "sqrtn":
        return summed * _inverse_norm(tf.reduce_sum(w * w, axis=axis))[..., None]
    return summed


def _inverse_norm(squares):
    """1 / sqrt(squares), and 0 where the sum of squared weights is 0 (the bag
    is then 0, and so is its derivative, as the fused kernels give it). The inner
    where keeps sqrt's derivative at 0 (inf) out of a jvp or a second derivative:
    divide_no_nan over sqrt gave NaN there."""
    positive = squares > 0
    return tf.where(positive, tf.math.rsqrt(tf.where(positive, squares, tf.ones_like(squares))),
                    tf.zeros_like(squares))


def bag_of_each_value(ragged):
    """ragged.value_rowids() (ragged rank 1) as int32 (XLA wants a segment op's count as int32).

    Under XLA a binary search over the row splits, O(values x log bags): value_rowids' Repeat needs
    its largest row length as a compile-time constant (XLA recompiles it for every new row splits,
    and cannot compile it where the sizes are known only at run time: ids masked inside a jit
    function), XLA's searchsorted compares every value with every split (O(values x bags)), and its
    cumsum of a tensor of run-time size is wrong on this TF."""
    if _xla.compile_device_type() is None:
        return tf.cast(ragged.value_rowids(), tf.int32)
    splits = ragged.row_splits
    positions = tf.range(tf.shape(ragged.values, out_type=splits.dtype)[0])
    num_bags = tf.shape(splits, out_type=tf.int32)[0] - 1
    # Bags are counted in int32, so fewer than 2**31: 31 halvings unless the count is static.
    steps = 31 if splits.shape[0] is None else max(splits.shape[0] - 1, 0).bit_length()
    ends_passed = tf.zeros(tf.shape(positions), tf.int32)  # bags ending at or before each position
    for k in reversed(range(steps)):
        probe = ends_passed + (1 << k)
        passed = (probe <= num_bags) & (tf.gather(splits, tf.minimum(probe, num_bags)) <= positions)
        ends_passed = tf.where(passed, probe, ends_passed)
    return ends_passed


def _nan_where_marked(out, checked_splits):
    """`out`, all NaN where `checked_splits` carry mark_mismatched_weights' mark: weights of another
    partition than the ids', checked by an Assert that XLA drops where it compiles the graph (the
    fallback under jit for a device without our target, or a graph traced without jit and compiled
    later). XLA has no stock op that can fail at run time, so NaN (loss and gradients too) is the
    refusal the stock ops can give; until round 38 the weights went into the ids' bags silently."""
    if not may_mark_mismatched_weights(checked_splits):
        return out
    marked = tf.equal(checked_splits[0], tf.constant(MISMATCHED_WEIGHTS_SPLIT, checked_splits.dtype))
    # A factor, not a term: the gradient through it is NaN too (a term passes d_out unchanged).
    return out * tf.where(marked, tf.constant(float("nan"), out.dtype), tf.ones([], out.dtype))


def _ragged_composite(params, indices, weights, combiner):
    values = indices.flat_values
    w_values, checked_splits = _ragged_weights_and_splits(indices, weights)
    if values.shape.rank is not None and values.shape.rank > 1:
        out = embedding_bag_composite(params, values, w_values, combiner)
        return indices.with_flat_values(_nan_where_marked(out, checked_splits))
    splits = indices.nested_row_splits
    inner = tf.RaggedTensor.from_row_splits(values, splits[-1], validate=False)
    values = _as_indices(values)
    valid = _valid_ids(values, params)
    w = tf.ones(tf.shape(values), tf.float32) if w_values is None else tf.cast(w_values, tf.float32)
    w = tf.where(valid, w, tf.zeros_like(w))
    rows = tf.cast(tf.gather(params, tf.where(valid, values, tf.zeros_like(values))), tf.float32)
    seg = bag_of_each_value(inner)
    nrows = inner.nrows(out_type=tf.int32)
    if combiner == "max":
        summed = _ragged_masked_max(rows, valid, seg, nrows)
    else:
        summed = tf.math.unsorted_segment_sum(rows * w[:, None], seg, nrows)
        if combiner == "mean":
            summed = tf.math.divide_no_nan(summed, tf.math.unsorted_segment_sum(w, seg, nrows)[:, None])
        elif combiner == "sqrtn":
            summed = summed * _inverse_norm(tf.math.unsorted_segment_sum(w * w, seg, nrows))[:, None]
    summed = _nan_where_marked(summed, checked_splits)
    out = tf.cast(_xla.refusing_second_order_across_jit(summed, [values, splits[-1]]), params.dtype)
    if len(splits) == 1:
        return out
    return tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)
