"""Keras 3 optimizers that update only the rows a sparse gradient touches.

Keras' own optimizers, handed a ``tf.IndexedSlices`` gradient (what
``embedding_bag(..., sparse_gradient=True)`` produces), update their slots
densely (keras-team/keras#19992): every step reads and writes the whole table
and both Adam slots, which throws the sparse gradient's saving away. These two
keep Keras' optimizer API (``compile(optimizer=...)``, ``apply_gradients``,
schedules, serialisation, tf.distribute) and, for ``IndexedSlices``
gradients, read and write only the touched rows of the variable and its slots:

* ``LazyAdam``: Keras' Adam on dense gradients; on sparse ones the "lazy"
  variant of TF Addons' LazyAdam / ``torch.optim.SparseAdam``: the moments of
  touched rows are updated with the step's bias correction, untouched rows and
  their moments stay as they are.
* ``RowwiseAdagrad``: Adagrad with one accumulator per row (the mean of the
  row's squared gradient, as FBGEMM's row-wise Adagrad), so its slot is ``[N]``
  instead of ``[N, D]``. Rows with zero gradient do not move, so the sparse and
  the dense update are the same function.

Duplicate indices (e.g. IndexedSlices gathered from several replicas, or of
one table looked up twice) are summed first, before any clipping.

Fused: for a table whose layer asks for it (``fused_optimizer=True`` on
``EmbeddingBag`` / ``ProductKeyMemory``), both optimizers claim the table in
``build`` and apply their update inside the backward pass through one op
(``PkmEmbeddingBagFusedUpdate``: the row-grouped backward hands each touched
row's gradient straight to the update, no table gradient is formed), with the
same result as the sparse path (pkm_serve/_fused_update.py). Options that need
the gradient itself (clipping, weight decay, EMA, gradient accumulation, loss
scaling, amsgrad) are refused for fused tables.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from pkm_serve import (_copy_on_write, _fused_update, _half_state_restore, _half_variables, _loss_scale_check, _no_rows,
                       _row_accumulation)
from pkm_serve._half_variables import state_dtype as _state_dtype


def _unique_rows(gradient: tf.IndexedSlices, dtype):
    """(rows, gradient rows summed in `dtype`): each row once, without the marker of a
    table no replica touched (pkm_serve/_no_rows.py), which is no row."""
    indices, values = _no_rows.drop_markers(gradient)
    rows, position = tf.unique(indices)
    values = tf.math.unsorted_segment_sum(tf.cast(values, dtype), position, tf.shape(rows)[0])
    return rows, values


def _clipped_with_rows_summed(gradient: tf.IndexedSlices, clip):
    """`gradient` clipped by `clip` (Keras' clipping of a gradient list) as its dense gradient is:
    each row's slices summed first. The result keeps `gradient`'s indices, so the step's
    `_unique_rows` runs tf.unique on the same indices as here: a tf.unique of this tf.unique's
    rows, whose size is known only at run time, read XLA's padding past that size and scattered
    a repeated row a second time, from a zero gradient. Each row's clipped sum goes to its first
    slice that is no marker (pkm_serve/_no_rows.py), its other slices get 0, markers stay."""
    markers = _no_rows.marker_slots(gradient)
    values = gradient.values
    slots = tf.range(tf.shape(gradient.indices, out_type=tf.int32)[0])
    if markers is None:
        markers = tf.zeros_like(slots, tf.bool)
    rows, position = tf.unique(gradient.indices, out_idx=tf.int32)
    row_count = tf.shape(rows)[0]
    real = tf.where(_row_mask(markers, values), tf.zeros_like(values), values)
    summed = tf.math.unsorted_segment_sum(real, position, row_count)
    clipped = clip(tf.IndexedSlices(summed, rows, gradient.dense_shape))
    if not isinstance(clipped, tf.IndexedSlices) or clipped.indices is not rows:
        return clipped  # Keras' clipping gave other slices than the rows it was handed: kept as given
    first_real = tf.math.unsorted_segment_min(tf.where(markers, tf.shape(slots)[0], slots), position, row_count)
    takes_sum = tf.logical_and(tf.equal(tf.gather(first_real, position), slots), tf.logical_not(markers))
    per_slot = tf.where(_row_mask(takes_sum, values), tf.gather(clipped.values, position), tf.zeros_like(values))
    per_slot = tf.where(_row_mask(markers, values), values, per_slot)
    return tf.IndexedSlices(per_slot, gradient.indices, gradient.dense_shape)


def _squared_norm(gradient, dtype):
    """Sum of squares of `gradient` as its dense gradient has it: an IndexedSlices' repeated rows
    summed first (a marker's -0.0, pkm_serve/_no_rows.py, adds nothing)."""
    if not isinstance(gradient, tf.IndexedSlices):
        return tf.reduce_sum(tf.square(tf.cast(gradient, dtype)))
    rows, position = tf.unique(gradient.indices, out_idx=tf.int32)
    summed = tf.math.unsorted_segment_sum(tf.cast(gradient.values, dtype), position, tf.shape(rows)[0])
    return tf.reduce_sum(tf.square(summed))


def _scaled_by_global_norm(grads, clip_norm):
    """Keras' `global_clipnorm` (every gradient times one factor, min(1, clip_norm / global norm),
    NaN when that norm is not finite) with IndexedSlices kept row-sparse: their values scaled, so
    only the touched rows reach the step. The norm is taken in float32 at least."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    dtype = keras.backend.result_type("float32", *[g.dtype for g in present])
    norm = tf.sqrt(tf.add_n([_squared_norm(g, dtype) for g in present]))
    clip_norm = tf.cast(clip_norm, dtype)
    scale = clip_norm * tf.minimum(1 / norm, 1 / clip_norm) + (norm - norm)

    def scaled(values):
        return tf.cast(tf.cast(values, dtype) * scale, values.dtype)

    return [None if g is None
            else tf.IndexedSlices(scaled(g.values), g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
            else scaled(g) for g in grads]


def _row_mask(slot_mask, values):
    """`slot_mask` [n] broadcast over the rest of `values`' dims."""
    return tf.reshape(slot_mask, tf.concat([tf.shape(slot_mask), tf.ones([tf.rank(values) - 1], tf.int32)], 0))


def _scatter_update(variable, rows, values):
    variable = variable.value if isinstance(variable, keras.Variable) else variable
    variable.scatter_update(tf.IndexedSlices(tf.cast(values, variable.dtype), rows))
    _copy_on_write.leave_copy_on_write(variable)  # dense reads after training share the table


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _gather(variable, rows, dtype=None):
    variable = _tf_variable(variable)
    rows = tf.gather(variable, rows)
    return rows if dtype is None else tf.cast(rows, dtype)


def _claim_fused_tables(optimizer, var_list):
    """Claims the tables whose layers asked for the fused update (see module doc)."""
    for var in var_list:
        if not _fused_update.wants_fused(var):
            continue
        wrapper = _fused_update.calling_instance(keras.optimizers.LossScaleOptimizer)
        if wrapper is not None and wrapper.inner_optimizer is optimizer:
            _fused_update.refuse_loss_scaling(optimizer, var)
        _refuse_gradient_options(optimizer, var)
        _fused_update.claim(var, optimizer)


def _refuse_gradient_options(optimizer, var):
    """ValueError for options the fused update of `var` cannot apply. Checked when the optimizer
    claims the table and again before each update: an option set on the built optimizer
    (``optimizer.clipvalue = 0.5`` before a custom loop's step) was silently left out."""
    blocking = [name for name in ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm",
                                  "loss_scale_factor", "gradient_accumulation_steps")
                if getattr(optimizer, name, None)]
    if getattr(optimizer, "use_ema", False):
        blocking.append("use_ema")
    if getattr(optimizer, "amsgrad", False):
        blocking.append("amsgrad")
    if blocking:
        raise ValueError(f"{type(optimizer).__name__}: the fused update of {var.path} does not support "
                         f"{', '.join(blocking)} (it never forms the gradient); drop them or build the "
                         "layer with fused_optimizer=False")


def _adapt_a_loss_scale_wrapper(optimizer):
    """A LossScaleOptimizer (mixed_float16's) building `optimizer` checks the gradients' finiteness
    with `_loss_scale_check.all_finite` (Keras' made the step of a 2**20 x 64 table 20x slower, and could miss an inf),
    and loads a store saved before the accumulation's row marks (Keras' skipped it all, the loss
    scale included). A subclass' own check_finite / load_own_variables is left as it is."""
    wrapper = _fused_update.calling_instance(keras.optimizers.LossScaleOptimizer)
    if wrapper is None or wrapper.inner_optimizer is not optimizer:
        return
    keras_wrapper = keras.optimizers.LossScaleOptimizer
    if type(wrapper).check_finite is keras_wrapper.check_finite:
        wrapper.check_finite = _loss_scale_check.all_finite
    if type(wrapper).load_own_variables is keras_wrapper.load_own_variables:
        keras_load = functools.partial(keras_wrapper.load_own_variables, wrapper)
        wrapper.load_own_variables = functools.partial(
            _row_accumulation.load_without_marks, wrapper, keras_load=keras_load, inner=optimizer)


class _RowSparseSteps(_half_variables.HalfVariableState):
    """What LazyAdam and RowwiseAdagrad both wrap around Keras' optimizer: ``apply`` with
    IndexedSlices that ``loss_scale_factor`` can divide and gradient accumulation keeps row-sparse
    (pkm_serve/_row_accumulation.py), and ``update_step`` behind the fused-update check, the
    row-wise step itself being each one's ``_update_step``."""

    def apply(self, grads, trainable_variables=None):
        if self.gradient_accumulation_steps:
            # a half variable's accumulator is float32 (pkm_serve/_half_variables.py): Keras' `g + acc` of a
            # half gradient raised InvalidArgumentError
            grads = [_half_variables.in_float32(g) for g in grads]
        if self.loss_scale_factor is not None or self.gradient_accumulation_steps:
            grads = [_row_accumulation.RowSparseGradient(g.values, g.indices, g.dense_shape, self)
                     if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return super().apply(grads, trainable_variables)

    def _backend_increment_gradient_accumulators(self, grads, acc_grads):
        _row_accumulation.increment(self, grads, acc_grads, super()._backend_increment_gradient_accumulators)

    def _backend_reset_gradient_accumulators(self):
        _row_accumulation.reset(self, super()._backend_reset_gradient_accumulators)

    def load_own_variables(self, store):
        _row_accumulation.load_without_marks(self, store, super().load_own_variables)

    def _track_variable(self, variable):
        if getattr(self, "_pkm_half_state", False):
            _half_state_restore.accept_half_checkpoints(variable)
        super()._track_variable(variable)

    def _clip_gradients(self, grads):
        if _clips_after_the_all_reduce(self):
            return grads  # clipped in _backend_update_step, once the replicas' gradients are summed
        return self._clip_with_rows_summed(grads)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Keras clips each replica's share of the gradient before the all-reduce (a clip that binds
        # trained otherwise on 2 replicas than on 1); here the clip sees the summed gradient.
        if not _clips_after_the_all_reduce(self):
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        variables = [_tf_variable(v) for v in trainable_variables]
        summed = [g for g, _ in self._all_reduce_sum_gradients(list(zip(grads, variables)))]
        clipped = self._clip_with_rows_summed(summed)
        return tf.__internal__.distribute.interim.maybe_merge_call(
            self._distributed_tf_update_step, self._distribution_strategy, list(zip(clipped, variables)),
            learning_rate)

    def _clip_with_rows_summed(self, grads):
        # Keras clips the slices as they come: a row repeated by several lookups of one table
        # (TF concatenates their IndexedSlices) was clipped piece by piece and counted once per
        # piece in the norm. The clipping sees the gradient's rows summed, as the dense one.
        clip_all = super()._clip_gradients
        if not _clips(self):
            return clip_all(grads)  # Keras clips with positive limits only
        if self.global_clipnorm and self.global_clipnorm > 0:
            # Keras' scaling made an IndexedSlices dense: Adam then moved untouched rows.
            return _scaled_by_global_norm(grads, self.global_clipnorm)
        clip_one = lambda g: clip_all([g])[0]  # noqa: E731  (clipnorm, clipvalue: each gradient alone)
        return [_clipped_with_rows_summed(g, clip_one) if isinstance(g, tf.IndexedSlices)
                else clip_one(g) if g is not None else g for g in grads]

    def update_step(self, gradient, variable, learning_rate):
        # A claimed table's gradient is empty where the backward applied the update; any
        # other (a step the claim did not act in) is applied as usual.
        with tf.control_dependencies(_fused_update.refuse_a_second_update(self, gradient, variable)):
            return self._update_step(gradient, variable, learning_rate)


def _clips(optimizer):
    return any(limit and limit > 0 for limit in (optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue))


def _clips_after_the_all_reduce(optimizer):
    """Whether `optimizer` clips and runs in a replica context of several replicas."""
    context = tf.distribute.get_replica_context()  # None in a cross-replica context
    return _clips(optimizer) and context is not None and context.num_replicas_in_sync > 1


def _decayed(optimizer, variable, learning_rate, old, rows_only):
    """`old` (float32 values of `variable`, all or some rows, read before) with the weight decay a half
    variable's step folds in (pkm_serve/_half_variables.py); for some rows, every row is decayed
    first, the step then writing its rows."""
    keep = optimizer.decay_factor(variable, learning_rate)
    if keep is None:
        return old
    if rows_only:
        optimizer.decay_untouched_rows(variable, keep)
    return old * keep


def _fused_step(optimizer):
    return optimizer.iterations + 1  # the step apply_gradients is about to count


@keras.saving.register_keras_serializable(package="pkm_serve")
class LazyAdam(_RowSparseSteps, keras.optimizers.Adam):
    """Adam that, for ``IndexedSlices`` gradients, updates only the touched
    rows of the variable and of its two moments (arguments as
    ``keras.optimizers.Adam``; dense gradients get Keras' Adam unchanged)."""

    def build(self, var_list):
        _adapt_a_loss_scale_wrapper(self)
        if self.built:
            return
        super().build(var_list)  # Keras' order of the slots: a .keras file or checkpoint maps them by it
        _row_accumulation.build_marks(self, var_list)
        _claim_fused_tables(self, var_list)

    def _pkm_fused_apply(self, variable, d_out, indices, weights, combiner, has_weights):
        _refuse_gradient_options(self, variable)
        index = self._get_variable_index(variable)
        state = (self._momentums[index], self._velocities[index])
        return _fused_update.run_update(variable, d_out, indices, weights, combiner, has_weights, "adam", state,
                                        self.learning_rate, _fused_step(self), epsilon=float(self.epsilon),
                                        beta_1=float(self.beta_1), beta_2=float(self.beta_2))

    def _update_step(self, gradient, variable, learning_rate):
        dtype = _state_dtype(variable)
        dense = not isinstance(gradient, tf.IndexedSlices)
        if dense and dtype == keras.backend.standardize_dtype(variable.dtype):
            return keras.optimizers.Adam.update_step(self, gradient, variable, learning_rate)  # Keras' Adam
        lr = tf.cast(learning_rate, dtype)
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        if dense:  # a half-precision variable's: every row, in float32
            g = gradient
            read = lambda var: tf.cast(_tf_variable(var), dtype)  # noqa: E731
            write = self.assign  # casts to the variable's dtype
        else:
            rows, g = _unique_rows(gradient, dtype)
            read = lambda var: _gather(var, rows, dtype)  # noqa: E731
            write = lambda var, value: _scatter_update(var, rows, value)  # noqa: E731
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        g = tf.cast(g, dtype)
        m_rows, v_rows = read(m), read(v)
        m_rows = m_rows + (g - m_rows) * (1 - beta_1)
        v_rows = v_rows + (tf.square(g) - v_rows) * (1 - beta_2)
        write(m, m_rows)
        write(v, v_rows)
        if self.amsgrad:
            v_hat = self._velocity_hats[index]
            v_rows = tf.maximum(read(v_hat), v_rows)
            write(v_hat, v_rows)
        old = _decayed(self, variable, learning_rate, read(variable), rows_only=not dense)
        write(variable, old - alpha * m_rows / (tf.sqrt(v_rows) + self.epsilon))


def _check_adagrad_hyperparameters(initial_accumulator_value, epsilon):
    """ValueError for values that make the update NaN. Runs in __init__, so from_config and
    deserialize refuse them too; the fused op reads the same values and repeats only epsilon >= 0."""
    for name, value in (("initial_accumulator_value", initial_accumulator_value), ("epsilon", epsilon)):
        if not float(value) >= 0:  # NaN fails too
            raise ValueError(f"RowwiseAdagrad: {name} must be >= 0, got {value}")
    # Compared in float32, the precision of the update (1e-50 is 0 there).
    if np.float32(initial_accumulator_value) == 0 and np.float32(epsilon) == 0:
        raise ValueError(
            f"RowwiseAdagrad: initial_accumulator_value={initial_accumulator_value} with epsilon={epsilon} (both 0 "
            "in float32) gives NaN rows (0 / sqrt(0) for a row whose first gradient is 0); make "
            "initial_accumulator_value > 0 (TF1 Adagrad's rule) or epsilon > 0 (Keras Adagrad's)")


@keras.saving.register_keras_serializable(package="pkm_serve")
class RowwiseAdagrad(_RowSparseSteps, keras.optimizers.Optimizer):
    """Adagrad with one accumulator per row of each variable of rank >= 2
    (elementwise for vectors and scalars):

        acc[r] += mean(g[r]**2);   var[r] -= lr * g[r] / sqrt(acc[r] + epsilon)

    For ``IndexedSlices`` gradients only the touched rows of the variable and
    of its accumulator are read and written.

    Args:
        learning_rate, initial_accumulator_value, epsilon: as
            ``keras.optimizers.Adagrad``; both >= 0 and not both 0 (a touched
            row whose accumulator is still 0 and whose gradient is 0 would
            divide 0 by 0). The rest as ``keras.optimizers.Optimizer``.
    """

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7,
                 weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None,
                 use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None,
                 loss_scale_factor=None, gradient_accumulation_steps=None,
                 name="rowwise_adagrad", **kwargs):
        _check_adagrad_hyperparameters(initial_accumulator_value, epsilon)
        super().__init__(learning_rate=learning_rate, name=name, weight_decay=weight_decay,
                         clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm,
                         use_ema=use_ema, ema_momentum=ema_momentum,
                         ema_overwrite_frequency=ema_overwrite_frequency,
                         loss_scale_factor=loss_scale_factor,
                         gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon

    def build(self, var_list):
        _adapt_a_loss_scale_wrapper(self)
        if self.built:
            return
        super().build(var_list)
        self._accumulators = []
        init = keras.initializers.Constant(self.initial_accumulator_value)
        for var in var_list:
            shape = tuple(var.shape[:1]) if len(var.shape) >= 2 else tuple(var.shape)
            colocate = var.value if isinstance(var, keras.Variable) else var
            with self._distribution_strategy.extended.colocate_vars_with(colocate):
                self._accumulators.append(self.add_state_variable(
                    var, shape=shape, initializer=init, dtype=_state_dtype(var),
                    name=f"{var.name.replace('/', '_').replace(':', '_')}_rowwise_accumulator"))
        _row_accumulation.build_marks(self, var_list)
        _claim_fused_tables(self, var_list)

    def _pkm_fused_apply(self, variable, d_out, indices, weights, combiner, has_weights):
        _refuse_gradient_options(self, variable)
        acc = self._accumulators[self._get_variable_index(variable)]
        return _fused_update.run_update(variable, d_out, indices, weights, combiner, has_weights,
                                        "rowwise_adagrad", (acc,), self.learning_rate, _fused_step(self),
                                        epsilon=float(self.epsilon))

    def _update_step(self, gradient, variable, learning_rate):
        dtype = _state_dtype(variable)
        lr = tf.cast(learning_rate, dtype)
        acc = self._accumulators[self._get_variable_index(variable)]
        rank = len(variable.shape)
        if isinstance(gradient, tf.IndexedSlices):
            rows, g = _unique_rows(gradient, dtype)
        else:
            rows, g = None, tf.convert_to_tensor(gradient)
        g = tf.cast(g, dtype)
        if rank >= 2:
            sq = tf.reduce_mean(tf.square(g), axis=list(range(1, rank)))
            expand = (slice(None),) + (None,) * (rank - 1)
        else:
            sq, expand = tf.square(g), (Ellipsis,)
        if rows is None:
            acc_value = acc + sq
            self.assign(acc, acc_value)
            old = _decayed(self, variable, learning_rate, tf.cast(variable, dtype), rows_only=False)
            self.assign(variable, old - lr * g / tf.sqrt(acc_value + self.epsilon)[expand])
            return
        acc_rows = _gather(acc, rows) + sq
        _scatter_update(acc, rows, acc_rows)
        old_rows = _decayed(self, variable, learning_rate, _gather(variable, rows, dtype), rows_only=True)
        new_rows = old_rows - lr * g / tf.sqrt(acc_rows + self.epsilon)[expand]
        _scatter_update(variable, rows, new_rows)

    def get_config(self):
        config = super().get_config()
        config.update({"initial_accumulator_value": self.initial_accumulator_value,
                       "epsilon": self.epsilon})
        return config
