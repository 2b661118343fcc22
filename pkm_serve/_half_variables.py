"""What LazyAdam and RowwiseAdagrad do for a float16 / bfloat16 variable (a pure half policy's table)
beyond their own step, so that nothing of a step is rounded to the variable's precision before the
one rounding of its new value.

Keras makes the gradient accumulators (``gradient_accumulation_steps``) and the EMA copies
(``use_ema``) in the variable's dtype, applies ``weight_decay`` as a separate assignment computed in
that dtype, and rounds ``ema_momentum`` to it. In bfloat16 (8 bits) an accumulator plus a gradient
under 1/256 of it stayed as it was, an EMA copy moved only where ``(1 - momentum) * (var - average)``
was over half its precision (with momentum 0.99, never by less than ~0.8 of the gap), ``0.99``
became 0.98828125, and a decay of ``lr * wd`` under 1/512 of the value never moved the variable.
Here the accumulators and EMA copies are float32, the EMA update runs in float32, and weight decay
is folded into the variable's float32 step: ``var * (1 - lr * wd) - step``, rounded once (rows a
row-sparse gradient does not touch get the decay alone, as Keras gives every row).
"""

from __future__ import annotations

import keras
import tensorflow as tf

_HALF_DTYPES = ("float16", "bfloat16")
# slots (by Keras' name) of a half variable that the optimizers keep in float32
FLOAT32_SLOTS = ("momentum", "velocity", "velocity_hat", "gradient_accumulator", "average")


def state_dtype(variable):
    """The dtype of the optimizer's state of `variable` and of its update: float32 for a half-precision
    variable. In bfloat16, Keras' Adam (and LazyAdam, which did as it) rounded beta_2 = 0.999 to 1, so
    sqrt(1 - beta_2**t) was 0 and no step moved the variable; a bfloat16 second moment or row
    accumulator stops growing once a step's share is below its 8-bit precision."""
    dtype = keras.backend.standardize_dtype(variable.dtype)
    return "float32" if dtype in _HALF_DTYPES else dtype


def is_half(variable):
    return state_dtype(variable) != keras.backend.standardize_dtype(variable.dtype)


def in_float32(gradient):
    """`gradient` (a tensor, IndexedSlices or None) in float32 where it is half."""
    if gradient is None or keras.backend.standardize_dtype(gradient.dtype) not in _HALF_DTYPES:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(gradient.values, "float32"), gradient.indices, gradient.dense_shape)
    return tf.cast(gradient, "float32")


def _tf(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


class HalfVariableState:
    """Mixed into LazyAdam / RowwiseAdagrad (before Keras' optimizer): float32 slots, EMA and
    weight decay for half variables (see module doc). The step itself calls `decay_factor`."""

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        """Keras' slot of `reference_variable`; a slot of FLOAT32_SLOTS of a half variable in float32."""
        if name not in FLOAT32_SLOTS or not is_half(reference_variable):
            return super().add_variable_from_reference(reference_variable, name=name, initializer=initializer)
        prefix = getattr(reference_variable, "path", reference_variable.name)
        prefix = prefix.replace("/", "_").replace(":", "_")  # Keras' slot names
        with self._distribution_strategy.extended.colocate_vars_with(_tf(reference_variable)):
            return self.add_state_variable(reference_variable, shape=reference_variable.shape,
                                           initializer=initializer, dtype="float32", name=f"{prefix}_{name}")

    def add_state_variable(self, reference, **kwargs):
        """`self.add_variable(**kwargs)`, state of `reference`: where it is float32 state of a half
        variable, a tf.train.Checkpoint holding it in the half dtype (an earlier pkm_serve, Keras' Adam)
        restores it, also on creation (a restore before build), which tracking the variable runs."""
        self._pkm_half_state = kwargs["dtype"] != keras.backend.standardize_dtype(reference.dtype)
        try:
            return self.add_variable(**kwargs)
        finally:
            self._pkm_half_state = False

    def _folds_weight_decay(self, variable):
        return self.weight_decay is not None and is_half(variable) and self._use_weight_decay(variable)

    def _apply_weight_decay(self, variables):
        # a half variable's decay is part of its step (decay_factor), rounded once with it
        super()._apply_weight_decay([v for v in variables if not self._folds_weight_decay(v)])

    def decay_factor(self, variable, learning_rate):
        """float32 (1 - lr * weight_decay) where the step of half `variable` applies its weight decay,
        else None (no decay, or Keras' own before the step)."""
        if not self._folds_weight_decay(variable):
            return None
        return 1 - tf.cast(learning_rate, "float32") * tf.cast(self.weight_decay, "float32")

    def decay_untouched_rows(self, variable, keep):
        """Every row of `variable` times `keep` (rounded once): a row-sparse step then writes its rows."""
        self.assign(variable, tf.cast(_tf(variable), "float32") * keep)

    def _update_model_variables_moving_average(self, trainable_variables):
        # Keras' formula, with the momentum in the average's dtype (float32 for a half variable)
        if not self.use_ema:
            return
        for var, average in zip(trainable_variables, self._model_variables_moving_average):
            if average is not None:
                dtype = average.dtype
                momentum = tf.cast(tf.not_equal(self.iterations, 0), dtype) * tf.cast(self.ema_momentum, dtype)
                average.assign(momentum * _tf(average) + (1 - momentum) * tf.cast(_tf(var), dtype))

    def _overwrite_model_variables_with_average_value(self, trainable_variables):
        if len(trainable_variables) != len(self._model_variables_moving_average):
            return super()._overwrite_model_variables_with_average_value(trainable_variables)  # Keras' error
        replica = _replica_of_a_strategy()
        for var, average in zip(trainable_variables, self._model_variables_moving_average):
            if average is None:
                continue
            if replica is None:
                self._distribution_strategy.extended.update(
                    _tf(var), lambda a, b: a.assign(tf.cast(b, a.dtype)), args=(_tf(average),))
            else:
                # Keras' extended.update is a merge_call, which TF refuses inside the tf.cond that runs
                # this every ema_overwrite_frequency steps: fit failed under any MirroredStrategy.
                # Each replica writes its own copy from its own (equal) average, as update would.
                _local_copy(var, replica).assign(tf.cast(_local_copy(average, replica), var.dtype))
        return None


def _replica_of_a_strategy():
    """This replica's index among its worker's copies of a variable, in a replica context of a
    tf.distribute strategy; None elsewhere (no strategy, or cross-replica)."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
    # a multi-worker strategy counts replicas over workers, each holding as many copies
    return replica % len(tf.distribute.get_strategy().extended.worker_devices)


def _local_copy(variable, replica):
    copies = tf.distribute.get_strategy().experimental_local_results(_tf(variable))
    return copies[replica] if len(copies) > 1 else copies[0]
