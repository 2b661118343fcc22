"""Keeping tables out of TF's copy-on-read mode after sparse updates.

A scatter update (``scatter_*``, ``ResourceScatter*``, and our fused update)
leaves a resource variable in copy-on-read mode, in which every dense read
(``ReadVariableOp``) copies the whole variable; ``DisableCopyOnRead`` switches
it back. Used by the project's optimizers, the fused update, and the lookups
with ``sparse_gradient=True`` (for the scatters of stock optimizers).
"""

from __future__ import annotations

import weakref

import tensorflow as tf


def as_tf_variable(variable):
    """The tf.Variable a Keras 3 variable holds, else the argument unchanged (also where the
    Keras variable's value is not a tf.Variable, e.g. a cast under a mixed-precision autocast scope)."""
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


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
    gen_resource_variable_ops.disable_copy_on_read(as_tf_variable(variable).handle)


# The tf.Variable methods that write rows in place; each leaves copy-on-read mode behind.
_SCATTER_METHODS = ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min",
                    "scatter_mul", "scatter_div", "batch_scatter_update", "scatter_nd_add",
                    "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min")


def stay_copy_on_write_after_scatters(variable):
    """Makes every scatter method of a table variable leave it in copy-on-write mode.

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

    table = as_tf_variable(variable)
    if isinstance(table, distribute_values.DistributedVariable):
        for component in table.values:
            _wrap_scatter_methods(component)
    else:
        _wrap_scatter_methods(table)


def _wrap_scatter_methods(table):
    import functools

    from tensorflow.python.ops import resource_variable_ops

    # Subclasses too: a variable made in a tf.function's first trace is an UnliftedInitializerVariable.
    if not isinstance(table, resource_variable_ops.BaseResourceVariable):
        return  # e.g. a sharded variable: TF's behaviour stays
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
