"""LazyAdam / RowwiseAdagrad inside Keras' LossScaleOptimizer (what mixed_float16 adds): its
finiteness check reads an IndexedSlices' values only. Keras' check scattered each slice's verdict
into a dense [N, D] bool tensor: a 2**20 x 64 table's step took 20x as long, and a row repeated in
the slices (a table looked up twice) kept one slice's verdict, so an inf in the other one passed
the check and the step wrote NaN into the table instead of being skipped."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D, SCALE = 4096, 8, 64.0
ROWS = np.array([3, 9, 9, 4000])
OPTIMIZERS = {"lazy_adam": lambda: LazyAdam(0.1), "rowwise_adagrad": lambda: RowwiseAdagrad(0.1)}


def _variables():
    table = keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")
    return table, keras.Variable(np.ones(D, np.float32), name="bias")


def _step_function(optimizer, table, bias):
    @tf.function
    def step(values, bias_grad):
        table_grad = tf.IndexedSlices(values, tf.constant(ROWS), tf.constant([N, D]))
        optimizer.apply_gradients([(table_grad, table), (bias_grad, bias)])
    return step


@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_the_finiteness_check_builds_no_table_sized_tensor(make):
    table, bias = _variables()
    wrapper = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[make](), initial_scale=SCALE)
    wrapper.build([table, bias])
    graph = _step_function(wrapper, table, bias).get_concrete_function(
        tf.TensorSpec([len(ROWS), D]), tf.TensorSpec([D])).graph
    table_sized = [op.name for op in graph.get_operations() for out in op.outputs
                   if out.dtype == tf.bool and out.shape.num_elements() == N * D]
    assert table_sized == []


@pytest.mark.parametrize("make", sorted(OPTIMIZERS))
def test_the_wrapped_step_is_the_unscaled_step_and_a_non_finite_one_is_skipped(make):
    rng = np.random.default_rng(4)
    values, bias_grad = rng.standard_normal((len(ROWS), D)).astype(np.float32), np.ones(D, np.float32)
    plain_table, plain_bias = _variables()
    _step_function(OPTIMIZERS[make](), plain_table, plain_bias)(values, bias_grad)
    table, bias = _variables()
    wrapper = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[make](), initial_scale=SCALE)
    step = _step_function(wrapper, table, bias)
    step(values * SCALE, bias_grad * SCALE)
    np.testing.assert_allclose(table.numpy(), plain_table.numpy(), rtol=1e-6, atol=1e-7)
    slots = [v.numpy() for v in wrapper.inner_optimizer.variables]
    after_first = table.numpy()
    values[1, 2] = np.inf  # in the first of row 9's two slices: the whole step is skipped
    step(values * SCALE, bias_grad * SCALE)
    np.testing.assert_array_equal(table.numpy(), after_first)
    for before, now in zip(slots, wrapper.inner_optimizer.variables):
        np.testing.assert_array_equal(now.numpy(), before)
    assert float(wrapper.dynamic_scale.numpy()) == SCALE / 2
