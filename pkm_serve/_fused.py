"""The fused op on one table: argument checks, the dense and ragged layouts,
the registered gradients and the row-sparse gradient path."""

from __future__ import annotations

import tensorflow as tf

from pkm_serve import _pfor, _recording, _second_order, _xla
from pkm_serve._composite import embedding_bag_composite
from pkm_serve._library import load_library
from pkm_serve._no_rows import marker_if_no_replica_has_any
from pkm_serve._op_args import (
    TABLE_DTYPES,
    _as_indices,
    _as_table,
    _as_weights,
    _check_combiner,
    _refuse_sparse_tensors,
    _ragged_weights_and_splits,
    may_mark_mismatched_weights,
    uniform_bags_as_ragged,
    uniform_bags_output,
)


# Plain Python with no tensor-dependent control flow: AutoGraph has nothing to
# convert, and converting would trace through the library loader.
@tf.autograph.experimental.do_not_convert
def fused_embedding_bag(params, indices, weights=None, combiner="sum", name=None, sparse_gradient=False):
    """``ops.embedding_bag`` on one table (not sharded): see its docstring."""
    _check_combiner(combiner, weights)
    _refuse_sparse_tensors(indices, weights)
    lib = load_library()
    if _xla.composite_under_xla(params, indices):  # XLA for a backend without our custom-call target
        return embedding_bag_composite(params, indices, weights, combiner, name=name)
    if sparse_gradient and _xla.compile_device_type() is not None:
        # Inference (e.g. serving under jit), or a tape that wants only d_weights: no table gradient
        # to shape. A TF without the private query gets the dense-gradient op, which XLA compiles and
        # differentiates (the same numbers).
        if not _table_gradient_could_be_recorded(params):
            return fused_embedding_bag(params, indices, weights, combiner, name)
        # XLA needs static shapes; the number of distinct rows depends on the data.
        raise ValueError("embedding_bag: sparse_gradient=True cannot be compiled by XLA (the number of "
                         "distinct rows touched is only known at run time); use sparse_gradient=False "
                         "under jit_compile, or compile without XLA (model.compile(jit_compile=False))")
    with tf.name_scope(name or "embedding_bag"):
        if sparse_gradient:
            from pkm_serve import _copy_on_write

            # A Keras 3 variable (a custom layer's add_weight) holds its tf.Variable in .value: the
            # variable itself gets the in-kernel read below and the scatter wrapping.
            params = _copy_on_write.as_tf_variable(params)
            if isinstance(params, tf.Variable):
                # Optimizers apply the IndexedSlices gradient with scatter updates.
                _copy_on_write.stay_copy_on_write_after_scatters(params)
        variable = _sparse_read_variable(params, indices) if sparse_gradient else None
        params = variable if variable is not None else _as_table(params)
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_embedding_bag(lib, params, indices, weights, combiner, sparse_gradient)
        if isinstance(weights, tf.RaggedTensor):
            raise TypeError("weights is ragged but indices is not")
        indices = _as_indices(indices)
        if indices.shape.rank == 0:
            raise ValueError("indices must have rank >= 1 ([..., K])")
        weights, has_weights = _as_weights(weights, params.dtype, indices)
        if variable is not None:
            from tensorflow.python.ops import resource_variable_ops

            resource_variable_ops.variable_accessed(variable)  # what a read tells the tape
            return lib.pkm_resource_embedding_bag(variable.handle, indices, weights, combiner=combiner,
                                                  has_weights=has_weights)
        if sparse_gradient:
            return _with_sparse_gradient(lib, params, (indices,), weights, combiner, has_weights)
        return lib.pkm_embedding_bag(params, indices, weights, combiner=combiner,
                                     has_weights=has_weights)


def _ragged_embedding_bag(lib, params, indices, weights, combiner, sparse_gradient=False):
    weight_values, checked_splits = _ragged_weights_and_splits(indices, weights)
    values = indices.flat_values
    if values.shape.rank is not None and values.shape.rank > 1:
        if may_mark_mismatched_weights(checked_splits):
            # Weights of another outer partition checked by an Assert, which XLA drops where it compiles
            # this graph later: the ragged op gets the mark in its splits (the dense op has none) and
            # refuses them there; until round 38 the weights went into the ids' bags silently.
            bags, bag_weights = uniform_bags_as_ragged(values, weight_values, checked_splits)
            out = fused_embedding_bag(params, bags, bag_weights, combiner, sparse_gradient=sparse_gradient)
            return indices.with_flat_values(uniform_bags_output(out, values))
        # Ragged outer dims, uniform bag axis: the dense op on the flat values.
        out = fused_embedding_bag(params, values, weight_values, combiner, sparse_gradient=sparse_gradient)
        return indices.with_flat_values(out)
    values = _as_indices(values)
    weight_values, has_weights = _as_weights(weight_values, params.dtype, values)
    splits = indices.nested_row_splits
    if sparse_gradient:
        out = _with_sparse_gradient(lib, params, (values, checked_splits), weight_values, combiner,
                                    has_weights)
    else:
        out = lib.pkm_ragged_embedding_bag(params, values, checked_splits, weight_values,
                                           combiner=combiner, has_weights=has_weights)
    if len(splits) == 1:
        return out
    return tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)


def _table_gradient_could_be_recorded(params):
    """Whether a tape in the graph being built could ask for the table's gradient: where a tape
    watches the table (a tape watching only the weights, or a frozen variable or Keras layer,
    needs no table gradient). A tape outside a compiled function sees a variable (not a tensor)
    as watched while the function traces; for a tensor it gets its gradients from the function's
    dense backward."""
    if not _recording.tape_could_record(if_unknown=False):
        return False
    from pkm_serve import _copy_on_write

    variable = _copy_on_write.as_tf_variable(params)
    if isinstance(variable, tf.Variable):
        if variable is not params and getattr(params, "trainable", True) is False:
            # A frozen Keras layer's variable: its tf.Variable stays trainable, so tapes that watch
            # accessed variables watch it (a layer called twice: from its first read on), but Keras
            # asks no gradient of it. A tape that does gets the plain lookup's dense gradient.
            return False
        return _recording.tape_watches_variable(variable, if_unknown=True)
    if hasattr(params, "assign"):  # another kind of variable
        return True
    # A tensor only where a tape watches it; a NumPy table becomes a constant no tape watches.
    return tf.is_tensor(params) and _recording.tape_watches(params, if_unknown=True)


def _register_gradients():
    @tf.RegisterGradient("PkmEmbeddingBag")
    def _embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        d_params, d_weights = load_library().pkm_embedding_bag_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        return [d_params, None, d_weights if has_weights else None]

    @tf.RegisterGradient("PkmRaggedEmbeddingBag")
    def _ragged_embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        d_params, d_weights = load_library().pkm_ragged_embedding_bag_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2], op.inputs[3],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        return [d_params, None, None, d_weights if has_weights else None]

    @tf.RegisterGradient("PkmResourceEmbeddingBag")
    def _resource_embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        rows, row_grads, d_weights = load_library().pkm_resource_embedding_bag_sparse_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        from tensorflow.python.ops import resource_variable_ops

        shape = _table_dense_shape(resource_variable_ops.variable_shape(op.inputs[0], out_type=tf.int64),
                                   _variable_rows(op.inputs[0]))
        rows, row_grads = marker_if_no_replica_has_any(rows, row_grads)
        return [tf.IndexedSlices(row_grads, rows, dense_shape=shape), None,
                d_weights if has_weights else None]

    _second_order.register()  # the gradient ops' own gradients (second derivatives)
    _pfor.register()  # tf.vectorized_map: one lookup on the stacked bags


_register_gradients()


# ---- row-sparse gradients ----------------------------------------------------------

_INT32_ROWS = 2**31


def _table_dense_shape(shape64, rows):
    """A table gradient's dense_shape: int32, as tf.gather's (tf.cond's gradient turns the other
    branch's zeros into IndexedSlices with one and fails on a mismatch: "must have the same ...
    structure"), but int64 for a table of 2^31 rows or more, or of unknown rows: an int32
    variable_shape wraps there (2^31 + 8 rows read as -2147483640)."""
    return tf.cast(shape64, tf.int32) if rows is not None and rows < _INT32_ROWS else shape64


def _variable_rows(handle):
    """The row count in a resource handle's shape data, or None where it is unknown."""
    from tensorflow.python.ops import resource_variable_ops

    try:
        dims = resource_variable_ops.get_eager_safe_handle_data(handle).shape_and_type[0].shape
    except (AttributeError, IndexError):
        return None
    return None if dims.unknown_rank or not dims.dim or dims.dim[0].size < 0 else dims.dim[0].size


def _sparse_read_variable(params, indices):
    """The resource variable to read inside the kernel while a tape records, else None.

    After its first sparse update (scatter_* of IndexedSlices), TF keeps a
    variable in copy-on-read mode: every dense read copies the whole table.
    ``PkmResourceEmbeddingBag`` reads it under its lock instead, as
    ``ResourceGather`` does. Used only when a gradient can be recorded (so
    exported inference graphs keep the plain op) for dense-layout bags of a
    CPU variable (the resource op has CPU kernels only).
    """
    if not isinstance(params, tf.Variable) or type(params).__name__ == "AutoCastVariable":
        return None
    if isinstance(indices, tf.RaggedTensor) or "GPU" in (params.device or "").upper():
        return None
    if params.dtype not in TABLE_DTYPES or params.shape.rank != 2:
        return None
    try:  # a distributed variable has a handle only inside a replica context
        params.handle
    except (AttributeError, ValueError):
        return None
    # Where TF cannot tell, the in-kernel read (right either way; only exported graphs prefer the plain op).
    return params if _recording.tape_could_record(if_unknown=True) else None


def _forward_mode_watches(*tensors):
    """Whether an active tf.autodiff.ForwardAccumulator has a tangent for any of `tensors`
    (False where TF lacks its private query: the lookup then keeps its sparse gradient)."""
    try:
        from tensorflow.python.eager import forwardprop_util

        return bool(forwardprop_util.pack_tangents(list(tensors)).tangents)
    except (ImportError, AttributeError):
        return False


def _with_sparse_gradient(lib, params, bag_inputs, weights, combiner, has_weights):
    """The forward op whose params-gradient is an IndexedSlices of unique rows.

    ``bag_inputs`` is ``(indices,)`` or ``(values, row_splits)``. The registered
    gradient of the forward op stays dense; this path pairs the same forward
    with ``Pkm*SparseGrad`` through ``tf.custom_gradient``. A variable's read
    passes the IndexedSlices through to the variable unchanged.
    """
    ragged = len(bag_inputs) == 2
    forward_op = lib.pkm_ragged_embedding_bag if ragged else lib.pkm_embedding_bag
    grad_op = lib.pkm_ragged_embedding_bag_sparse_grad if ragged else lib.pkm_embedding_bag_sparse_grad
    if _forward_mode_watches(params, weights):
        # A ForwardAccumulator takes the jvp by transposing the gradient on a tape, which cannot
        # take this path's IndexedSlices: the dense-gradient op (a tape beside it gets a dense gradient).
        return forward_op(params, *bag_inputs, weights, combiner=combiner, has_weights=has_weights)

    @tf.custom_gradient
    def fused(table, bag_weights):
        out = forward_op(table, *bag_inputs, bag_weights, combiner=combiner, has_weights=has_weights)

        def grad(d_out):
            rows, row_grads, d_weights = grad_op(d_out, table, *bag_inputs, bag_weights,
                                                 combiner=combiner, has_weights=has_weights)
            rows, row_grads = marker_if_no_replica_has_any(rows, row_grads)
            rows_known = table.shape[0] if table.shape.rank else None
            shape = tf.shape(table, out_type=tf.int64) if rows_known and rows_known >= _INT32_ROWS \
                else tf.shape(table)   # int32 (see _table_dense_shape); past 2^31 rows it fails loudly
            d_table = tf.IndexedSlices(row_grads, rows, dense_shape=shape)
            return d_table, (d_weights if has_weights else tf.zeros_like(bag_weights))

        return out, grad

    return fused(params, weights)
