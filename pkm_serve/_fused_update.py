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

_ATTR = "_pkm_fused_optimizer"
_warned = set()


def _tf_variable(variable):
    return getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable


def leave_copy_on_write(variable):
    """Switches a variable that a sparse update just wrote back to copy-on-write mode.

    A scatter update (and PkmEmbeddingBagFusedUpdate, which updates in place
    the same way) leaves a resource variable in TF's copy-on-read mode, in which
    every dense read (ReadVariableOp: the plain bag op in model.predict or
    evaluate, a tf.function, eager calls) copies the whole table: 21 ms per
    predict batch instead of 1.2 ms for a 128 MB table on the 2-core VM. Back in
    copy-on-write mode a read shares the table's buffer, and the next sparse
    update copies the table only if such a read is still alive (as TF's
    ``read_value_no_copy`` does for its own fused lookup and its checkpoints).
    Not under XLA, which reads variables as compiled arguments, without copies.
    """
    from tensorflow.python.ops import gen_resource_variable_ops

    from pkm_serve import _xla

    if _xla.compile_device_type() is not None:
        return
    gen_resource_variable_ops.disable_copy_on_read(_tf_variable(variable).handle)


# The tf.Variable methods that write rows in place; each leaves copy-on-read mode behind.
_SCATTER_METHODS = ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min",
                    "scatter_mul", "scatter_div", "batch_scatter_update", "scatter_nd_add",
                    "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min")


def stay_copy_on_write_after_scatters(variable):
    """Makes every scatter method of a layer's table leave it in copy-on-write mode.

    Stock Keras optimizers apply a row-sparse gradient with ``scatter_sub`` /
    ``scatter_add`` (keras.src.backend.tensorflow.optimizer), after which every
    dense read of the table copies it (``leave_copy_on_write``). The methods are
    replaced on this variable only, so the switch lands in the training graph
    beside the scatter and never in inference graphs (TF's freezer cannot
    rewrite a DisableCopyOnRead of a variable it turns into a constant). A
    mirrored variable's replicas are plain variables, each of whose methods its
    own scatters call (tf.distribute's values_util), so each is wrapped.
    """
    from tensorflow.python.distribute import values as distribute_values

    table = _tf_variable(variable)
    if isinstance(table, distribute_values.DistributedVariable):
        for component in table.values:
            _wrap_scatter_methods(component)
    else:
        _wrap_scatter_methods(table)


def _wrap_scatter_methods(table):
    import functools

    from tensorflow.python.ops import resource_variable_ops

    if type(table) is not resource_variable_ops.ResourceVariable:
        return  # e.g. a packed or sharded variable: TF's behaviour stays
    if getattr(table, "_pkm_stays_copy_on_write", False):
        return
    table_ref = weakref.ref(table)  # no reference cycle through the variable's own attributes
    for name in _SCATTER_METHODS:
        method = getattr(type(table), name)

        @functools.wraps(method)
        def scatter_then_copy_on_write(*args, _method=method, **kwargs):
            target = table_ref()
            result = _method(target, *args, **kwargs)
            leave_copy_on_write(target)  # ordered after the scatter: both use the handle
            return result

        setattr(table, name, scatter_then_copy_on_write)
    table._pkm_stays_copy_on_write = True


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
    table = _tf_variable(variable)
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
        d_out, _tf_variable(variable).handle, indices, weights, [_tf_variable(s).handle for s in state],
        tf.cast(learning_rate, tf.float32), tf.cast(step, tf.int64), combiner=combiner, has_weights=has_weights,
        optimizer=optimizer, **attrs)
    # Ordered after the update: automatic control dependencies order stateful
    # ops on one resource in a tf.function; eager runs them in turn.
    for written in (variable, *state):
        leave_copy_on_write(written)
    return d_weights
