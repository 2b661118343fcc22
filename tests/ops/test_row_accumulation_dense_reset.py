"""The reset at a window's end zeroes an accumulator whose rows are mostly marked (a dense
gradient marks all of them: every Dense kernel and bias) with one dense assign, as Keras does;
it scattered zeros into every row, 14x Keras' reset of an 8192 x 1024 accumulator. A window of
few rows still zeroes those rows only."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import _row_accumulation  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D = 64, 4


def _window(optimizer, variable, grads):
    for grad in grads:
        optimizer.apply_gradients([(grad, variable)])


@pytest.mark.parametrize("make", [LazyAdam, RowwiseAdagrad], ids=["lazy_adam", "rowwise_adagrad"])
def test_reset_of_a_dense_window_assigns_and_of_a_sparse_one_scatters(make, monkeypatch):
    scattered = []
    scatter = _row_accumulation._scatter
    monkeypatch.setattr(_row_accumulation, "_scatter",
                        lambda variable, method, slices: (scattered.append(variable.name), scatter(
                            variable, method, slices))[1])
    kernel = keras.Variable(np.ones((N, D), np.float32), name="kernel")
    optimizer = make(0.1, gradient_accumulation_steps=2)
    optimizer.build([kernel])
    accumulator = optimizer._accumulated_gradients[0]
    _window(optimizer, kernel, [tf.fill([N, D], 0.5), tf.fill([N, D], 0.25)])
    assert not any("accumulator" in name for name in scattered)
    np.testing.assert_array_equal(accumulator.numpy(), 0)

    scattered.clear()
    rows = tf.constant([3, 7])
    _window(optimizer, kernel, [tf.IndexedSlices(tf.ones((2, D)), rows, tf.constant([N, D]))] * 2)
    assert any("accumulator" in name for name in scattered)  # the increment's and the reset's
    np.testing.assert_array_equal(accumulator.numpy(), 0)
    np.testing.assert_array_equal(optimizer._pkm_accumulated_row_marks[0].numpy(), 0)
