"""combiner "max" with NaN and -inf rows, eager and under jit_compile, against float64 numpy.

XLA's reduce_max skips NaN (it gave 1 for a bag of [NaN, 1] where eager TF gives NaN), and
unsorted_segment_max starts from the lowest finite value (a ragged bag of -inf rows gave
-3.4e38, and no row won its second-derivative routing). The composite (XLA's fallback on a TPU or
a GPU without our target) and the second derivatives of the fused op said NaN and -inf explicitly
only in some paths: the dense second derivative under jit routed a NaN column to a finite row."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

N, D = 7, 3
BAGS = [[0, 1], [], [2], [-1, -1], [3, 0, 1], [2, 2, -1], [4, 5], [6, 3]]


def _table():
    table = np.array([[1.0, -np.inf, 2.0],
                      [-2.0, 3.0, np.nan],
                      [-np.inf, -np.inf, -np.inf],
                      [np.nan, 1.0, -np.inf],
                      [-np.inf, np.nan, 0.5],
                      [0.5, np.nan, 0.5],
                      [5.0, -1.0, np.inf]])
    assert table.shape == (N, D)
    return table


def _first_winner(values):
    """Index of the entry the fused max routes to: the first NaN, else the first maximum."""
    nan = np.isnan(values)
    return int(np.argmax(nan)) if nan.any() else int(np.argmax(values))


def _reference(table, bags, c):
    """(max bags [B, D], d/dc of |dL/dtable|^2 with L = sum(max-bags * c)) in float64."""
    out = np.zeros((len(bags), D))
    wins = np.zeros((N, D))
    for b, bag in enumerate(bags):
        valid = [i for i in bag if i >= 0]
        for col in range(D):
            if valid:
                values = np.array([table[i, col] for i in valid])
                first = _first_winner(values)
                out[b, col] = values[first]
                wins[valid[first], col] += 1.0
    return out, 2.0 * c * (wins ** 2).sum(axis=0)


def _ids(ragged):
    if ragged:
        return tf.ragged.constant(BAGS, dtype=tf.int64)
    width = max(len(bag) for bag in BAGS)
    return tf.constant([bag + [-1] * (width - len(bag)) for bag in BAGS], tf.int64)


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lookup", [ops.embedding_bag_composite, ops.embedding_bag])
def test_max_of_nan_and_minus_inf_rows_matches_numpy(lookup, jit, ragged):
    table = _table()
    lookup_fn = tf.function(lambda t, i: lookup(t, i, combiner="max"), jit_compile=jit)
    got = lookup_fn(tf.constant(table, tf.float32), _ids(ragged)).numpy()
    expected, _ = _reference(table, BAGS, np.ones(D))
    np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_max_second_derivative_routes_nan_and_minus_inf_columns(jit, ragged):
    table = _table()
    c_np = np.linspace(0.5, 2.0, D)

    @tf.function(jit_compile=jit)
    def penalty_gradient(table, ids, c):
        with tf.GradientTape() as outer:
            outer.watch(c)
            with tf.GradientTape() as inner:
                inner.watch(table)
                loss = tf.reduce_sum(ops.embedding_bag(table, ids, combiner="max") * c)
            penalty = tf.reduce_sum(inner.gradient(loss, table) ** 2)
        return outer.gradient(penalty, c)

    got = penalty_gradient(tf.constant(table, tf.float32), _ids(ragged), tf.constant(c_np, tf.float32)).numpy()
    _, expected = _reference(table, BAGS, c_np)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
