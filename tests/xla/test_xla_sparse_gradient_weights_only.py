"""sparse_gradient=True under jit_compile with a tape that wants only the weights' gradient: a
constant table has no gradient to shape, so the lookup compiles (the dense-gradient op) and
d_weights equals the one outside XLA, the composite's and float64 numpy's. Until this fix any
recording tape raised the ValueError meant for a training step of the table."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import embedding_bag_sum_grads

RNG = np.random.default_rng(35)
TABLE = RNG.standard_normal((20, 4)).astype(np.float32)
IDS = RNG.integers(-1, 20, size=(5, 6)).astype(np.int32)
WEIGHTS = RNG.uniform(0.1, 1.0, size=IDS.shape).astype(np.float32)
TARGET = RNG.standard_normal((5, 4)).astype(np.float32)


def _d_weights(lookup, table, ids, weights):
    with tf.GradientTape() as tape:
        tape.watch(weights)
        loss = tf.reduce_sum(lookup(table, ids, weights) * TARGET)
    return tape.gradient(loss, weights)


def _fused(sparse_gradient, combiner):
    return lambda t, i, w: ops.embedding_bag(t, i, w, combiner, sparse_gradient=sparse_gradient)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("table_kind", ["tf_constant", "numpy"])
def test_tape_on_the_weights_inside_jit(table_kind, combiner):
    table = tf.constant(TABLE) if table_kind == "tf_constant" else TABLE
    ids, weights = tf.constant(IDS), tf.constant(WEIGHTS)
    jitted = tf.function(lambda i, w: _d_weights(_fused(True, combiner), table, i, w), jit_compile=True)
    got = jitted(ids, weights).numpy()
    eager = _d_weights(_fused(True, combiner), table, ids, weights).numpy()
    composite = _d_weights(lambda t, i, w: ops.embedding_bag_composite(t, i, w, combiner), table, ids, weights)
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, composite.numpy(), rtol=1e-5, atol=1e-6)
    if combiner == "sum":
        np.testing.assert_allclose(got, embedding_bag_sum_grads(TABLE, IDS, WEIGHTS, TARGET)[1],
                                   rtol=1e-5, atol=1e-5)


def test_tape_on_the_weights_outside_jit_and_ragged_bags():
    table = tf.constant(TABLE)
    values, splits = tf.constant([3, 0, 7, 7, 19, 2], tf.int64), tf.constant([0, 2, 2, 6], tf.int64)
    w_values = tf.constant(WEIGHTS.reshape(-1)[:6])

    def loss(v, s, wv):
        out = ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(v, s),
                                tf.RaggedTensor.from_row_splits(wv, s), "sqrtn", sparse_gradient=True)
        return tf.reduce_sum(out * TARGET[:3])

    jitted = tf.function(loss, jit_compile=True)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(w_values)
        got, eager = jitted(values, splits, w_values), loss(values, splits, w_values)
    np.testing.assert_allclose(tape.gradient(got, w_values), tape.gradient(eager, w_values), rtol=1e-5, atol=1e-6)


def test_tape_on_the_constant_table_inside_jit_is_still_the_clear_error():
    table = tf.constant(TABLE)

    @tf.function(jit_compile=True)
    def d_table(ids):
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(ops.embedding_bag(table, ids, sparse_gradient=True))
        return tape.gradient(loss, table)

    with pytest.raises(ValueError, match="sparse_gradient=True cannot be compiled by XLA"):
        d_table(tf.constant(IDS))


@pytest.mark.parametrize("table_kind", ["frozen_variable", "unwatched_variable"])
def test_variable_table_no_tape_watches_inside_jit(table_kind):
    """A non-trainable variable, or a trainable one under a tape with watch_accessed_variables=False
    that watches only the weights: no table gradient is asked for."""
    table = tf.Variable(TABLE, trainable=table_kind != "frozen_variable")
    ids, weights = tf.constant(IDS), tf.constant(WEIGHTS)

    def d_weights(i, w):
        with tf.GradientTape(watch_accessed_variables=table_kind == "frozen_variable") as tape:
            tape.watch(w)
            loss = tf.reduce_sum(ops.embedding_bag(table, i, w, "sqrtn", sparse_gradient=True) * TARGET)
        return tape.gradient(loss, w)

    got = tf.function(d_weights, jit_compile=True)(ids, weights).numpy()
    composite = _d_weights(lambda t, i, w: ops.embedding_bag_composite(t, i, w, "sqrtn"), TABLE, ids, weights)
    np.testing.assert_allclose(got, d_weights(ids, weights).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, composite.numpy(), rtol=1e-5, atol=1e-6)


def test_trainable_variable_read_under_a_tape_inside_jit_is_still_the_clear_error():
    table = tf.Variable(TABLE)

    @tf.function(jit_compile=True)
    def d_weights(ids, w):
        with tf.GradientTape() as tape:  # watches the variable it reads
            tape.watch(w)
            loss = tf.reduce_sum(ops.embedding_bag(table, ids, w, sparse_gradient=True))
        return tape.gradient(loss, w)

    with pytest.raises(ValueError, match="sparse_gradient=True cannot be compiled by XLA"):
        d_weights(tf.constant(IDS), tf.constant(WEIGHTS))
