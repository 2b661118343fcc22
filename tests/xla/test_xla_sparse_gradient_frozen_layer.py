"""A custom training step under jit_compile over a model whose EmbeddingBag(sparse_gradient=True)
is frozen (layer.trainable = False, fine-tuning the rest): Keras leaves the layer's tf.Variable
trainable, so the step's tape watched it as it read it and the lookup raised the ValueError meant
for training the table under XLA. The frozen table takes the plain lookup: the head's gradients
equal those of the same step outside XLA and of float64 numpy, the layer called once or twice."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.layers import EmbeddingBag

RNG = np.random.default_rng(351)
IDS = RNG.integers(-1, 40, size=(6, 3)).astype(np.int32)
IDS_2 = RNG.integers(-1, 40, size=(6, 3)).astype(np.int32)
TARGET = RNG.standard_normal((6, 1)).astype(np.float32)


def _numpy_head_gradient(table, kernel, bias, calls):
    bags = sum(np.stack([table[row[row >= 0]].sum(axis=0) for row in ids]) for ids in calls[:2])
    residual = bags @ kernel + bias - TARGET  # d(mean squared error)/d(prediction) * N / 2
    return 2.0 * bags.T @ residual / len(TARGET), 2.0 * residual.sum(axis=0) / len(TARGET)


class CustomBagLayer(keras.layers.Layer):
    """A custom layer handing its Keras variable itself to ops.embedding_bag."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(40, 4), initializer="random_normal")

    def call(self, ids):
        return ops.embedding_bag(self.embeddings, ids, sparse_gradient=True)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("layer", ["EmbeddingBag", "custom"])
def test_frozen_sparse_gradient_layer_in_a_jit_training_step(layer, calls):
    embedding = EmbeddingBag(40, 4, sparse_gradient=True) if layer == "EmbeddingBag" else CustomBagLayer()
    head = keras.layers.Dense(1)
    ids, ids_2 = tf.constant(IDS), tf.constant(IDS_2)
    head(embedding(ids))
    embedding.trainable = False

    def step():
        with tf.GradientTape() as tape:  # watches the variables it reads, as Keras' train_step
            bags = embedding(ids) + (embedding(ids_2) if calls == 2 else 0.0)
            loss = tf.reduce_mean(tf.square(head(bags) - TARGET))
        return tape.gradient(loss, head.trainable_variables)

    got = [g.numpy() for g in tf.function(step, jit_compile=True)()]
    eager = [g.numpy() for g in step()]
    table = embedding.embeddings.numpy().astype(np.float64)
    kernel, bias = (v.numpy().astype(np.float64) for v in head.trainable_variables)
    want = _numpy_head_gradient(table, kernel, bias, [IDS, IDS_2][:calls])
    for g, e, w in zip(got, eager, want):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
