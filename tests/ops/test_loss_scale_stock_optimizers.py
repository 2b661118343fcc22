"""Stock Keras optimizers (Adam, SGD) in a LossScaleOptimizer (what mixed_float16 adds) given the
row-sparse gradient of a table looked up twice: a step whose gradient holds an inf is skipped.
Keras' check scattered each slice's verdict into a dense [N, D] bool tensor, where row 9, listed
by both lookups, kept one slice's verdict: an inf in the other passed, and the step wrote inf /
NaN into the table (pkm_serve/_loss_scale_check.py)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import ops  # noqa: E402

N, D, SCALE, LR = 16, 2, 4.0, 0.1
FIRST, SECOND = [[9]], [[9, 4]]  # row 9 in both lookups' slices
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(LR), "sgd": lambda: keras.optimizers.SGD(LR)}


def _train_step(optimizer, table):
    @tf.function
    def step(first_scale, second_scale):
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(ops.embedding_bag(table, tf.constant(FIRST), sparse_gradient=True) * first_scale)
                    + tf.reduce_sum(ops.embedding_bag(table, tf.constant(SECOND), sparse_gradient=True)
                                    * second_scale))
            scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        optimizer.apply_gradients([(tape.gradient(scaled, table), table)])
    return step


def _table():
    return keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")


@pytest.mark.parametrize("inf_in", ["first", "second"])
@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_a_non_finite_row_sparse_gradient_skips_the_step(make, inf_in):
    scales = np.ones((2, 1, D), np.float32)
    plain_table = _table()
    _train_step(OPTIMIZERS[make](), plain_table)(scales[0], scales[1])
    table = _table()
    wrapper = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[make](), initial_scale=SCALE)
    step = _train_step(wrapper, table)
    step(scales[0], scales[1])  # finite: the unscaled step
    np.testing.assert_allclose(table.numpy(), plain_table.numpy(), rtol=1e-6, atol=1e-7)
    if make == "sgd":  # rows 9 (both lookups) and 4 (the second) against float64 SGD
        want = np.linspace(-1, 1, N * D).reshape(N, D)
        want[9] -= 2 * LR
        want[4] -= LR
        np.testing.assert_allclose(table.numpy(), want, rtol=1e-6, atol=1e-7)
    before = table.numpy()
    scales[0 if inf_in == "first" else 1, 0, 1] = np.inf
    step(scales[0], scales[1])
    np.testing.assert_array_equal(table.numpy(), before)
    assert float(wrapper.dynamic_scale.numpy()) == SCALE / 2


def test_dense_gradients_keep_keras_check():
    table = keras.Variable(np.zeros((N, D), np.float32))
    wrapper = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=SCALE)
    ops.embedding_bag(table, tf.constant(FIRST), sparse_gradient=True)  # installs the check
    wrapper.apply_gradients([(tf.fill([N, D], np.float32(np.nan)), table)])
    np.testing.assert_array_equal(table.numpy(), 0)
    assert float(wrapper.dynamic_scale.numpy()) == SCALE / 2
