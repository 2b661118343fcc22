"""Second derivatives of a ragged max lookup under jit_compile (a gradient penalty): the max
gradient's own gradient padded the ragged bags with RaggedTensor.to_tensor, which XLA cannot
compile ("No registered 'RaggedTensorToTensor' OpKernel for XLA_CPU_JIT"); eager it worked.
Checked against a float64 numpy reference of the first-winner rule (ties and NaN: the first)."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

N, D = 12, 4
BAGS = [[3, 5, -1, 7], [], [-1], [2, 2, 9], [11, 0, 4, 6, 1], [8]]


def _penalty_gradient_reference(table, bags, c):
    """d/dc of |dL/dtable|^2 + 0.5 |dL/dc|^2 with L = sum(max-bags(table) * c): dL/dtable routes
    c[col] to the first row holding each column's maximum (the first NaN where there is one)."""
    wins = np.zeros((N, D))
    maxima = np.zeros((len(bags), D))
    for b, bag in enumerate(bags):
        valid = [i for i in bag if i >= 0]
        for col in range(D):
            if valid:
                values = np.array([table[i, col] for i in valid])
                first = int(np.argmax(np.isnan(values))) if np.isnan(values).any() else int(np.argmax(values))
                wins[valid[first], col] += 1.0
                maxima[b, col] = values[first]
    # dL/dc = column sums of the maxima, constant in c
    return 2.0 * c * (wins ** 2).sum(axis=0), maxima.sum(axis=0)


@pytest.mark.parametrize("table_kind", ["ties", "nan"])
@pytest.mark.parametrize("jit", [True, False])
def test_ragged_max_gradient_penalty(jit, table_kind):
    rng = np.random.default_rng(34)
    table_np = np.round(rng.standard_normal((N, D))).astype(np.float32)  # many ties
    if table_kind == "nan":
        table_np[2, 1] = table_np[0, 3] = np.nan
    c_np = np.linspace(0.5, 2.0, D).astype(np.float32)
    bags = tf.ragged.constant(BAGS, dtype=tf.int64)

    @tf.function(jit_compile=jit)
    def penalty_gradient(table, values, splits, c):
        ids = tf.RaggedTensor.from_row_splits(values, splits)
        with tf.GradientTape() as outer:
            outer.watch(c)
            with tf.GradientTape() as inner:
                inner.watch([table, c])
                loss = tf.reduce_sum(ops.embedding_bag(table, ids, combiner="max") * c)
            d_table, d_c = inner.gradient(loss, [table, c])
            penalty = tf.reduce_sum(d_table ** 2) + 0.5 * tf.reduce_sum(d_c ** 2)
        return outer.gradient(penalty, c)

    got = penalty_gradient(tf.constant(table_np), bags.values, bags.row_splits, tf.constant(c_np)).numpy()
    from_wins, _ = _penalty_gradient_reference(table_np.astype(np.float64), BAGS, c_np.astype(np.float64))
    # d/dc of 0.5 |dL/dc|^2 is 0: dL/dc does not depend on c
    np.testing.assert_allclose(got, from_wins, rtol=1e-6)
