"""The composite max's gradient where a bag column holds NaN, eager and under jit_compile, dense and
ragged bags, against float64 numpy.

The composite splits the gradient of a tied maximum evenly over the tied rows (reduce_max's and
unsorted_segment_max's rule), so each bag column passes on exactly its own gradient. A NaN column
gave the whole gradient to every NaN row: a bag of two NaN rows passed on twice its gradient (and
a model's table gradient grew with the NaN count); a column of -inf rows shared it with the
padding (dense bags: [-inf, -inf, pad] passed on 2/3) or passed on nothing (ragged bags). Now the
NaN rows, or the -inf rows, share it evenly, like ties."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

TABLE = np.array([[np.nan, 1.0, 0.5],
                  [np.nan, 2.0, np.nan],
                  [1.0, 3.0, np.nan],
                  [2.0, 3.0, -np.inf],
                  [np.nan, -1.0, 4.0],
                  [-np.inf, -np.inf, -np.inf]])
BAGS = [[0, 1, 2], [2, 3, 3], [3, 2, 1], [4, 0, -1], [-1, -1, -1], [1, 4, 1], [5, 3, -1], [5, 5, -1]]


def _numpy_gradient(table, bags, upstream):
    """d sum(max-bags * upstream) / d table: the bag column's NaN rows, else its maximal rows (-inf too), share
    its upstream value evenly (each position a row takes in the bag counts)."""
    grad = np.zeros_like(table)
    for b, bag in enumerate(bags):
        valid = [i for i in bag if i >= 0]
        for col in range(table.shape[1]):
            values = np.array([table[i, col] for i in valid])
            if not len(values):
                continue
            winners = np.isnan(values) if np.isnan(values).any() else values == values.max()
            for i, won in zip(valid, winners):
                grad[i, col] += upstream[b, col] * won / winners.sum()
    return grad


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_nan_or_minus_inf_column_gradient_is_shared_by_its_rows(jit, ragged):
    upstream = np.arange(1.0, 1.0 + len(BAGS) * TABLE.shape[1]).reshape(len(BAGS), -1)
    ids = tf.ragged.constant(BAGS, tf.int64) if ragged else tf.constant(BAGS, tf.int64)

    @tf.function(jit_compile=jit)
    def table_gradient(table, ids, upstream):
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(ops.embedding_bag_composite(table, ids, combiner="max") * upstream)
        return tf.convert_to_tensor(tape.gradient(loss, table))

    got = table_gradient(tf.constant(TABLE, tf.float32), ids, tf.constant(upstream, tf.float32)).numpy()
    np.testing.assert_allclose(got, _numpy_gradient(TABLE, BAGS, upstream), rtol=1e-6)
