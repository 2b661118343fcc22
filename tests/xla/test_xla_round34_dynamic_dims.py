"""Ids of bounded dynamic size under jit_compile: bags picked inside the compiled function by
tf.boolean_mask, tf.unique or tf.where, and ragged bags of tf.ragged.boolean_mask. XLA refused
the custom calls ("CustomCall "pkm_embedding_bag_forward" is not supported to have a dynamic
dimension", UnimplementedError) where the composite compiled; now the lowering passes the bound,
with the entries past the size as padding, and the results keep the dynamic sizes."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, quantized
from tests import reference
from tests.reference import bag_forward_backward

N, D, K = 30, 5, 4
RNG = np.random.default_rng(34)
TABLE = RNG.normal(size=(N, D)).astype(np.float32)


def _check(got, want, what, tol=1e-5):
    got = np.asarray(tf.convert_to_tensor(got), np.float64)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} vs {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_bags_picked_by_boolean_mask_under_jit(combiner):
    """Forward, d_table and d_weights of the kept bags ([B, T, K] ids, a [B, T] mask: the kept
    bags' leading dim is dynamic) against float64 numpy."""
    ids = RNG.integers(-1, N, size=(3, 4, K))
    keep = RNG.random((3, 4)) < 0.5
    keep[0, 0], keep[2, 3] = True, False
    weights = None if combiner == "max" else RNG.uniform(0.2, 2.0, size=ids.shape).astype(np.float32)
    upstream = RNG.normal(size=(3, 4, D)).astype(np.float32)

    @tf.function(jit_compile=True)
    def step(table, ids, weights, keep):
        with tf.GradientTape() as tape:
            tape.watch([table, weights])
            kept_w = None if combiner == "max" else tf.boolean_mask(weights, keep)
            out = ops.embedding_bag(table, tf.boolean_mask(ids, keep), kept_w, combiner=combiner)
            loss = tf.reduce_sum(out * tf.boolean_mask(upstream, keep))
        return [out] + tape.gradient(loss, [table, weights], unconnected_gradients="zero")

    w_arg = tf.zeros(ids.shape) if weights is None else tf.constant(weights)
    out, d_table, d_weights = step(tf.constant(TABLE), tf.constant(ids), w_arg, tf.constant(keep))
    kept_w = None if weights is None else weights[keep].tolist()
    want, want_d_table, want_d_weights = bag_forward_backward(TABLE, ids[keep].tolist(), kept_w, combiner,
                                                              upstream[keep])
    _check(out, want, "output")
    _check(d_table, want_d_table, "d_table")
    if weights is not None:
        full_d_weights = np.zeros(ids.shape)
        full_d_weights[keep] = np.asarray(want_d_weights)
        _check(d_weights, full_d_weights, "d_weights")


def test_bag_axis_of_dynamic_size_under_jit():
    """Positions dropped from every bag (tf.boolean_mask over axis 1): the bag axis is dynamic."""
    ids = RNG.integers(-1, N, size=(3, 5))
    weights = RNG.uniform(0.2, 2.0, size=ids.shape).astype(np.float32)
    positions = np.array([True, False, True, True, False])
    lookup = tf.function(lambda i, w, m: ops.embedding_bag(
        TABLE, tf.boolean_mask(i, m, axis=1), tf.boolean_mask(w, m, axis=1), combiner="sqrtn"), jit_compile=True)
    _check(lookup(tf.constant(ids), tf.constant(weights), tf.constant(positions)),
           reference.embedding_bag(TABLE, ids[:, positions], weights[:, positions], "sqrtn"), "sqrtn")


def test_ids_from_unique_and_where_under_jit():
    table = tf.constant(TABLE)
    unique_rows = tf.function(
        lambda i: ops.embedding_bag(table, tf.reshape(tf.unique(i)[0], [-1, 1])), jit_compile=True)
    _check(unique_rows(tf.constant([4, 4, 7, 4, 2])), TABLE[[4, 7, 2]], "tf.unique ids")
    nonzero = tf.function(lambda x: ops.embedding_bag(table, tf.where(x > 0), combiner="mean"), jit_compile=True)
    _check(nonzero(tf.constant([0.0, 1.0, 0.0, 2.0])), TABLE[[1, 3]], "tf.where ids")
    none_kept = tf.function(lambda i, m: ops.embedding_bag(table, tf.boolean_mask(i, m)), jit_compile=True)
    assert none_kept(tf.constant([[1, 2]]), tf.constant([False])).shape == (0, D)


@pytest.mark.parametrize("combiner", ["sum", "sqrtn", "max"])
def test_ragged_boolean_mask_under_jit(combiner):
    """tf.ragged.boolean_mask: the values' count is dynamic (the row splits are not); a mask that
    keeps nothing leaves every bag empty."""
    ids = RNG.integers(-1, N, size=(4, 6))
    keeps = [RNG.random(ids.shape) < 0.5, np.zeros(ids.shape, bool)]
    upstream = RNG.normal(size=(4, D)).astype(np.float32)

    @tf.function(jit_compile=True)
    def step(table, ids, weights, keep):
        with tf.GradientTape() as tape:
            tape.watch([table, weights])
            bags = tf.ragged.boolean_mask(ids, keep)
            bag_w = None if combiner == "max" else tf.ragged.boolean_mask(weights, keep)
            out = ops.embedding_bag(table, bags, bag_w, combiner=combiner)
            loss = tf.reduce_sum(out * upstream)
        return [out] + tape.gradient(loss, [table, weights], unconnected_gradients="zero")

    weights = RNG.uniform(0.2, 2.0, size=ids.shape).astype(np.float32)
    for keep in keeps:
        out, d_table, d_weights = step(tf.constant(TABLE), tf.constant(ids), tf.constant(weights), tf.constant(keep))
        bags = [list(row[k]) for row, k in zip(ids, keep)]
        bag_w = None if combiner == "max" else [list(row[k]) for row, k in zip(weights, keep)]
        want, want_d_table, want_d_weights = bag_forward_backward(TABLE, bags, bag_w, combiner, upstream)
        _check(out, want, f"output, {keep.sum()} kept")
        _check(d_table, want_d_table, "d_table")
        if bag_w is not None:
            full = np.zeros(ids.shape)
            for row, (k, dw) in enumerate(zip(keep, want_d_weights)):
                full[row, k] = dw
            _check(d_weights, full, "d_weights")


def test_ragged_bags_of_dynamic_count_under_jit():
    """Row splits of dynamic size (an empty bag's split dropped by tf.boolean_mask): forward and
    d_table; splits whose last entry misses the values' count still fail as outside XLA. (TF's own
    tf.ragged.boolean_mask over rows, and a cumsum of dynamic row lengths, give wrong row splits
    under XLA on this TF, so they cannot make them.)"""
    table = tf.constant(TABLE)
    values = tf.constant([1, 2, 3])
    splits, keep = tf.constant([0, 1, 1, 3], tf.int64), tf.constant([True, True, False, True])

    @tf.function(jit_compile=True)
    def step(values, splits, keep):
        with tf.GradientTape() as tape:
            tape.watch(table)
            bags = tf.RaggedTensor.from_row_splits(values, tf.boolean_mask(splits, keep), validate=False)
            out = ops.embedding_bag(table, bags, combiner="mean")
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, table)

    out, d_table = step(values, splits, keep)
    bags = [[1], [2, 3]]
    want = reference.bag_list(TABLE, bags, None, "mean")
    _, want_d_table, _ = bag_forward_backward(TABLE, bags, None, "mean", 2 * want)  # d(sum out^2) = 2 out
    _check(out, want, "output")
    _check(d_table, want_d_table, "d_table")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row_splits\[-1\] = 1 must equal the number of values"):
        step(values, splits, tf.constant([True, True, True, False]))


def test_dynamic_ids_past_the_table_still_fail_and_padding_never_does():
    table = tf.constant(TABLE)
    lookup = tf.function(lambda i, m: ops.embedding_bag(table, tf.boolean_mask(i, m)), jit_compile=True)
    # The dropped bag holds an id past the table: it is not looked up.
    _check(lookup(tf.constant([[1, 2], [N + 5, 0]]), tf.constant([True, False])), [TABLE[1] + TABLE[2]], "kept")
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"= {N + 5} is out of range \[0, {N}\)"):
        lookup(tf.constant([[1, 2], [N + 5, 0]]), tf.constant([False, True]))
    ragged = tf.function(lambda i, m: ops.embedding_bag(table, tf.ragged.boolean_mask(i, m)), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"= {N} is out of range \[0, {N}\)"):
        ragged(tf.constant([[1, N], [0, 0]]), tf.constant([[True, True], [False, True]]))


def test_int8_table_with_dynamic_ids_under_jit():
    q, scales, biases = quantized.quantize_rows(TABLE)
    table = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    ids = RNG.integers(-1, N, size=(5, K))
    keep = np.array([True, False, True, True, False])
    lookup = tf.function(lambda i, m: quantized.embedding_bag(table, tf.boolean_mask(i, m), combiner="mean"),
                         jit_compile=True)
    dequantized = q.astype(np.float64) * scales[:, None].astype(np.float64) + biases[:, None]
    _check(lookup(tf.constant(ids), tf.constant(keep)), reference.embedding_bag(dequantized, ids[keep], None, "mean"),
           "int8", tol=1e-4)
