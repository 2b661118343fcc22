"""LazyAdam and RowwiseAdagrad on bfloat16 / float16 variables (a pure half policy's table) follow a
float64 reference to the variable's precision: their state is float32 and the update is computed in
float32. In bfloat16, beta_2 = 0.999 rounded to 1, sqrt(1 - beta_2**t) was 0 and LazyAdam (as
Keras' Adam) never moved the table; a bfloat16 accumulator stopped growing."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402  (TensorFlow's dependency)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D, STEPS, LR = 12, 4, 5, 0.1
ROWS = np.array([1, 5, 5, 2, 9])
NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _setup(dtype):
    rng = np.random.default_rng(3)
    init = rng.uniform(-1, 1, (N, D)).astype(NUMPY_DTYPES[dtype])  # exactly representable
    values = rng.uniform(-1, 1, (STEPS, len(ROWS), D)).astype(NUMPY_DTYPES[dtype])
    return init, values


def _gradient(values, sparse, dtype):
    slices = tf.IndexedSlices(tf.constant(values, dtype), tf.constant(ROWS), tf.constant([N, D]))
    return slices if sparse else tf.convert_to_tensor(slices)


def _adam_reference(init, values, sparse, b1=0.9, b2=0.999, eps=1e-7):
    """float64 LazyAdam; a dense gradient's repeated row summed in the variable's dtype, as TF's
    conversion of the slices does."""
    w, m, v = init.astype(np.float64), np.zeros((N, D)), np.zeros((N, D))
    lr, b1, b2, eps = (float(np.float32(x)) for x in (LR, b1, b2, eps))
    touched = np.unique(ROWS)
    for t in range(1, STEPS + 1):
        g = np.zeros((N, D))
        np.add.at(g, ROWS, values[t - 1].astype(np.float64))
        g = g if sparse else g.astype(values.dtype).astype(np.float64)
        m[touched] += (g[touched] - m[touched]) * (1 - b1)
        v[touched] += (g[touched] ** 2 - v[touched]) * (1 - b2)
        w[touched] -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[touched] / (np.sqrt(v[touched]) + eps)
    return w, m, v


def _tolerance(dtype):
    # one rounding to the variable's precision per step (half an ulp: eps / 2 below 2 in size), twice
    return STEPS * float(ml_dtypes.finfo(NUMPY_DTYPES[dtype]).eps)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_lazy_adam_on_a_half_variable_follows_the_float64_reference(dtype, sparse):
    init, values = _setup(dtype)
    table = keras.Variable(init, dtype=dtype)
    optimizer = LazyAdam(LR)
    for step_values in values:
        optimizer.apply_gradients([(_gradient(step_values, sparse, dtype), table)])
    want, m, v = _adam_reference(init, values, sparse)
    assert table.dtype == dtype
    assert optimizer._momentums[0].dtype == optimizer._velocities[0].dtype == "float32"
    np.testing.assert_allclose(table.numpy().astype(np.float64), want, rtol=0, atol=_tolerance(dtype))
    assert np.abs(want - init.astype(np.float64)).max() > 4 * _tolerance(dtype)  # the steps moved it
    np.testing.assert_allclose(optimizer._momentums[0].numpy(), m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(optimizer._velocities[0].numpy(), v, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_rowwise_adagrad_keeps_a_float32_accumulator_for_a_bfloat16_table(sparse):
    init = np.full((N, D), 0.5, ml_dtypes.bfloat16)
    table = keras.Variable(init, dtype="bfloat16")
    optimizer = RowwiseAdagrad(1e-3, initial_accumulator_value=1.0)
    steps, ones = 600, np.ones((len(ROWS), D), ml_dtypes.bfloat16)
    step = tf.function(lambda: optimizer.apply_gradients([(_gradient(ones, sparse, "bfloat16"), table)]))
    for _ in range(steps):
        step()
    # row 5 is listed twice: gradient 2 per step, accumulator 1 + 4 * steps; bfloat16 stopped at 1024
    accumulator = optimizer._accumulators[0]
    assert accumulator.dtype == "float32"
    want = {1: 1.0 + steps, 5: 1.0 + 4.0 * steps, 0: 1.0}
    np.testing.assert_allclose(accumulator.numpy()[list(want)], list(want.values()), rtol=1e-6)
