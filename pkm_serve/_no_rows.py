"""A row-sparse table gradient that no replica of a tf.distribute strategy
touched: the marker row the lookups give it, and the optimizers that skip it.

TF's ring gatherer crashes the process (SIGSEGV) gathering ``IndexedSlices``
that are empty on every replica; a stock ``tf.gather`` with no indices does
too. So where no replica touched any row of a table (or of one shard), every
replica's lookup gradient is one marker row: row 0 with every value -0.0.
That is a zero gradient to SGD, Keras' Adam and every other optimizer that
adds or densifies it (x - lr * -0.0 == x), and the project's LazyAdam and
RowwiseAdagrad drop it before their row-wise step, so row 0 and its slots stay
as on one replica (LazyAdam would otherwise decay row 0's moments and move
it). Real gradient rows are never the marker: their -0.0 values become +0.0.
"""

from __future__ import annotations

import tensorflow as tf

# Integer dtype of each float width: bitcast, -0.0 is the integer's minimum (the sign bit alone).
_BITS = {2: tf.int16, 4: tf.int32, 8: tf.int64}


def _is_negative_zero(values):
    as_int = tf.bitcast(values, _BITS[values.dtype.size])
    return tf.equal(as_int, as_int.dtype.min)


def marker_if_no_replica_has_any(rows, row_grads):
    """(rows [U], row_grads [U, D]) of one lookup's table gradient, or the
    marker where no replica in sync touched a row; unchanged outside a replica
    context of >= 2 replicas. One scalar all-reduce per lookup decides."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return rows, row_grads
    touched = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.size(rows, out_type=tf.int64))

    def real():  # -0.0 -> +0.0, so that no real row reads as the marker
        return rows, tf.where(tf.equal(row_grads, 0), tf.zeros_like(row_grads), row_grads)

    def marker():
        return tf.zeros([1], rows.dtype), tf.fill([1, tf.shape(row_grads)[1]], tf.constant(-0.0, row_grads.dtype))

    return tf.cond(touched > 0, real, marker)


def marker_slots(gradient: tf.IndexedSlices):
    """Bool [n]: which of `gradient`'s n slices are marker rows (under a
    strategy of >= 2 replicas); None elsewhere, where there are none."""
    indices, values = gradient.indices, gradient.values
    if tf.distribute.get_strategy().num_replicas_in_sync < 2 or not values.dtype.is_floating:
        return None
    flat = tf.reshape(values, [tf.shape(values)[0], -1])
    return tf.equal(indices, 0) & tf.reduce_all(_is_negative_zero(flat), axis=1)


def drop_markers(gradient: tf.IndexedSlices):
    """(indices, values) of `gradient` without the marker rows (under a
    strategy of >= 2 replicas; elsewhere as they are)."""
    markers = marker_slots(gradient)
    if markers is None:
        return gradient.indices, gradient.values
    keep = tf.logical_not(markers)
    return tf.boolean_mask(gradient.indices, keep), tf.boolean_mask(gradient.values, keep)
