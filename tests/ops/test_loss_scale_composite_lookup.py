"""A composite lookup (EmbeddingBag(implementation="composite"), or the fallback where the op
library does not load) under a LossScaleOptimizer around a stock optimizer: a step whose gradient
holds an inf is skipped. The gather's gradient lists a slice per index, so a row in two bags is
listed twice, and Keras' check kept one slice's verdict: an inf in the other passed and Adam wrote
NaN into the table. Only a fused sparse-gradient lookup installed the check
(pkm_serve/_loss_scale_check.py)."""

import inspect
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.layers import EmbeddingBag  # noqa: E402

N, D, SCALE, LR = 8, 2, 4.0, 0.1
BAGS = [[3, 1], [1, 3]]  # each row in both bags: listed twice in the gather's gradient


@pytest.fixture
def keras_own_check(monkeypatch):
    """Keras' check, as in a process where no lookup installed ours yet."""
    wrapper = keras.optimizers.LossScaleOptimizer
    monkeypatch.setattr(wrapper, "check_finite", inspect.unwrap(wrapper.check_finite))


@pytest.mark.parametrize("inf_in_bag", [0, 1])
def test_a_composite_lookups_non_finite_gradient_skips_the_step(keras_own_check, inf_in_bag):
    layer = EmbeddingBag(N, D, implementation="composite")
    layer.build((None, 2))
    init = layer.embeddings.numpy()
    wrapper = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(LR), initial_scale=SCALE)

    def gradient(upstream):
        with tf.GradientTape() as tape:
            out = layer(tf.constant(BAGS))
        grad = tape.gradient(out, layer.embeddings, output_gradients=tf.constant(upstream, tf.float32))
        assert isinstance(grad, tf.IndexedSlices)
        return grad

    upstream = np.ones((len(BAGS), D), np.float32)
    upstream[inf_in_bag, 0] = np.inf
    wrapper.apply_gradients([(gradient(upstream), layer.embeddings)])
    np.testing.assert_array_equal(layer.embeddings.numpy(), init)  # skipped, as Keras documents
    assert float(wrapper.dynamic_scale.numpy()) == SCALE / 2
    finite = gradient(np.ones((len(BAGS), D), np.float32))
    wrapper.apply_gradients([(finite, layer.embeddings)])  # Adam's step on the unscaled gradient
    plain = keras.Variable(init)
    unscaled = tf.IndexedSlices(finite.values / (SCALE / 2), finite.indices, finite.dense_shape)
    keras.optimizers.Adam(LR).apply_gradients([(unscaled, plain)])
    np.testing.assert_allclose(layer.embeddings.numpy(), plain.numpy(), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(plain.numpy(), init)
