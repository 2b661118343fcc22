"""Keras' optimizer options on a bfloat16 table with LazyAdam / RowwiseAdagrad: nothing is rounded to
bfloat16 before the one rounding of the table's new value (pkm_serve/_half_variables.py). Keras made
the gradient accumulators and EMA copies bfloat16 (an accumulator plus a gradient under 1/256 of it
stayed as it was; an EMA copy stopped short of the table) and applied weight decay as its own
bfloat16 assignment (a decay under half the table's precision never moved it, even where the step
with it would have)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402  (TensorFlow's dependency)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

BF16 = ml_dtypes.bfloat16
N, D = 6, 8
ROWS = np.array([1, 3, 4])
UNTOUCHED = np.array([0, 2, 5])


def _gradient(values, sparse):
    slices = tf.IndexedSlices(tf.constant(values, tf.bfloat16), tf.constant(ROWS), tf.constant([N, D]))
    return slices if sparse else tf.convert_to_tensor(slices)


def _bf16(x):
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


def _adagrad_rows(acc, g, lr, eps=1e-7):
    """float64 RowwiseAdagrad on ROWS: the new accumulator and the step of each row."""
    acc = acc.copy()
    acc[ROWS] += (g ** 2).mean(axis=1)
    return acc, lr * g / np.sqrt(acc[ROWS] + eps)[:, None]


def _adam_rows(m, v, g, lr, t, b1=0.9, b2=0.999, eps=1e-7):
    """float64 LazyAdam on ROWS: the new moments and the step of each row."""
    m, v = m.copy(), v.copy()
    m[ROWS] += (g - m[ROWS]) * (1 - b1)
    v[ROWS] += (g ** 2 - v[ROWS]) * (1 - b2)
    alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return m, v, alpha * m[ROWS] / (np.sqrt(v[ROWS]) + eps)


@pytest.mark.parametrize("optimizer_name,sparse", [("adagrad", True), ("adagrad", False), ("adam", True)])
def test_weight_decay_of_a_bfloat16_table_is_rounded_once_with_the_step(optimizer_name, sparse):
    steps, lr, wd = 30, 0.01, 0.1  # a decay of 1e-3 of the value: under half bfloat16's precision
    rng = np.random.default_rng(0)
    init = rng.uniform(0.5, 1.0, (N, D)).astype(BF16)
    values = rng.uniform(-1, 1, (steps, len(ROWS), D)).astype(BF16)
    table = keras.Variable(init, dtype="bfloat16")
    optimizer = (RowwiseAdagrad if optimizer_name == "adagrad" else LazyAdam)(lr, weight_decay=wd)
    want = init.astype(np.float64)
    acc, m, v = np.full(N, 0.1), np.zeros((N, D)), np.zeros((N, D))
    for t in range(1, steps + 1):
        optimizer.apply_gradients([(_gradient(values[t - 1], sparse), table)])
        g = values[t - 1].astype(np.float64)
        if optimizer_name == "adagrad":
            acc, step = _adagrad_rows(acc, g, lr)
        else:
            m, v, step = _adam_rows(m, v, g, lr, t)
        new = want * (1 - lr * wd)  # every row decays (Keras' weight decay is dense)
        new[ROWS] -= step
        want = _bf16(new)
    ulp = np.abs(want) * 2.0 ** -7
    np.testing.assert_array_less(np.abs(table.numpy().astype(np.float64) - want), ulp + 1e-12)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("optimizer_class", [RowwiseAdagrad, LazyAdam])
def test_gradient_accumulation_of_a_bfloat16_table_keeps_small_gradients(optimizer_class, sparse):
    # in bfloat16 the window's sum was 0.01 + 1 = 1.0078125, - 1, + 0.01: 0.0178 instead of 0.02
    window = [np.full((len(ROWS), D), x, BF16) for x in (0.01, 1.0, -1.0, 0.01)]
    table = keras.Variable(np.zeros((N, D), BF16), dtype="bfloat16")
    optimizer = optimizer_class(1.0, gradient_accumulation_steps=4)
    for values in window[:3]:
        optimizer.apply_gradients([(_gradient(values, sparse), table)])
    accumulator = optimizer._accumulated_gradients[0]
    sum_so_far = sum(w.astype(np.float64) for w in window[:3])
    np.testing.assert_allclose(accumulator.numpy()[ROWS], sum_so_far, rtol=1e-6)
    optimizer.apply_gradients([(_gradient(window[3], sparse), table)])
    mean = sum(w.astype(np.float64) for w in window) / 4
    if optimizer_class is RowwiseAdagrad:
        step = _adagrad_rows(np.full(N, 0.1), mean, 1.0)[1]
    else:
        step = _adam_rows(np.zeros((N, D)), np.zeros((N, D)), mean, 1.0, 1)[2]
    want = np.zeros((N, D))
    want[ROWS] = _bf16(-step)
    np.testing.assert_allclose(table.numpy().astype(np.float64), want, rtol=2.0 ** -7)  # one bfloat16 ulp


@pytest.mark.parametrize("optimizer_class", [RowwiseAdagrad, LazyAdam])
def test_ema_of_a_bfloat16_table_follows_the_table(optimizer_class):
    steps, momentum = 40, 0.99
    rng = np.random.default_rng(1)
    table = keras.Variable(rng.uniform(-1, 1, (N, D)).astype(BF16), dtype="bfloat16")
    optimizer = optimizer_class(0.05, use_ema=True, ema_momentum=momentum)
    average = None
    for t in range(steps):
        optimizer.apply_gradients([(_gradient(rng.uniform(-1, 1, (len(ROWS), D)), True), table)])
        value = table.numpy().astype(np.float64)
        average = value if average is None else momentum * average + (1 - momentum) * value
    ema = optimizer._model_variables_moving_average[0]
    np.testing.assert_allclose(ema.numpy(), average, rtol=1e-5, atol=1e-6)
    assert np.abs(average - table.numpy().astype(np.float64))[ROWS].max() > 0.05  # the average lags
    optimizer.finalize_variable_values([table])  # what fit() does at its end
    np.testing.assert_array_equal(table.numpy().astype(np.float64), _bf16(average.astype(np.float32)))
