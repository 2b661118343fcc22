"""Gradient clipping in LazyAdam / RowwiseAdagrad when one table is looked up twice in a step.

TF concatenates the IndexedSlices of the two lookups, so a row touched by both comes twice.
Keras clips before the optimizer's step, where the project's optimizers sum repeated rows: the
clipping saw the pieces (a norm counting each piece, clipvalue applied to each piece) and the
weights left the dense-gradient run's (README, "Repeated rows with stock optimizers")."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.layers import EmbeddingBag
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad

ROWS, DIM, STEPS = 12, 8, 3


def _inputs():
    rng = np.random.default_rng(3)
    # Few rows: most rows are in both lookups of a step.
    first = rng.integers(-1, ROWS, (16, 4)).astype(np.int32)
    second = rng.integers(-1, ROWS, (16, 3)).astype(np.int32)
    targets = (rng.standard_normal((16, 1)) * 10).astype(np.float32)
    return [first, second], targets


def _model_with_a_shared_bag(sparse_gradient):
    keras.utils.set_random_seed(7)
    first, second = keras.Input((4,), dtype="int32"), keras.Input((3,), dtype="int32")
    bag = EmbeddingBag(ROWS, DIM, sparse_gradient=sparse_gradient, name="bag")
    joined = keras.layers.Concatenate()([bag(first), bag(second)])
    return keras.Model([first, second], keras.layers.Dense(1)(joined))


def _train(model, optimizer, table_gradient=lambda gradient: gradient):
    inputs, targets = _inputs()
    table = model.get_layer("bag").embeddings
    variables = model.trainable_variables
    for _ in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(inputs) - targets))
        gradients = tape.gradient(loss, variables)
        gradients = [table_gradient(g) if v is table else g for g, v in zip(gradients, variables)]
        optimizer.apply_gradients(zip(gradients, variables))
    return [v.numpy() for v in model.weights]


CLIPPING = [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.01}]


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
def test_rowwise_adagrad_clips_a_twice_looked_up_table_as_its_dense_gradient(clipping):
    # RowwiseAdagrad leaves rows of zero gradient as they are: sparse and dense are one function.
    dense = _train(_model_with_a_shared_bag(False), RowwiseAdagrad(0.1, **clipping))
    sparse = _train(_model_with_a_shared_bag(True), RowwiseAdagrad(0.1, **clipping))
    for expected, got in zip(dense, sparse):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def _touched_rows_of_dense(gradient):
    """The dense table gradient as IndexedSlices of the rows the bags hold, each once."""
    inputs, _ = _inputs()
    ids = np.concatenate([ids.ravel() for ids in inputs])
    rows = np.unique(ids[ids >= 0])
    dense = tf.convert_to_tensor(gradient)
    return tf.IndexedSlices(tf.gather(dense, rows), tf.constant(rows, tf.int64), tf.shape(dense, tf.int64))


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
def test_lazy_adam_clips_a_twice_looked_up_table_as_its_rows_summed(clipping):
    # LazyAdam differs from Adam on a dense gradient by design: the reference hands it the dense
    # gradient's touched rows, each once.
    expected = _train(_model_with_a_shared_bag(False), LazyAdam(0.01, **clipping), _touched_rows_of_dense)
    got = _train(_model_with_a_shared_bag(True), LazyAdam(0.01, **clipping))
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-7)
