"""A tf.train.Checkpoint saved mid-window by an optimizer without row marks (pkm_serve before
round 35, or Keras' Adam, whose variables LazyAdam's were) restores into LazyAdam: the window's
rows already summed in the accumulator are stepped when the window ends, and zeroed after. The
marks came back all 0 before: those rows were left out of the step, and their sums stayed in the
accumulator, to be added to a later window that touched them."""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam  # noqa: E402

N, D, STEPS, LR = 6, 2, 2, 0.1
WINDOW = [([1, 3, 1], [[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]]), ([5], [[-2.0, 1.0]])]


def _micro_step(optimizer, table, step):
    rows, values = WINDOW[step]
    grad = tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant(rows), tf.constant([N, D]))
    optimizer.apply_gradients([(grad, table)])


def _table():
    return keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")


def _reference_after_window():
    """float64 LazyAdam step (step 1) on the window's mean gradient, touched rows only."""
    dense = np.zeros((N, D))
    for rows, values in WINDOW:
        np.add.at(dense, rows, np.array(values))
    touched = np.unique(np.concatenate([rows for rows, _ in WINDOW]))
    g = dense[touched] / STEPS
    m, v = 0.1 * g, 0.001 * g * g
    w = np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32).astype(np.float64)
    w[touched] -= LR * np.sqrt(1 - 0.999) / (1 - 0.9) * m / (np.sqrt(v) + 1e-7)
    return w


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("before_restore", ["built", "trained", "deferred"])
def test_checkpoint_without_row_marks_restores_mid_window(tmp_path, before_restore, compiled):
    table = _table()
    old = keras.optimizers.Adam(LR, gradient_accumulation_steps=STEPS)  # LazyAdam's variables before the marks
    old.build([table])
    _micro_step(old, table, 0)
    path = tf.train.Checkpoint(optimizer=old).save(str(tmp_path / "ckpt"))

    table = _table()
    optimizer = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    if before_restore != "deferred":
        optimizer.build([table])
    if before_restore == "trained":  # a window ended before the restore, in this process
        _micro_step(optimizer, table, 1)
        _micro_step(optimizer, table, 1)
        table.assign(_table())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the marks are not in the checkpoint (expect_partial)
        tf.train.Checkpoint(optimizer=optimizer).restore(path).expect_partial()
    if before_restore == "deferred":
        optimizer.build([table])
    np.testing.assert_array_equal(optimizer.iterations.numpy(), 0)
    step = lambda: _micro_step(optimizer, table, 1)  # noqa: E731
    tf.function(step)() if compiled else step()
    np.testing.assert_allclose(table.numpy(), _reference_after_window(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(optimizer._accumulated_gradients[0].numpy(), 0)
