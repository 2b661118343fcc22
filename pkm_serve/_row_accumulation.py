"""Keras' gradient accumulation (``gradient_accumulation_steps``) with row-sparse gradients kept
row-sparse, for LazyAdam and RowwiseAdagrad.

Keras adds each micro-step's gradient to a dense accumulator and hands the optimizer
``(g + accumulator) / steps`` every ``steps``-th step: an ``IndexedSlices`` became dense there,
so LazyAdam took dense Adam steps (rows no micro-step touched moved as their moments decayed)
and each micro-step wrote the whole ``[N, D]`` accumulator. Here an ``IndexedSlices`` is
scatter-added into the accumulator, and a mark per row (an ``[N]`` optimizer variable) records
the rows any micro-step of the window listed (a dense gradient marks every row); the update
step's gradient is the ``IndexedSlices`` of the marked rows' sums plus its own slices (the
optimizer sums repeated rows), divided by ``steps``, and the reset zeroes the marked rows only
(all rows, by one assign, where at least half are marked).
Keras' dense accumulation is kept under a tf.distribute strategy of several replicas and in an
XLA-compiled step: XLA pads a tensor of run-time size (the marked rows) and a tf.unique of it, in
the optimizer's step, read the padding as row 0 and listed rows twice. An XLA step still marks its
rows, for a step outside XLA that ends the window.
"""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf

from pkm_serve import _copy_on_write, _no_rows, _xla

_MARKS = "_pkm_accumulated_row_marks"
# optimizer -> the iteration count its next step starts from (not saved): any other count means its
# state was restored (or it is the first step), and a tf.train.Checkpoint saved without marks
# restores the accumulators, not the marks.
_next_iteration = weakref.WeakKeyDictionary()
# optimizer -> what the last tf.train.Checkpoint restore since its last step brought (not saved):
# its iteration count alone (_COUNT_RESTORED: a checkpoint without marks, whose accumulators replace
# the window) or its marks too (_MARKS_RESTORED). Seen by a hook on those variables' restore (the
# iteration count alone missed a restore that brought back the count the last step left); one
# restore brings the count before the marks, which sit deeper in the optimizer's object graph.
_restored = weakref.WeakKeyDictionary()
_COUNT_RESTORED, _MARKS_RESTORED = 1, 2


def build_marks(optimizer, var_list):
    """One row-mark variable per variable of rank >= 1 (None for scalars), next to Keras'
    accumulators; nothing without gradient accumulation."""
    if not optimizer.gradient_accumulation_steps:
        return
    marks = []
    for var in var_list:
        if len(var.shape) == 0:
            marks.append(None)
            continue
        colocate = var.value if isinstance(var, keras.Variable) else var
        with optimizer._distribution_strategy.extended.colocate_vars_with(colocate):
            marks.append(optimizer.add_variable(
                shape=(var.shape[0],), dtype="float32",
                name=f"{getattr(var, 'path', var.name).replace('/', '_').replace(':', '_')}_accumulated_rows"))
    setattr(optimizer, _MARKS, marks)
    with tf.init_scope():
        _next_iteration[optimizer] = tf.Variable(-1, dtype=tf.int64, trainable=False, name="pkm_next_iteration")
        _restored[optimizer] = tf.Variable(0, dtype=tf.int32, trainable=False, name="pkm_restored")
    optimizer._pkm_step_records = _SavedModelOnly(_next_iteration[optimizer], _restored[optimizer])
    _on_restore(optimizer._iterations, _restored[optimizer], _COUNT_RESTORED)
    for row_marks in marks:
        if row_marks is not None:
            _on_restore(row_marks, _restored[optimizer], _MARKS_RESTORED)



class _SavedModelOnly(tf.Module):
    """Tracks the step records for a SavedModel alone: a tf.function stepping the optimizer (a
    training signature) captures them, and tf.saved_model.save refused it ('references an
    untracked resource'). A tf.train.Checkpoint leaves them out: a restored flag would overwrite
    the one the restore's hooks set."""

    def __init__(self, *variables):
        super().__init__(name="pkm_step_records")
        self.variables_for_saved_model = list(variables)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        if save_type != "savedmodel":
            return {}
        return super()._trackable_children(save_type, **kwargs)


def _on_restore(variable, restored, kind):
    """Records `kind` in `restored` at each tf.train.Checkpoint restore of Keras variable
    `variable`, after the restore itself: a later restore's kind replaces an earlier one's (a
    checkpoint without marks restored after one with them: the first's marks stood beside the
    second's accumulators)."""
    restore = variable._restore_from_tensors

    def recorded_restore(restored_tensors):
        done = restore(restored_tensors)
        with tf.control_dependencies([done] if isinstance(done, (tf.Operation, tf.Tensor)) else []):
            restored.assign(kind)
        return done

    variable._restore_from_tensors = recorded_restore


def _rows_with_a_sum(accumulator):
    summed = tf.reshape(_tf(accumulator), [accumulator.shape[0], -1])
    return tf.reduce_any(tf.not_equal(summed, 0), axis=1)


def _complete_marks(optimizer):
    """Marks the rows of every accumulator whose sum is not 0 (one dense read) where the state was
    restored since the last step: the accumulators of a checkpoint saved without marks (an earlier
    pkm_serve, Keras' Adam) restore with the marks left as they were, and its rows were left out of
    the window's step and its reset. After a tf.train.Checkpoint restore that brought the
    iteration count but no marks, the marks are those rows alone (rows marked before it, in the
    window it replaced, were stepped with a zero gradient); after one that brought the marks, they
    stand; else, where the iteration count is not the one the last step left (the first step, a
    restore before build or by other means), those rows are added to the marks."""

    def mark_rows(keep):
        for accumulator, marks in zip(optimizer._accumulated_gradients, getattr(optimizer, _MARKS)):
            if marks is not None:
                rows = tf.cast(_rows_with_a_sum(accumulator), marks.dtype)
                _tf(marks).assign(tf.maximum(_tf(marks), rows) if keep else rows)
        return tf.constant(True)

    restored = _restored[optimizer].read_value()
    moved = tf.not_equal(tf.cast(_tf(optimizer._iterations), tf.int64), _next_iteration[optimizer])
    done = tf.case([(tf.equal(restored, _MARKS_RESTORED), lambda: tf.constant(True)),
                    (tf.equal(restored, _COUNT_RESTORED), lambda: mark_rows(keep=False)),
                    (moved, lambda: mark_rows(keep=True))], default=lambda: tf.constant(True), exclusive=False)
    with tf.control_dependencies([done]):
        return _restored[optimizer].assign(0, read_value=False)


def _step_done(optimizer):
    _next_iteration[optimizer].assign(tf.cast(_tf(optimizer._iterations), tf.int64) + 1)


def _keras_accumulation_here():
    return tf.distribute.get_strategy().num_replicas_in_sync > 1 or _xla.compile_device_type() is not None


def _kept_marks(optimizer, accumulator):
    """The row marks of Keras accumulator `accumulator`, kept up to date on one replica (in an
    XLA-compiled step too: a later step outside XLA reads them), else None."""
    marks = getattr(optimizer, _MARKS, None)
    if marks is None or tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return None
    for index, known in enumerate(optimizer._accumulated_gradients):
        if known is accumulator:
            return marks[index]
    return None


def _marks_of(optimizer, accumulator):
    """The row marks of Keras accumulator `accumulator`, None where Keras' own accumulation is kept."""
    return None if _keras_accumulation_here() else _kept_marks(optimizer, accumulator)


def _tf(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _scatter(variable, method, slices):
    """`variable.<method>(slices)`, the variable left in copy-on-write mode: a dense read of an
    accumulator a scatter left in copy-on-read mode (Keras' `acc + g` of a dense gradient) copied it."""
    variable = _tf(variable)
    getattr(variable, method)(slices)
    _copy_on_write.leave_copy_on_write(variable)


def _marked_rows(marks, dtype):
    return tf.cast(tf.where(_tf(marks) > 0)[:, 0], dtype)


class RowSparseGradient(tf.IndexedSlices):
    """What LazyAdam / RowwiseAdagrad hand Keras' ``apply`` for an ``IndexedSlices``: ``/ scale``
    (``loss_scale_factor``, the accumulation's mean) divides the values, where a plain one raised
    TypeError; ``+ accumulator`` (Keras' update step) gives the marked rows' sums and these slices
    as an ``IndexedSlices``, where Keras made it dense."""

    def __init__(self, values, indices, dense_shape, optimizer):
        super().__init__(values, indices, dense_shape)
        self._optimizer = optimizer

    def __truediv__(self, scale):
        return RowSparseGradient(self.values / scale, self.indices, self.dense_shape, self._optimizer)

    def __add__(self, accumulator):
        marks = _marks_of(self._optimizer, accumulator)
        if marks is None:
            return NotImplemented  # Keras' dense sum (the accumulator's __radd__)
        with tf.control_dependencies([_complete_marks(self._optimizer)]):
            rows = _marked_rows(marks, self.indices.dtype)
        summed = tf.gather(_tf(accumulator), rows)
        values = tf.concat([summed, tf.cast(self.values, summed.dtype)], 0)
        return RowSparseGradient(values, tf.concat([rows, self.indices], 0), self.dense_shape, self._optimizer)


def increment(optimizer, grads, accumulators, keras_increment):
    """Adds `grads` to their accumulators: IndexedSlices by scatter-add and their rows marked,
    dense ones by `keras_increment` (Keras' own) with every row marked."""
    keras_grads, keras_accumulators = [], []
    kept = getattr(optimizer, _MARKS, None) is not None and tf.distribute.get_strategy().num_replicas_in_sync == 1
    if kept:
        _complete_marks(optimizer)  # before this step's marks: a restore's rows would stay unmarked
    for grad, accumulator in zip(grads, accumulators):
        marks = _kept_marks(optimizer, accumulator)
        sparse = isinstance(grad, tf.IndexedSlices)
        if sparse and _marks_of(optimizer, accumulator) is not None:
            indices, values = _no_rows.drop_markers(grad)
            _scatter(accumulator, "scatter_add", tf.IndexedSlices(tf.cast(values, accumulator.dtype), indices))
        else:
            keras_grads.append(_cast(grad, accumulator.dtype))  # a half variable's accumulator is float32
            keras_accumulators.append(accumulator)
        if marks is not None and sparse:
            indices, _ = _no_rows.drop_markers(grad)
            _scatter(marks, "scatter_update", tf.IndexedSlices(tf.ones(tf.shape(indices), marks.dtype), indices))
        elif marks is not None:
            _tf(marks).assign(tf.ones(marks.shape, marks.dtype))
    if keras_grads:
        keras_increment(keras_grads, keras_accumulators)
    if kept:
        _step_done(optimizer)


def _cast(grad, dtype):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(grad.values, dtype), grad.indices, grad.dense_shape)
    return tf.cast(grad, dtype)


def reset(optimizer, keras_reset):
    """Zeroes the accumulators: the marked rows and their marks where there are marks, else
    by `keras_reset` (Keras' own, all accumulators)."""
    marks = getattr(optimizer, _MARKS, None)
    if marks is None:
        return keras_reset()
    if _keras_accumulation_here():
        keras_reset()
        for row_marks in marks:
            if row_marks is not None:
                row_marks.assign(tf.zeros(row_marks.shape, row_marks.dtype))
        if tf.distribute.get_strategy().num_replicas_in_sync == 1:
            _step_done(optimizer)
        return None
    with tf.control_dependencies([_complete_marks(optimizer)]):
        for accumulator, row_marks in zip(optimizer._accumulated_gradients, marks):
            if row_marks is None:
                accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
                continue
            _zero_rows(accumulator, _marked_rows(row_marks, tf.int64))
            _tf(row_marks).assign(tf.zeros(row_marks.shape, row_marks.dtype))
    _step_done(optimizer)


def _zero_rows(accumulator, rows):
    """Zeroes `rows` of `accumulator`, all of it where they are at least half its rows (a dense
    gradient marks every row): scattering zeros into every row took 14x Keras' dense assign. The
    rows left out hold 0 already (only marked rows are ever added to)."""

    def scatter_zeros():
        zeros = tf.zeros(tf.concat([tf.shape(rows), tf.shape(_tf(accumulator))[1:]], 0), accumulator.dtype)
        _scatter(accumulator, "scatter_update", tf.IndexedSlices(zeros, rows))
        return tf.constant(True)

    def assign_zeros():
        _tf(accumulator).assign(tf.zeros(accumulator.shape, accumulator.dtype))
        return tf.constant(True)

    most = tf.size(rows, out_type=tf.int64) * 2 >= accumulator.shape[0]
    tf.cond(most, assign_zeros, scatter_zeros)


def load_without_marks(optimizer, store, keras_load, inner=None):
    """Loads a store saved before the row marks existed (every optimizer variable but the marks,
    which come last): Keras skipped the whole optimizer state then, with a warning. The marks
    are rebuilt as the rows whose accumulated sum is not 0. `optimizer` may be a
    LossScaleOptimizer around `inner`, whose store holds its own variables and then `inner`'s."""
    inner = optimizer if inner is None else inner
    marks = [m for m in getattr(inner, _MARKS, None) or [] if m is not None]
    if not marks or len(store.keys()) != len(optimizer.variables) - len(marks):
        return keras_load(store)
    for index, variable in enumerate(v for v in optimizer.variables if not any(v is m for m in marks)):
        variable.assign(store[str(index)])
    for accumulator, row_marks in zip(inner._accumulated_gradients, getattr(inner, _MARKS)):
        if row_marks is not None:
            row_marks.assign(tf.cast(_rows_with_a_sum(accumulator), row_marks.dtype))
    return None
