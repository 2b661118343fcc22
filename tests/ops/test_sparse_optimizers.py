"""LazyAdam and RowwiseAdagrad: touched rows equal a float64 numpy reference
(and Keras' dense optimizers where the math coincides), untouched rows and
their slots are left bit-for-bit unchanged."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.layers import EmbeddingBag  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D = 40, 6


def sparse_steps(rng, steps=4):
    """IndexedSlices gradients with repeated indices (summed by the optimizer)."""
    out = []
    for _ in range(steps):
        rows = rng.integers(0, N // 2, size=9)  # rows >= N/2 are never touched
        out.append((rows, rng.standard_normal((9, D))))
    return out


def summed(rows, values):
    g = np.zeros((N, D))
    np.add.at(g, rows, values)
    return np.unique(rows), g


def test_lazy_adam_touched_rows_match_reference_untouched_unchanged():
    rng = np.random.default_rng(0)
    init = rng.standard_normal((N, D)).astype(np.float32)
    var = keras.Variable(init)
    opt = LazyAdam(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-6)
    w, m, v = init.astype(np.float64), np.zeros((N, D)), np.zeros((N, D))
    for t, (rows, vals) in enumerate(sparse_steps(rng), start=1):
        opt.apply_gradients([(tf.IndexedSlices(tf.constant(vals, tf.float32), tf.constant(rows)), var)])
        touched, g = summed(rows, vals)
        m[touched] = 0.8 * m[touched] + 0.2 * g[touched]
        v[touched] = 0.95 * v[touched] + 0.05 * g[touched] ** 2
        alpha = 0.05 * np.sqrt(1 - 0.95 ** t) / (1 - 0.8 ** t)
        w[touched] -= alpha * m[touched] / (np.sqrt(v[touched]) + 1e-6)
        np.testing.assert_allclose(var.numpy(), w, rtol=1e-5, atol=1e-6)
    never = np.arange(N // 2, N)
    np.testing.assert_array_equal(var.numpy()[never], init[never])
    np.testing.assert_array_equal(opt._momentums[0].numpy()[never], 0)
    np.testing.assert_array_equal(opt._velocities[0].numpy()[never], 0)
    np.testing.assert_allclose(opt._momentums[0].numpy(), m, rtol=1e-5, atol=1e-7)


def test_lazy_adam_first_step_equals_keras_adam_on_touched_rows_and_dense_is_adam():
    rng = np.random.default_rng(1)
    init = rng.standard_normal((N, D)).astype(np.float32)
    rows, vals = np.array([3, 7, 7, 11]), rng.standard_normal((4, D)).astype(np.float32)
    lazy, dense = keras.Variable(init), keras.Variable(init)
    LazyAdam(0.01).apply_gradients([(tf.IndexedSlices(vals, rows), lazy)])
    keras.optimizers.Adam(0.01).apply_gradients([(tf.convert_to_tensor(tf.IndexedSlices(vals, rows, [N, D])), dense)])
    np.testing.assert_allclose(lazy.numpy()[[3, 7, 11]], dense.numpy()[[3, 7, 11]], rtol=1e-5, atol=1e-7)
    # Dense gradients get Keras' Adam unchanged, over several steps.
    a, b = keras.Variable(init), keras.Variable(init)
    opt_a, opt_b = LazyAdam(0.01), keras.optimizers.Adam(0.01)
    for _ in range(3):
        g = tf.constant(rng.standard_normal((N, D)), tf.float32)
        opt_a.apply_gradients([(g, a)])
        opt_b.apply_gradients([(g, b)])
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("sparse", [True, False])
def test_rowwise_adagrad_matches_reference(sparse):
    rng = np.random.default_rng(2)
    init = rng.standard_normal((N, D)).astype(np.float32)
    bias_init = rng.standard_normal(D).astype(np.float32)
    var, bias = keras.Variable(init), keras.Variable(bias_init)
    opt = RowwiseAdagrad(learning_rate=0.1, initial_accumulator_value=0.1, epsilon=1e-7)
    w, acc = init.astype(np.float64), np.full(N, 0.1)
    b, b_acc = bias_init.astype(np.float64), np.full(D, 0.1)
    for rows, vals in sparse_steps(rng):
        touched, g = summed(rows, vals)
        g_bias = rng.standard_normal(D)
        grad = (tf.IndexedSlices(tf.constant(vals, tf.float32), tf.constant(rows)) if sparse
                else tf.constant(g, tf.float32))
        opt.apply_gradients([(grad, var), (tf.constant(g_bias, tf.float32), bias)])
        acc[touched] += (g[touched] ** 2).mean(axis=1)
        w[touched] -= 0.1 * g[touched] / np.sqrt(acc[touched] + 1e-7)[:, None]
        b_acc += g_bias ** 2
        b -= 0.1 * g_bias / np.sqrt(b_acc + 1e-7)
        np.testing.assert_allclose(var.numpy(), w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bias.numpy(), b, rtol=1e-5, atol=1e-6)
    assert opt._accumulators[0].shape == (N,)  # one accumulator per row, not [N, D]
    never = np.arange(N // 2, N)
    np.testing.assert_array_equal(var.numpy()[never], init[never])
    np.testing.assert_allclose(opt._accumulators[0].numpy(), acc, rtol=1e-6)
    np.testing.assert_array_equal(opt._accumulators[0].numpy()[never], np.float32(0.1))


def test_optimizer_configs_round_trip():
    for opt in (LazyAdam(0.003, beta_1=0.7, amsgrad=True), RowwiseAdagrad(0.2, initial_accumulator_value=0.5)):
        clone = type(opt).from_config(opt.get_config())
        assert clone.get_config() == opt.get_config()
        assert keras.optimizers.deserialize(keras.optimizers.serialize(opt)).get_config() == opt.get_config()


@pytest.mark.parametrize("hyper, match", [
    (dict(initial_accumulator_value=0.0, epsilon=0.0), "initial_accumulator_value=0.0 with epsilon=0.0"),
    (dict(initial_accumulator_value=0, epsilon=1e-50), "initial_accumulator_value=0 with epsilon=1e-50 .both 0"),
    (dict(initial_accumulator_value=-0.1), "initial_accumulator_value must be >= 0"),
    (dict(epsilon=-1e-7), "epsilon must be >= 0"),
    (dict(epsilon=float("nan")), "epsilon must be >= 0"),
])
def test_rowwise_adagrad_refuses_hyperparameters_that_give_nan_rows(hyper, match):
    """Both 0 wrote NaN into a touched row whose gradient was 0 (0 / sqrt(0)); refused in the
    constructor, so a config saved with them is refused on load too."""
    with pytest.raises(ValueError, match=match):
        RowwiseAdagrad(0.1, **hyper)
    saved = keras.optimizers.serialize(RowwiseAdagrad(0.1))
    saved["config"].update(hyper)
    with pytest.raises(ValueError, match=match):
        RowwiseAdagrad.from_config(saved["config"])
    with pytest.raises(ValueError, match=match):
        keras.optimizers.deserialize(saved)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("initial, epsilon", [(0.0, 1e-7), (0.1, 0.0)])
def test_rowwise_adagrad_with_one_zero_hyperparameter_matches_reference(initial, epsilon, sparse):
    """One of the two may be 0: a touched row with gradient 0 stays as it is (no NaN), the
    others follow the float64 reference, and the config round-trips."""
    rng = np.random.default_rng(4)
    init = rng.standard_normal((N, D)).astype(np.float32)
    var = keras.Variable(init)
    opt = RowwiseAdagrad(0.1, initial_accumulator_value=initial, epsilon=epsilon)
    w, acc = init.astype(np.float64), np.full(N, initial)
    eps = float(np.float32(epsilon))
    for _ in range(2):
        rows, vals = np.array([1, 2, 5, 5]), rng.standard_normal((4, D))
        vals[1] = 0  # row 2 is touched with gradient 0
        touched, g = summed(rows, vals)
        grad = (tf.IndexedSlices(tf.constant(vals, tf.float32), tf.constant(rows)) if sparse
                else tf.constant(g, tf.float32))
        opt.apply_gradients([(grad, var)])
        acc[touched] += (g[touched] ** 2).mean(axis=1)
        w[touched] -= 0.1 * g[touched] / np.sqrt(acc[touched] + eps)[:, None]
        np.testing.assert_allclose(var.numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(var.numpy()[2], init[2])
    assert RowwiseAdagrad.from_config(opt.get_config()).get_config() == opt.get_config()


@pytest.mark.parametrize("optimizer", ["lazy_adam", "rowwise_adagrad"])
def test_fit_with_sparse_gradient_layer_updates_only_touched_rows(optimizer):
    rng = np.random.default_rng(3)
    n_rows, touched = 500, np.arange(0, 500, 7)
    idx = rng.choice(touched, size=(256, 4))
    hidden = rng.standard_normal((n_rows, 8)).astype(np.float32)
    target = hidden[idx].mean(axis=1)  # learnable: a mean-bag of a hidden table
    inp = keras.Input((4,), dtype="int64")
    layer = EmbeddingBag(n_rows, 8, combiner="mean", sparse_gradient=True, name="bag")
    model = keras.Model(inp, layer(inp))
    opt = LazyAdam(0.05) if optimizer == "lazy_adam" else RowwiseAdagrad(0.5, initial_accumulator_value=1e-4)
    model.compile(optimizer=opt, loss="mse")
    before = layer.embeddings.numpy().copy()
    hist = model.fit(idx, target, batch_size=64, epochs=20, verbose=0)
    assert hist.history["loss"][-1] < 0.5 * hist.history["loss"][0]
    after = layer.embeddings.numpy()
    untouched = np.setdiff1d(np.arange(n_rows), touched)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert np.all(np.any(after[touched] != before[touched], axis=1))
    # The table's gradient in the compiled step is row-unique sparse.
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(idx[:64]) - target[:64]) ** 2)
    g = tape.gradient(loss, layer.embeddings.value)
    assert isinstance(g, tf.IndexedSlices) and len(g.indices) == len(np.unique(idx[:64]))


def test_loss_scale_factor_unscales_sparse_gradients_as_dense_ones():
    """Keras' apply divides each gradient by loss_scale_factor: an IndexedSlices raised TypeError."""
    rng = np.random.default_rng(3)
    x = [rng.integers(0, 150, size=(64, 8)), rng.uniform(0.5, 1.5, (64, 8)).astype(np.float32)]
    y = rng.standard_normal((64, 3)).astype(np.float32)

    def fit(sparse, make_opt):
        keras.utils.set_random_seed(0)
        ids, w = keras.Input((8,), dtype="int64"), keras.Input((8,))
        bag = EmbeddingBag(300, 24, combiner="mean", sparse_gradient=sparse, embeddings_initializer="glorot_uniform")
        model = keras.Model([ids, w], keras.layers.Dense(3)(bag(ids, w)))
        model.compile(make_opt(), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return [v.numpy() for v in model.trainable_variables]

    # RowwiseAdagrad: sparse and dense are the same update; LazyAdam: the factor changes nothing.
    for make_opt, reference in ((lambda: RowwiseAdagrad(0.05, loss_scale_factor=128.0),
                                 lambda: fit(False, lambda: RowwiseAdagrad(0.05, loss_scale_factor=128.0))),
                                (lambda: LazyAdam(0.01, loss_scale_factor=128.0),
                                 lambda: fit(True, lambda: LazyAdam(0.01)))):
        for got, want in zip(fit(True, make_opt), reference()):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
