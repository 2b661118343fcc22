"""Weights and ids of dynamic sizes (tf.boolean_mask) under jit_compile on the CPU: weights masked
to another size than the ids are an InvalidArgumentError, as outside XLA. Until this fix XLA read
them at the ids' positions, zero past their own size: silent wrong bags."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import embedding_bag

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0
IDS = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
WEIGHTS = np.array([[1.0, 0.5], [2.0, 0.25], [3.0, 4.0]], np.float32)
# Tensors, not Python lists: a list is a trace-time constant, whose sizes XLA knows when compiling.
MASKS = {"first_and_last": [True, False, True], "all": [True, True, True]}
MISMATCH = r"weights must have the shape of indices"


def _masked_lookup(jit, combiner="sum"):
    def lookup(ids, weights, ids_mask, weights_mask):
        return ops.embedding_bag(TABLE, tf.boolean_mask(ids, ids_mask), tf.boolean_mask(weights, weights_mask),
                                 combiner)
    return tf.function(lookup, jit_compile=jit)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("ids_mask, weights_mask", [("first_and_last", "all"), ("all", "first_and_last")])
def test_weights_masked_to_another_size_fail(jit, ids_mask, weights_mask):
    with pytest.raises(tf.errors.InvalidArgumentError, match=MISMATCH):
        _masked_lookup(jit)(IDS, WEIGHTS, tf.constant(MASKS[ids_mask]), tf.constant(MASKS[weights_mask]))


@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_weights_masked_like_the_ids_match_numpy_and_keep_their_gradient(combiner):
    mask = np.array(MASKS["first_and_last"])
    got = _masked_lookup(True, combiner)(IDS, WEIGHTS, tf.constant(mask), tf.constant(mask))
    np.testing.assert_allclose(got.numpy(), embedding_bag(TABLE, IDS[mask], WEIGHTS[mask], combiner), rtol=1e-6)

    @tf.function(jit_compile=True)
    def d_weights(weights):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = ops.embedding_bag(TABLE, tf.boolean_mask(IDS, mask), tf.boolean_mask(weights, mask), combiner)
            loss = tf.reduce_sum(out * np.arange(1.0, 4.0, dtype=np.float32))
        return tape.gradient(loss, weights)

    weights = tf.constant(WEIGHTS)
    with tf.GradientTape() as tape:
        tape.watch(weights)
        composite = ops.embedding_bag_composite(TABLE, IDS[mask], tf.boolean_mask(weights, mask), combiner)
        composite = tf.reduce_sum(composite * np.arange(1.0, 4.0, dtype=np.float32))
    np.testing.assert_allclose(d_weights(weights).numpy(), tape.gradient(composite, weights).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_flat_weights_masked_to_another_count_fail_under_jit():
    def lookup(ids, weights, ids_mask, weights_mask):
        ids = tf.reshape(tf.boolean_mask(tf.reshape(ids, [-1]), ids_mask), [-1, 1])
        weights = tf.reshape(tf.boolean_mask(tf.reshape(weights, [-1]), weights_mask), [-1, 1])
        return ops.embedding_bag(TABLE, ids, weights)

    keep_four = np.array([True, False, True, True, False, True])
    jitted = tf.function(lookup, jit_compile=True)
    got = jitted(IDS, WEIGHTS, tf.constant(keep_four), tf.constant(keep_four))
    flat_ids, flat_w = IDS.reshape(-1)[keep_four], WEIGHTS.reshape(-1)[keep_four]
    np.testing.assert_allclose(got.numpy(), embedding_bag(TABLE, flat_ids[:, None], flat_w[:, None]), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=MISMATCH):
        jitted(IDS, WEIGHTS, tf.constant(keep_four), tf.constant([True, True, True, False, False, False]))


def test_int8_table_weights_masked_to_another_size_fail_under_jit():
    from pkm_serve import quantized
    from tests.reference import dequantize_rows

    table = quantized.quantize_table(TABLE)
    lookup = tf.function(lambda i, w, ids_mask, w_mask: quantized.embedding_bag(
        table, tf.boolean_mask(i, ids_mask), tf.boolean_mask(w, w_mask), "mean"), jit_compile=True)
    mask = np.array(MASKS["first_and_last"])
    dequantized = dequantize_rows(*(t.numpy() for t in table))
    np.testing.assert_allclose(lookup(IDS, WEIGHTS, tf.constant(mask), tf.constant(mask)).numpy(),
                               embedding_bag(dequantized, IDS[mask], WEIGHTS[mask], "mean"), rtol=1e-5, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=MISMATCH):
        lookup(IDS, WEIGHTS, tf.constant(mask), tf.constant(MASKS["all"]))


def test_ragged_weight_values_masked_to_another_count_fail_under_jit():
    def lookup(values, weight_values, ids_mask, weights_mask):
        bags = tf.RaggedTensor.from_row_splits(tf.boolean_mask(values, ids_mask), tf.constant([0, 1, 3], tf.int64),
                                               validate=False)
        return ops.embedding_bag(TABLE, bags, bags.with_flat_values(tf.boolean_mask(weight_values, weights_mask)))

    jitted = tf.function(lookup, jit_compile=True)
    values, weight_values = tf.constant([1, 2, 3, 4]), tf.constant([1.0, 2.0, 3.0, 4.0])
    keep_three = tf.constant([True, True, False, True])
    np.testing.assert_allclose(jitted(values, weight_values, keep_three, keep_three).numpy(),
                               [TABLE[1], 2 * TABLE[2] + 4 * TABLE[4]], rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=MISMATCH):
        jitted(values, weight_values, keep_three, tf.constant([True] * 4))


def test_vectorized_map_under_jit_keeps_one_lookup_and_the_check():
    """The check on weights of run-time shape (a None signature) has a pfor converter: without it
    vectorized_map under jit failed (fallback_to_while_loop=False) or ran a while_loop."""
    ids = np.stack([IDS, IDS[::-1]])
    weights = np.stack([WEIGHTS, 2 * WEIGHTS])
    sig = [tf.TensorSpec([None, None, None], tf.int32), tf.TensorSpec([None, None, None], tf.float32)]
    lookup = tf.function(lambda i, w: tf.vectorized_map(lambda a: ops.embedding_bag(TABLE, a[0], a[1], "sqrtn"), (i, w),
                                                        fallback_to_while_loop=False),
                         jit_compile=True, input_signature=sig)
    expected = np.stack([embedding_bag(TABLE, ids[p], weights[p], "sqrtn") for p in range(2)])
    np.testing.assert_allclose(lookup(ids, weights).numpy(), expected, rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must have the shape of indices"):
        lookup(ids, weights[:, :, :1])


def test_vectorized_check_with_a_condition_per_iteration():
    lib = ops.load_library()
    check = tf.function(lambda x: tf.vectorized_map(lambda v: lib.pkm_check_then(v > 0, v, message="not positive"),
                                                    x, fallback_to_while_loop=False), jit_compile=True)
    np.testing.assert_array_equal(check(tf.constant([1.0, 2.0])).numpy(), [1.0, 2.0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="not positive"):
        check(tf.constant([1.0, -2.0]))
