"""An id past a sharded table, outside XLA, is named as the unsharded op names it (position and
value: "indices[3] = 12 is out of range [0, 10)"). Before, TF's Assert answered first, with
"Expected 'tf.Tensor(False, shape=(), dtype=bool)' to be true. Summarized data: ..." and the
largest id rather than the offending position."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3)


def _message(fn, *args):
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        fn(*args)
    return err.value.message


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("in_function", [False, True])
def test_an_id_past_a_sharded_table_is_named_as_the_unsharded_op_names_it(ragged, in_function):
    shards = [tf.Variable(TABLE[:4]), tf.Variable(TABLE[4:])]
    bags = [[1, 2], [3, 12], [-1, 11]]  # the first id past the table: flat position 3
    ids = tf.ragged.constant(bags, dtype=tf.int64) if ragged else tf.constant(bags)

    def lookup(table):
        call = lambda i: ops.embedding_bag(table, i, combiner="mean")  # noqa: E731
        return tf.function(call) if in_function else call

    unsharded = _message(lookup(tf.constant(TABLE)), ids)
    sharded = _message(lookup(shards), ids)
    assert "indices[3] = 12 is out of range [0, 10) (negative indices are padding)" in unsharded
    assert "indices[3] = 12 is out of range [0, 10) (negative indices are padding)" in sharded, sharded
    assert "Expected" not in sharded


def test_ids_within_the_table_still_match_the_unsharded_op():
    shards = [tf.Variable(TABLE[:4]), tf.Variable(TABLE[4:])]
    ids = tf.constant([[1, 9], [3, -1]])
    np.testing.assert_allclose(ops.embedding_bag(shards, ids, combiner="sqrtn").numpy(),
                               ops.embedding_bag(tf.constant(TABLE), ids, combiner="sqrtn").numpy(), rtol=1e-6)
