"""Ragged weights must share the indices' row partition. As TF's
embedding_lookup_sparse does, a mismatch known while tracing is a ValueError;
one only known when the graph runs is an InvalidArgumentError; both say what
is wrong. Matching partitions still give the numpy result."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

MESSAGE = "weights must share the row partition of the indices"
TABLE = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))


def test_the_issue_example_is_a_value_error_in_eager():
    indices = tf.ragged.constant([[0, 1], [2]])
    weights = tf.ragged.constant([[12.0, 5.0]])
    with pytest.raises(ValueError, match=MESSAGE):
        ops.embedding_bag(TABLE, indices, weights)
    with pytest.raises(ValueError, match=MESSAGE):
        ops.embedding_bag_composite(TABLE, indices, weights)


def test_same_values_different_partition_is_a_value_error():
    indices = tf.ragged.constant([[0, 1], [2]])
    weights = tf.ragged.constant([[1.0], [2.0, 3.0]])  # 3 values like indices, split elsewhere
    with pytest.raises(ValueError, match=rf"{MESSAGE}.*\[0, 1, 3\].*\[0, 2, 3\]"):
        ops.embedding_bag(TABLE, indices, weights)


def test_ragged_rank_mismatch_is_a_value_error():
    indices = tf.ragged.constant([[[0], [1, 2]], [[3]]], ragged_rank=2)
    weights = tf.ragged.constant([[1.0, 1.0, 1.0], [1.0]])
    with pytest.raises(ValueError, match=rf"{MESSAGE}: weights have ragged rank 1, indices 2"):
        ops.embedding_bag(TABLE, indices, weights)


def test_dense_weights_with_ragged_indices_is_a_type_error():
    with pytest.raises(TypeError, match=MESSAGE):
        ops.embedding_bag(TABLE, tf.ragged.constant([[0, 1], [2, 3]]), tf.ones([2, 2]))


def test_static_row_count_mismatch_is_a_value_error_while_tracing():
    spec_i = tf.RaggedTensorSpec([3, None], tf.int32, row_splits_dtype=tf.int64)
    spec_w = tf.RaggedTensorSpec([2, None], tf.float32, row_splits_dtype=tf.int64)
    fn = tf.function(lambda i, w: ops.embedding_bag(TABLE, i, w))
    with pytest.raises(ValueError, match=rf"{MESSAGE}: ragged dimension 1 has 2 rows in "
                                         "weights, 3 in indices"):
        fn.get_concrete_function(spec_i, spec_w)


@pytest.mark.parametrize("weights", [[[12.0, 5.0]], [[1.0], [2.0, 3.0]]],
                         ids=["fewer_rows", "other_splits"])
def test_dynamic_mismatch_is_an_invalid_argument_error(weights):
    spec_i = tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)
    spec_w = tf.RaggedTensorSpec([None, None], tf.float32, row_splits_dtype=tf.int64)
    fn = tf.function(lambda i, w: ops.embedding_bag(TABLE, i, w), input_signature=[spec_i, spec_w])
    indices = tf.ragged.constant([[0, 1], [2]], dtype=tf.int64, row_splits_dtype=tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=MESSAGE):
        fn(indices, tf.ragged.constant(weights, row_splits_dtype=tf.int64))


def test_matching_partitions_match_numpy_eager_and_in_a_graph():
    indices = tf.ragged.constant([[0, 3], [], [2, 1, 1]], dtype=tf.int64,
                                 row_splits_dtype=tf.int64)
    weights = tf.ragged.constant([[0.5, 2.0], [], [1.0, -1.0, 3.0]], row_splits_dtype=tf.int64)
    table = TABLE.numpy().astype(np.float64)
    want = np.stack([0.5 * table[0] + 2.0 * table[3], np.zeros(3),
                     table[2] - table[1] + 3.0 * table[1]])
    np.testing.assert_allclose(ops.embedding_bag(TABLE, indices, weights).numpy(), want,
                               rtol=1e-6)
    spec_i = tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)
    spec_w = tf.RaggedTensorSpec([None, None], tf.float32, row_splits_dtype=tf.int64)
    fn = tf.function(lambda i, w: ops.embedding_bag(TABLE, i, w), input_signature=[spec_i, spec_w])
    np.testing.assert_allclose(fn(indices, weights).numpy(), want, rtol=1e-6)
