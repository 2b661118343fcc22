"""LazyAdam / RowwiseAdagrad with clipping in an XLA-compiled train step, a row repeated in the step.

The clipping sums repeated rows (tests/layers/test_lifecycle_round34_clipping.py); a second
tf.unique, in the row-wise step, of the first one's run-time-sized rows read XLA's padding, and a
repeated row was scattered twice, the second time from a zero gradient: it did not train under
jit_compile=True. The reference is the same step run eagerly."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad

IDS = np.array([1, 2, 2, 3, 5, 2, 1], np.int32)  # rows 1 and 2 repeated
OPTIMIZERS = {"lazy_adam": lambda clipping: LazyAdam(0.01, **clipping),
              "rowwise_adagrad": lambda clipping: RowwiseAdagrad(0.1, **clipping)}
CLIPPING = [{"clipnorm": 1.0}, {"global_clipnorm": 1.0}, {"clipvalue": 0.5}]


def _train(make_optimizer, jit_compile, steps=2):
    table = keras.Variable(np.arange(40, dtype=np.float32).reshape(10, 4) / 10)
    bias = keras.Variable(np.zeros(4, np.float32))
    optimizer = make_optimizer()
    optimizer.build([table, bias])

    @tf.function(jit_compile=jit_compile)
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.gather(table.value, ids) + bias.value))
        optimizer.apply(tape.gradient(loss, [table.value, bias.value]), [table, bias])

    for _ in range(steps):
        step(tf.constant(IDS))
    return table.numpy(), bias.numpy()


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_clipped_step_under_xla_trains_repeated_rows_as_the_eager_step(optimizer, clipping):
    make = lambda: OPTIMIZERS[optimizer](clipping)  # noqa: E731
    eager_table, eager_bias = _train(make, jit_compile=False)
    jit_table, jit_bias = _train(make, jit_compile=True)
    start = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    assert not np.allclose(eager_table[2], start[2])  # the repeated row trains eagerly
    np.testing.assert_array_equal(eager_table[[0, 4, 6, 7, 8, 9]], start[[0, 4, 6, 7, 8, 9]])
    np.testing.assert_allclose(jit_table, eager_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jit_bias, eager_bias, rtol=1e-5, atol=1e-6)
