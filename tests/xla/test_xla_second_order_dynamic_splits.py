"""Second derivatives (a gradient penalty) of a ragged lookup whose row splits and values have sizes
known only at run time inside a jit_compile function (masked there with tf.boolean_mask).

The second derivative takes the composite's gradient, whose value_rowids XLA could not compile
there ("Input 1 to node .../RaggedSplitsToSegmentIds/Repeat/SequenceMask/Range with op Range must be
a compile-time constant"), nor its segment sums of an int64 bag count ("SetDimensionSize's value has
to be S32"); and the max rule's first winner came from a cumsum, which XLA gets wrong for a tensor of
run-time size. The sharded lookup's mean/sqrtn used value_rowids too. References: eager TF's
composite on the kept bags (no dynamic sizes), and float64 numpy for max and the sharded bags."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

N, D = 9, 3
VALUES = np.array([1, 4, 2, 8, 0, 3, 3, 7, 5, -1], np.int64)
SPLITS = np.array([0, 2, 2, 5, 6, 10], np.int64)
KEEP = np.array([True, True, False, True, True, True])  # dropping split 2 merges bags 1 and 2


def _inputs():
    rng = np.random.default_rng(36)
    table = np.round(rng.standard_normal((N, D)) * 2).astype(np.float32)  # ties for max
    weights = rng.uniform(0.5, 2.0, size=VALUES.shape).astype(np.float32)
    c = np.linspace(0.5, 2.0, D).astype(np.float32)
    return table, weights, c


def _penalty_gradients(lookup, table, ids, weights, c, combiner):
    """d/d(table, weights, c) of |dL/dtable|^2 + |dL/dweights|^2, L = sum(lookup(table, ids) * c)."""
    bag_weights = None if combiner == "max" else ids.with_flat_values(weights)
    with tf.GradientTape() as outer:
        outer.watch([table, weights, c])
        with tf.GradientTape() as inner:
            inner.watch([table, weights])
            loss = tf.reduce_sum(lookup(table, ids, bag_weights, combiner=combiner) * c)
        d_table, d_weights = inner.gradient(loss, [table, weights])
        penalty = tf.reduce_sum(tf.convert_to_tensor(d_table) ** 2)
        if d_weights is not None:
            penalty += tf.reduce_sum(tf.convert_to_tensor(d_weights) ** 2)
    return outer.gradient(penalty, [table, weights, c], unconnected_gradients=tf.UnconnectedGradients.ZERO)


def _masked_inside(lookup, combiner):
    @tf.function(jit_compile=True)
    def penalty_gradients(table, values, splits, keep, weights, c):
        in_range = values < N  # every id: the values keep their count, but XLA sees it only at run time
        values, weights = tf.boolean_mask(values, in_range), tf.boolean_mask(weights, in_range)
        ids = tf.RaggedTensor.from_row_splits(values, tf.boolean_mask(splits, keep), validate=False)
        return _penalty_gradients(lookup, table, ids, weights, c, combiner)
    return penalty_gradients


def _max_reference(table, c):
    """float64 d/dc of |dL/dtable|^2 for max: c[col] goes to the first maximum of each bag column."""
    splits = SPLITS[KEEP]
    wins = np.zeros((N, D))
    for start, stop in zip(splits[:-1], splits[1:]):
        valid = [i for i in VALUES[start:stop] if i >= 0]
        for col in range(D):
            if valid:
                wins[valid[int(np.argmax([table[i, col] for i in valid]))], col] += 1.0
    return 2.0 * c * (wins ** 2).sum(axis=0)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "max"])
@pytest.mark.parametrize("lookup", [ops.embedding_bag, ops.embedding_bag_composite])
def test_gradient_penalty_of_bags_masked_inside_jit(lookup, combiner):
    table, weights, c = _inputs()
    got = _masked_inside(lookup, combiner)(tf.constant(table), tf.constant(VALUES), tf.constant(SPLITS),
                                           tf.constant(KEEP), tf.constant(weights), tf.constant(c))
    kept = tf.RaggedTensor.from_row_splits(VALUES, SPLITS[KEEP])
    expected = _penalty_gradients(ops.embedding_bag_composite, tf.constant(table), kept, tf.constant(weights),
                                  tf.constant(c), combiner)
    fused_max = combiner == "max" and lookup is ops.embedding_bag
    for name, g, e in zip(["table", "weights", "c"], got, expected):
        if fused_max and name == "c":  # the composite splits ties evenly, the fused op gives them to the first
            e = _max_reference(table.astype(np.float64), c)
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(e).numpy(), rtol=1e-5,
                                   atol=1e-5, err_msg=name)


def _numpy_bags(table, weights, combiner):
    """float64 bags of VALUES split at SPLITS[KEEP] (padding -1 skipped)."""
    splits = SPLITS[KEEP]
    out = np.zeros((len(splits) - 1, D))
    for b, (start, stop) in enumerate(zip(splits[:-1], splits[1:])):
        pairs = [(i, w) for i, w in zip(VALUES[start:stop], weights[start:stop]) if i >= 0]
        if not pairs:
            continue
        rows = np.array([table[i] for i, _ in pairs])
        w = np.array([w for _, w in pairs])
        out[b] = (w[:, None] * rows).sum(axis=0)
        out[b] /= {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
    return out


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])  # max takes one table
def test_sharded_table_bags_masked_inside_jit(combiner):
    """The sharded lookup's per-bag weight sums used value_rowids too (the same compile error)."""
    table, weights, _ = _inputs()

    @tf.function(jit_compile=True)
    def lookup(shards, values, splits, keep, weights):
        in_range = values < N
        values, weights = tf.boolean_mask(values, in_range), tf.boolean_mask(weights, in_range)
        ids = tf.RaggedTensor.from_row_splits(values, tf.boolean_mask(splits, keep), validate=False)
        return ops.embedding_bag(shards, ids, ids.with_flat_values(weights), combiner=combiner)

    shards = [tf.constant(table[:4]), tf.constant(table[4:])]
    got = lookup(shards, tf.constant(VALUES), tf.constant(SPLITS), tf.constant(KEEP), tf.constant(weights))
    expected = _numpy_bags(table.astype(np.float64), weights.astype(np.float64), combiner)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
