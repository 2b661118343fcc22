"""The fused backward + row-wise optimizer in TensorFlow (op PkmEmbeddingBagFusedUpdate).

A layer built with ``fused_optimizer=True`` reads its table through
``fused_embedding_bag``. The optimizer (``pkm_serve.optimizers.LazyAdam`` or
``RowwiseAdagrad``) claims the table in ``build`` (``claim``); from then on the
lookup's gradient function applies the optimizer's update to the table and its
slots in place, in the backward pass, and hands the optimizer an empty
gradient for the table (an ``IndexedSlices`` of no rows, which its
``update_step`` applies as nothing). No table gradient is formed: neither
dense ``[N, D]`` nor ``IndexedSlices`` of the touched rows.

Until an optimizer has claimed the table (e.g. a custom loop traced before
``optimizer.build``), the lookup gives the ordinary row-sparse gradient, which
the same optimizers apply with the same result; a warning says so once. The
row-sparse gradient is also what a frozen table (``trainable=False``), a
``fit`` driven by another optimizer than the claiming one (after a recompile)
and a SavedModel's saved gradient (``model.export``, ``tf.saved_model.save``)
get: the claim only acts for the optimizer that trains the model. A claimed
table is looked up once per training step and read nowhere else in it (a
second lookup or another read's gradient would apply a second update in the
same step), not under loss scaling (the update would
use the scaled gradient before the wrapper can unscale or skip it) and not
under a tf.distribute strategy of several replicas: each is a ValueError. A
per-table flag (``_PENDING``), set by the update and cleared by the optimizer's
step on the lookup's empty gradient, refuses at run time a second update
before that step (gradients accumulated over several ``tape.gradient`` calls)
and a non-empty gradient while one is pending.
"""

from __future__ import annotations

import logging
import sys
import weakref

import tensorflow as tf

from pkm_serve import _recording
from pkm_serve._copy_on_write import as_tf_variable, leave_copy_on_write

_ATTR = "_pkm_fused_optimizer"
_PENDING = "_pkm_fused_pending"
_warned = set()


def claim(variable, optimizer):
    """Marks `variable` (a layer's table) as updated in place by `optimizer`."""
    flag = getattr(variable, _PENDING, None)
    if flag is None:
        with tf.init_scope():  # not saved: 1 from a fused update until the optimizer's step for it
            flag = tf.Variable(0, dtype=tf.int32, trainable=False, name="pkm_fused_pending",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # update_step gets the TF variable (a replica's component under a strategy), not the Keras one.
    table = as_tf_variable(variable)
    components = table.values if isinstance(table, tf.distribute.DistributedValues) else ()
    for target in (variable, table, *components):
        setattr(target, _ATTR, weakref.ref(optimizer))
        setattr(target, _PENDING, flag)


def claimed_by(variable):
    ref = getattr(variable, _ATTR, None)
    return ref() if ref is not None else None


def wants_fused(variable) -> bool:
    return bool(getattr(variable, "_pkm_wants_fused_optimizer", False))


def request(variable):
    """Called by a layer for its table: optimizers that support it will claim it."""
    variable._pkm_wants_fused_optimizer = True


def calling_instance(cls, depth=24):
    """The ``self`` of the nearest caller frame that is a ``cls`` instance, or None.

    Keras drives an optimizer from outside it: ``fit``'s ``train_step`` holds
    the model (and so the optimizer that trains it), and a
    ``LossScaleOptimizer`` builds and applies its inner optimizer from its own
    methods; neither is reachable from the table or the optimizer."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, cls):
            return owner
        frame = frame.f_back
    return None


def refuse_loss_scaling(optimizer, variable):
    path = getattr(variable, "path", variable.name)  # update_step gets the TF variable, which has no path
    raise ValueError(
        f"{type(optimizer).__name__}: the fused update of {path} cannot run under loss scaling (a "
        "LossScaleOptimizer, which Keras adds for the mixed_float16 policy): the update would use the scaled "
        "gradient before the wrapper can unscale it or skip the step. Use sparse_gradient=True instead of "
        "fused_optimizer=True, or the mixed_bfloat16 policy")


_TWICE = ("fused_optimizer: table {} is looked up more than once in one training step (or differentiated "
          "again before apply_gradients); each lookup would apply its own update. Look it up once (concatenate "
          "the bags) or use sparse_gradient=True, whose optimizer step sums the lookups' gradients")


_updates_by_graph = weakref.WeakKeyDictionary()  # traced graph -> the fused updates it holds


def _check_one_update_per_step(variable, optimizer):
    if tf.executing_eagerly():
        step = (id(optimizer), int(optimizer.iterations.numpy()))
        table = as_tf_variable(variable)  # update_step, which clears it, gets the TF variable
        if getattr(table, "_pkm_fused_last_step", None) == step:
            raise ValueError(_TWICE.format(variable.path))
        table._pkm_fused_last_step = step
        return
    # Traced: one step's backward is one graph (per replica under tf.distribute).
    seen = _updates_by_graph.setdefault(tf.compat.v1.get_default_graph(), set())
    key = (id(variable), id(tf.distribute.get_replica_context()))
    if key in seen:
        raise ValueError(_TWICE.format(variable.path))
    seen.update((key, id(as_tf_variable(variable))))


_AGAIN = ("fused_optimizer: table {} got a second fused update before its optimizer applied the first: "
          "the lookup was differentiated again without an apply_gradients in between (gradients summed over "
          "several tape.gradient calls, a tape.gradient whose step was skipped, or one that left the table out "
          "of its sources: the backward updates it all the same). Call apply_gradients on the table after each "
          "tape.gradient, set trainable=False on a table you do not train, or use sparse_gradient=True instead "
          "of fused_optimizer=True")
_SECOND = ("fused_optimizer: table {} is also read outside its fused lookup in this training step (e.g. a tf.gather "
           "of the table, or an embeddings_regularizer), or its empty gradient was made dense (tf.recompute_grad "
           "around the lookup does); the backward pass "
           "already applied the lookup's update, and this gradient would apply a second one. Read the table only "
           "through the layer and pass its gradient on as it is, or use sparse_gradient=True instead of "
           "fused_optimizer=True")


_TRANSFORMED = ("fused_optimizer: the gradient of table {} reached the optimizer changed (e.g. by "
                "tf.clip_by_global_norm, a scaling or an all-reduce of your own) after its fused lookup's backward "
                "had already applied the unchanged update: the table's update cannot be clipped or scaled, and its "
                "gradient is missing from a global norm. Apply the lookup's gradient as tape.gradient returns it, "
                "or use sparse_gradient=True instead of fused_optimizer=True to transform it")
_lookup_gradients = {}  # id(values of an empty gradient the fused backward returned) -> weakref to them


def _empty_lookup_gradient(rows, width):
    """The empty table gradient of a fused lookup, remembered so that the optimizer can tell it from one a
    transformation (clip_by_global_norm multiplies the values) rebuilt on the way."""
    values = tf.zeros([0, width], tf.float32)
    for key in [k for k, ref in _lookup_gradients.items() if ref() is None]:
        del _lookup_gradients[key]
    _lookup_gradients[id(values)] = weakref.ref(values)
    return tf.IndexedSlices(values, tf.zeros([0], tf.int64), rows)


def _is_lookup_gradient(gradient):
    ref = _lookup_gradients.get(id(gradient.values))
    return ref is not None and ref() is gradient.values


def refuse_a_second_update(optimizer, gradient, variable):
    """Control inputs for `optimizer`'s update_step on `variable`. ValueError when a LossScaleOptimizer
    applies a claimed table (its backward used the scaled gradient), or when a non-empty gradient comes
    for a table whose fused lookup already applied this step's update: the table is also read elsewhere
    (a tf.gather, an embeddings_regularizer), and the unfused optimizer would have applied one update of
    the sum; at run time, the same through the table's pending flag (set by the fused update)."""
    import keras

    flag = getattr(variable, _PENDING, None)
    if claimed_by(variable) is optimizer:
        wrapper = calling_instance(keras.optimizers.LossScaleOptimizer, depth=64)
        if wrapper is not None and wrapper.inner_optimizer is optimizer:
            if tf.executing_eagerly() and flag is not None:
                flag.assign(0)  # the refusal ends this step: an unwrapped optimizer may go on
            refuse_loss_scaling(optimizer, variable)  # e.g. a custom loop's wrapper of a built optimizer
    path = getattr(variable, "path", variable.name)
    table = as_tf_variable(variable)
    step = getattr(table, "_pkm_fused_last_step", None)
    table._pkm_fused_last_step = None  # this step is applied: a restored (earlier) iterations may repeat it
    if tf.executing_eagerly():
        updated = step is not None and step == (id(optimizer), int(optimizer.iterations.numpy()))
    else:  # the traced step's backward and optimizer step share one graph (fit, a tf.function)
        updated = id(table) in _updates_by_graph.get(tf.compat.v1.get_default_graph(), ())
    if isinstance(gradient, tf.IndexedSlices) and gradient.values.shape[0] == 0:
        if flag is not None:
            flag.assign(0)  # the fused lookup's (empty) gradient: its update is applied
        if updated and not _is_lookup_gradient(gradient):
            raise ValueError(_TRANSFORMED.format(path))
        return []
    if updated:
        raise ValueError(_SECOND.format(path))
    if flag is None:
        return []
    return [tf.debugging.assert_equal(flag.read_value(), 0, message=_SECOND.format(path))]


def _warn_once(variable, message, *args):
    if id(variable) not in _warned:
        _warned.add(id(variable))
        logging.getLogger("pkm_serve").warning(message, *args)


def _optimizer_for_this_step(variable):
    """The optimizer whose update the lookup's backward applies now, or None
    (the row-sparse gradient)."""
    import keras
    from tensorflow.python.saved_model import save_context

    optimizer = claimed_by(variable)
    if not getattr(variable, "trainable", True):
        return None  # frozen: Keras asks for no table gradient; the weights may still want theirs
    if save_context.in_save_context():
        return None  # a SavedModel keeps the lookup's gradient, not this process's optimizer
    model = calling_instance(keras.Model)  # fit / train_on_batch: model.train_step is tracing
    driver = getattr(model, "optimizer", None) if model is not None else None
    if driver is not None:
        if optimizer is not None and getattr(driver, "inner_optimizer", None) is optimizer:
            refuse_loss_scaling(optimizer, variable)
        if driver is not optimizer:
            if not hasattr(driver, "_pkm_fused_apply"):
                _warn_once(variable, "fused_optimizer: %s does not apply the fused update; table %s gets the "
                           "row-sparse gradient (pkm_serve.optimizers.LazyAdam and RowwiseAdagrad fuse it)",
                           type(driver).__name__, variable.path)
            return None  # another optimizer trains the model (or ours before its build claimed the table)
    elif optimizer is None:
        _warn_once(variable, "fused_optimizer: no optimizer has claimed table %s yet (build the optimizer before "
                   "the first step); this step uses the row-sparse gradient", variable.path)
        return None
    _check_one_update_per_step(variable, optimizer)
    return optimizer


def _refuse_gradient_through_control_flow(forward_graph):
    """ValueError where the lookup ran in a tf.cond branch or tf.while_loop body (tf.map_fn) and a tape
    outside it differentiates through that control flow (the gradient is built in another graph): the
    update, a stateful op on the table and the optimizer's slots, cannot be built in that gradient."""
    current = tf.compat.v1.get_default_graph()
    if forward_graph is None or current is forward_graph:
        return
    # The control flow's own gradient graph; a tf.function's backward (a tape inside the loop body
    # around a nested function of the layer) is a plain graph, where the update runs as usual.
    if _recording.is_control_flow_graph(current) and _recording.in_control_flow_branch(forward_graph):
        raise ValueError("fused_optimizer=True: the layer is called inside a tf.cond / tf.switch_case / "
                         "tf.while_loop / tf.map_fn of a traced function and differentiated by a tape outside "
                         "it; its fused update cannot run in the gradient of that control flow. Call the layer "
                         "outside the control flow (e.g. select its output with tf.where), record the tape "
                         "inside it, or use sparse_gradient=True instead of fused_optimizer=True")


def fused_embedding_bag(variable, indices, weights=None, combiner="sum"):
    """``ops.embedding_bag(variable, indices, weights, combiner)`` whose backward
    applies the claiming optimizer's update (dense [..., K] indices, float32 table)."""
    from pkm_serve import _xla, ops
    from tensorflow.python.ops import resource_variable_ops

    lib = ops.load_library()
    recording = _recording.tape_could_record(if_unknown=True)  # unknown: refuse below rather than misupdate
    if _xla.compile_device_type() is not None:  # the fused ops have no XLA kernel
        if not recording:  # inference: no backward, no update
            return ops.embedding_bag(variable, indices, weights, combiner=combiner)
        raise ValueError("fused_optimizer=True cannot be compiled by XLA (a tf.function(jit_compile=True) or "
                         "jit_compile=True); compile without XLA, or use fused_optimizer=False under jit_compile")
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        # Each replica's backward would update the table with its own share of the batch (the
        # mirrored copies drift apart), and TF's collectives crash on the empty table gradient.
        raise ValueError(f"fused_optimizer=True does not run under a tf.distribute strategy with {replicas} "
                         "replicas: use sparse_gradient=True with LazyAdam or RowwiseAdagrad there")
    table = as_tf_variable(variable)
    if table.dtype != tf.float32:
        raise ValueError(f"fused_optimizer needs a float32 table, got {table.dtype.name}")
    if isinstance(table, tf.distribute.DistributedValues) and tf.distribute.in_cross_replica_context():
        # No handle outside a replica (Keras' symbolic build under strategy.scope()): no step trains here.
        return ops.embedding_bag(table, indices, weights, combiner=combiner)
    if isinstance(indices, tf.RaggedTensor):
        raise ValueError("fused_optimizer takes dense [..., K] indices, not ragged or tf.SparseTensor ones: pad "
                         "the bags with -1 (ids.to_tensor(-1), tf.sparse.to_dense(ids, default_value=-1)), "
                         "or train with sparse_gradient=True instead")
    from tensorflow.python.saved_model import save_context

    if save_context.in_save_context():
        # A SavedModel keeps the row-sparse gradient (_optimizer_for_this_step): that of the plain op,
        # whose gradient TF registers by op type. TF's loader cannot differentiate the custom gradient
        # below, which takes the table's resource handle: it fed float zeros of the table's shape where
        # the saved gradient function was traced with the handle (TypeError, "Binding inputs").
        return ops.embedding_bag(table, indices, weights, combiner=combiner, sparse_gradient=True)
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        indices = tf.cast(indices, tf.int64)
    has_weights = weights is not None
    weights = tf.cast(weights, tf.float32) if has_weights else tf.zeros([0], tf.float32)
    resource_variable_ops.variable_accessed(table)  # the tape watches the table's handle

    # Every tensor the backward reads is an input of the lookup (not a closure
    # over the caller's graph), so that a SavedModel can trace its gradient.
    def lookup(handle_or_rows, bag_weights, bag_indices):
        forward_graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if handle_or_rows.dtype == tf.resource:
            out = lib.pkm_resource_embedding_bag(handle_or_rows, bag_indices, bag_weights, combiner=combiner,
                                                 has_weights=has_weights)
        else:
            out = lib.pkm_embedding_bag(handle_or_rows, bag_indices, bag_weights, combiner=combiner,
                                        has_weights=has_weights)

        def grad(d_out):
            _refuse_gradient_through_control_flow(forward_graph)
            optimizer = _optimizer_for_this_step(variable)
            shape = tf.shape(table, out_type=tf.int64)
            if optimizer is None:
                # table.handle, not `handle`: a SavedModel maps the variable's own handle to the variable.
                rows, row_grads, d_w = lib.pkm_resource_embedding_bag_sparse_grad(
                    d_out, table.handle, bag_indices, bag_weights, combiner=combiner, has_weights=has_weights)
                return tf.IndexedSlices(row_grads, rows, dense_shape=shape), d_w, None
            d_w = optimizer._pkm_fused_apply(variable, d_out, bag_indices, bag_weights, combiner, has_weights)
            return _empty_lookup_gradient(shape, table.shape[1]), d_w, None

        return out, grad

    if not tf.executing_eagerly() and _recording.in_control_flow_branch(tf.compat.v1.get_default_graph()):
        # In a tf.cond branch or tf.while_loop body (fit's steps_per_execution loop), a tape outside
        # it would differentiate through a resource output made in the branch, which TF fails on
        # before any gradient function runs ("Taking gradient of a while loop which creates a
        # resource in its body"). On the table's read (a copy-on-write read shares it), the lookup's
        # gradient function runs and refuses that clearly; a tape inside gets the update as usual.
        return tf.custom_gradient(lookup)(table.read_value(), weights, indices)
    return tf.custom_gradient(lookup)(table.handle, weights, indices)


def run_update(variable, d_out, indices, weights, combiner, has_weights, optimizer, state, learning_rate, step,
               **attrs):
    """The op on `variable` and its state variables; returns d_weights."""
    from pkm_serve import ops

    flag = getattr(variable, _PENDING, None)
    checks = [] if flag is None else [tf.debugging.assert_equal(flag.read_value(), 0, message=_AGAIN.format(
        getattr(variable, "path", variable.name)))]
    with tf.control_dependencies(checks):
        d_weights = ops.load_library().pkm_embedding_bag_fused_update(
            d_out, as_tf_variable(variable).handle, indices, weights, [as_tf_variable(s).handle for s in state],
            tf.cast(learning_rate, tf.float32), tf.cast(step, tf.int64), combiner=combiner,
            has_weights=has_weights, optimizer=optimizer, **attrs)
    if flag is not None:
        flag.assign(1)  # until the optimizer's update_step gets this lookup's empty gradient
    # Ordered after the update: automatic control dependencies order stateful
    # ops on one resource in a tf.function; eager runs them in turn.
    for written in (variable, *state):
        leave_copy_on_write(written)
    return d_weights
