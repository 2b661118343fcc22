"""A tf.train.Checkpoint without row marks (Keras' Adam, pkm_serve before round 35), restored into
a LazyAdam mid-window whose iteration count is the checkpoint's: the window's step covers the
checkpoint's accumulated rows and no row this process marked before the restore. The restore was
seen only by a changed iteration count: the checkpoint's rows were left out of the step (and their
sums left in the accumulator), and a row marked before the restore took a step of zero gradient,
moving by its restored moments."""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam  # noqa: E402

N, D, STEPS, LR = 6, 2, 2, 0.1


def _micro_step(optimizer, table, rows, value=1.0):
    rows = tf.convert_to_tensor(rows, tf.int64)
    grad = tf.IndexedSlices(tf.fill([tf.size(rows), D], value), rows, tf.constant([N, D]))
    optimizer.apply_gradients([(grad, table)])


def _table():
    return keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")


SAVERS = {"keras_adam": keras.optimizers.Adam, "lazy_adam": LazyAdam}  # without / with row marks


def _saved_mid_window(tmp_path, saver):
    """A window on row 4 (its moments become non-zero), then one micro-step on row 1."""
    table = _table()
    old = SAVERS[saver](LR, gradient_accumulation_steps=STEPS)
    old.build([table])
    for _ in range(STEPS):
        _micro_step(old, table, [4], 2.0)
    _micro_step(old, table, [1], 3.0)
    state = {"table": table.numpy(), "m": old._momentums[0].numpy(), "v": old._velocities[0].numpy(),
             "acc": old._accumulated_gradients[0].numpy(), "count": int(old._iterations.numpy())}
    return tf.train.Checkpoint(optimizer=old).save(str(tmp_path / "ckpt")), state


def _reference_window_end(state, last_rows, last_value):
    """float64 LazyAdam step on the window's mean gradient (the restored sums and the last
    micro-step), on the rows with a sum only."""
    w, m, v = (state[k].astype(np.float64) for k in ("table", "m", "v"))
    g = state["acc"].astype(np.float64)
    g[last_rows] += last_value
    g /= STEPS
    rows = np.flatnonzero(np.any(g != 0, axis=1))
    t = state["count"] // STEPS + 1
    b1, b2, lr, eps = (float(np.float32(x)) for x in (0.9, 0.999, LR, 1e-7))
    m[rows] += (g[rows] - m[rows]) * (1 - b1)
    v[rows] += (g[rows] ** 2 - v[rows]) * (1 - b2)
    w[rows] -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[rows] / (np.sqrt(v[rows]) + eps)
    return w, m


@pytest.mark.parametrize("saver", sorted(SAVERS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_restore_that_brings_back_the_same_count_mid_window(tmp_path, compiled, saver):
    path, state = _saved_mid_window(tmp_path, saver)
    table = _table()
    optimizer = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    step = lambda rows: _micro_step(optimizer, table, tf.constant(rows, tf.int64))  # noqa: E731
    step = tf.function(step) if compiled else step
    for rows in ([2], [2], [4]):  # a window, then row 4 marked in the next one
        step(rows)
    assert int(optimizer._iterations.numpy()) == state["count"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras Adam's checkpoint has no marks (expect_partial)
        tf.train.Checkpoint(optimizer=optimizer).restore(path).expect_partial()
    np.testing.assert_array_equal(table.numpy(), state["table"])  # the optimizer's checkpoint holds it
    step([5])  # ends the window
    want_table, want_m = _reference_window_end(state, [5], 1.0)
    np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(optimizer._momentums[0].numpy(), want_m, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(optimizer._accumulated_gradients[0].numpy(), 0)


def test_a_checkpoint_without_marks_restored_after_one_with_them(tmp_path):
    """The second restore decides: its accumulators stood beside the first one's marks (row 3,
    marked in the first checkpoint's window and never touched in the second's, took a step)."""
    table = _table()
    other = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    other.build([table])
    for rows in ([0], [0], [3]):
        _micro_step(other, table, rows)
    with_marks = tf.train.Checkpoint(optimizer=other).save(str(tmp_path / "with_marks" / "ckpt"))
    without_marks, state = _saved_mid_window(tmp_path, "keras_adam")
    table = _table()
    optimizer = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    for rows in ([2], [2], [4]):
        _micro_step(optimizer, table, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in (with_marks, without_marks):
            tf.train.Checkpoint(optimizer=optimizer).restore(path).expect_partial()
    _micro_step(optimizer, table, [5])
    want_table, want_m = _reference_window_end(state, [5], 1.0)
    np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(optimizer._momentums[0].numpy(), want_m, rtol=1e-5, atol=1e-7)
