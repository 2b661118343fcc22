"""The fused backward + row-wise optimizer in TensorFlow (op PkmEmbeddingBagFusedUpdate).

A layer built with ``fused_optimizer=True`` reads its table through
``fused_embedding_bag``. The optimizer (``pkm_serve.optimizers.LazyAdam`` or
``RowwiseAdagrad``) claims the table in ``build`` (``claim``); from then on the
lookup's gradient function applies the optimizer's update to the table and its
slots in place, in the backward pass, and hands the optimizer an empty
gradient for the table (its ``update_step`` skips claimed tables). No table
gradient is formed: neither dense ``[N, D]`` nor ``IndexedSlices``.

Until an optimizer has claimed the table (e.g. a custom loop traced before
``optimizer.build``), the lookup gives the ordinary row-sparse gradient, which
the same optimizers apply with the same result; a warning says so once.
"""

from __future__ import annotations

import logging
import weakref

import tensorflow as tf

from pkm_serve._copy_on_write import as_tf_variable, leave_copy_on_write

_ATTR = "_pkm_fused_optimizer"
_warned = set()


def claim(variable, optimizer):
    """Marks `variable` (a layer's table) as updated in place by `optimizer`."""
    setattr(variable, _ATTR, weakref.ref(optimizer))


def claimed_by(variable):
    ref = getattr(variable, _ATTR, None)
    return ref() if ref is not None else None


def wants_fused(variable) -> bool:
    return bool(getattr(variable, "_pkm_wants_fused_optimizer", False))


def request(variable):
    """Called by a layer for its table: optimizers that support it will claim it."""
    variable._pkm_wants_fused_optimizer = True


def fused_embedding_bag(variable, indices, weights=None, combiner="sum"):
    """``ops.embedding_bag(variable, indices, weights, combiner)`` whose backward
    applies the claiming optimizer's update (dense [..., K] indices, float32 table)."""
    from pkm_serve import ops
    from tensorflow.python.ops import resource_variable_ops

    lib = ops.load_library()
    table = as_tf_variable(variable)
    if table.dtype != tf.float32:
        raise ValueError(f"fused_optimizer needs a float32 table, got {table.dtype.name}")
    if isinstance(indices, tf.RaggedTensor):
        raise ValueError("fused_optimizer takes dense [..., K] indices (pad ragged bags with -1)")
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        indices = tf.cast(indices, tf.int64)
    has_weights = weights is not None
    weights = tf.cast(weights, tf.float32) if has_weights else tf.zeros([0], tf.float32)
    resource_variable_ops.variable_accessed(table)  # the tape watches the table's handle

    @tf.custom_gradient
    def lookup(handle, bag_weights):
        out = lib.pkm_resource_embedding_bag(handle, indices, bag_weights, combiner=combiner, has_weights=has_weights)

        def grad(d_out):
            optimizer = claimed_by(variable)
            shape = tf.shape(table, out_type=tf.int64)
            if optimizer is None:
                if id(variable) not in _warned:
                    _warned.add(id(variable))
                    logging.getLogger("pkm_serve").warning(
                        "fused_optimizer: no optimizer has claimed table %s yet (build the optimizer before "
                        "the first step); this step uses the row-sparse gradient", table.name)
                rows, row_grads, d_w = lib.pkm_resource_embedding_bag_sparse_grad(
                    d_out, handle, indices, bag_weights, combiner=combiner, has_weights=has_weights)
                return tf.IndexedSlices(row_grads, rows, dense_shape=shape), d_w
            d_w = optimizer._pkm_fused_apply(variable, d_out, indices, bag_weights, combiner, has_weights)
            empty = tf.IndexedSlices(tf.zeros([0, table.shape[1]], tf.float32), tf.zeros([0], tf.int64), shape)
            return empty, d_w

        return out, grad

    out = lookup(table.handle, weights)
    return out


def run_update(variable, d_out, indices, weights, combiner, has_weights, optimizer, state, learning_rate, step,
               **attrs):
    """The op on `variable` and its state variables; returns d_weights."""
    from pkm_serve import ops

    d_weights = ops.load_library().pkm_embedding_bag_fused_update(
        d_out, as_tf_variable(variable).handle, indices, weights, [as_tf_variable(s).handle for s in state],
        tf.cast(learning_rate, tf.float32), tf.cast(step, tf.int64), combiner=combiner, has_weights=has_weights,
        optimizer=optimizer, **attrs)
    # Ordered after the update: automatic control dependencies order stateful
    # ops on one resource in a tf.function; eager runs them in turn.
    for written in (variable, *state):
        leave_copy_on_write(written)
    return d_weights
