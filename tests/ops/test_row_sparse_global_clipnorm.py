"""LazyAdam / RowwiseAdagrad with `global_clipnorm`: one factor, min(1, clipnorm / global norm),
from every gradient (a row-sparse one's repeated rows summed, as its dense gradient), applied to
the row-sparse gradient's values. Before, Keras' scaling made the table gradient dense, so
LazyAdam took dense Adam steps: rows no step touched moved as their moments decayed."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402
from tests.row_optimizer_reference import apply_rows  # noqa: E402

N, D, CLIP = 10, 4, 0.5
LR, BETA_1, BETA_2, EPS = 0.1, 0.9, 0.999, 1e-7
# Each step touches other rows (a row twice in two of them); rows 6.. are never touched.
STEP_ROWS = [[0, 1, 1], [2, 3], [4, 5, 4]]


def _steps():
    rng = np.random.default_rng(5)
    return [(np.array(rows), rng.standard_normal((len(rows), D)) * 3, rng.standard_normal(D))
            for rows in STEP_ROWS]


def _clipped(rows, values, bias_grad):
    """(touched rows, their summed gradient rows, bias gradient) scaled as Keras documents
    global_clipnorm: every gradient times min(1, CLIP / norm of all gradients together)."""
    dense = np.zeros((N, D))
    np.add.at(dense, rows, values)
    norm = np.sqrt(np.sum(dense ** 2) + np.sum(bias_grad ** 2))
    scale = min(1.0, CLIP / norm)
    touched = np.unique(rows)
    return touched, dense[touched] * scale, bias_grad * scale


def _run(optimizer, spy=None):
    table = keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")
    bias = keras.Variable(np.ones(D, np.float32), name="bias")
    optimizer.build([table, bias])
    if spy is not None:
        update = optimizer._update_step
        optimizer._update_step = lambda g, v, lr: (spy.append(type(g)), update(g, v, lr))[1]
    for rows, values, bias_grad in _steps():
        table_grad = tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant(rows), tf.constant([N, D]))
        optimizer.apply_gradients([(table_grad, table), (tf.constant(bias_grad, tf.float32), bias)])
    return table, bias


def test_lazy_adam_global_clipnorm_steps_touched_rows_only():
    optimizer = LazyAdam(LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPS, global_clipnorm=CLIP)
    table, bias = _run(optimizer)
    w = np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32).astype(np.float64)
    m, v = np.zeros((N, D)), np.zeros((N, D))
    b, bm, bv = np.ones(D), np.zeros(D), np.zeros(D)
    for step, (rows, values, bias_grad) in enumerate(_steps(), start=1):
        touched, g, bg = _clipped(rows, values, bias_grad)
        hyper = dict(lr=LR, epsilon=EPS, beta_1=BETA_1, beta_2=BETA_2, step=step)
        w, (m, v) = apply_rows("adam", w, g, touched, (m, v), **hyper)
        b, (bm, bv) = apply_rows("adam", b, bg, slice(None), (bm, bv), **hyper)
    np.testing.assert_allclose(table.numpy(), w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(optimizer._momentums[0].numpy(), m, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(optimizer._velocities[0].numpy(), v, rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(bias.numpy(), b, rtol=2e-5, atol=2e-6)
    never = np.arange(6, N)
    np.testing.assert_array_equal(optimizer._momentums[0].numpy()[never], 0)


def test_rowwise_adagrad_global_clipnorm_keeps_the_gradient_row_sparse():
    seen = []
    table, _ = _run(RowwiseAdagrad(LR, initial_accumulator_value=0.1, epsilon=EPS, global_clipnorm=CLIP), seen)
    w = np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32).astype(np.float64)
    acc = np.full(N, 0.1)
    for rows, values, bias_grad in _steps():
        touched, g, _ = _clipped(rows, values, bias_grad)
        acc[touched] += np.mean(g * g, axis=1)
        w[touched] -= LR * g / np.sqrt(acc[touched] + EPS)[:, None]
    np.testing.assert_allclose(table.numpy(), w, rtol=2e-5, atol=2e-6)
    assert seen[::2] == [tf.IndexedSlices] * len(STEP_ROWS)  # the table's gradient, each step


@pytest.mark.parametrize("norm", [np.inf, np.nan])
def test_a_non_finite_global_norm_gives_nan_as_keras(norm):
    # Keras' global_clipnorm makes every gradient NaN then; the touched rows take it.
    table = keras.Variable(np.zeros((N, D), np.float32))
    LazyAdam(LR, global_clipnorm=CLIP).apply_gradients(
        [(tf.IndexedSlices(tf.constant([[norm] * D]), tf.constant([2]), tf.constant([N, D])), table)])
    assert np.isnan(table.numpy()[2]).all()
    np.testing.assert_array_equal(np.delete(table.numpy(), 2, axis=0), 0)
