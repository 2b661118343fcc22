"""Ragged weights whose row_splits have another count than the ids' (another number of bags)
under jit_compile with a RaggedTensorSpec signature: the partition check compared the splits in a
tf.cond, whose both branches XLA compiles, and failed with "Incompatible shapes: [4] vs. [5]"
instead of naming the problem. Now the message is the partition error, as outside XLA. The same
for EmbeddingBag's sparse weights with fewer entries than the sparse ids."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import ragged_embedding_bag

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4) / 10.0
IDS = tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3, 4, 5, -1, 7], tf.int64),
                                      tf.constant([0, 2, 2, 5, 7], tf.int64))
PARTITION = r"weights must share the row partition of the indices \(ragged dimension 1 differs\)"
SPECS = [tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1),
         tf.RaggedTensorSpec([None, None], tf.float32, ragged_rank=1)]


def _weights(row_splits):
    values = np.linspace(0.5, 2.0, 7).astype(np.float32)
    return tf.RaggedTensor.from_row_splits(tf.constant(values), tf.constant(row_splits, tf.int64))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("weight_splits", [[0, 2, 2, 7], [0, 2, 2, 5, 6, 7]])
def test_weights_of_another_bag_count_fail_with_the_partition_error(jit, weight_splits):
    lookup = tf.function(lambda ids, w: ops.embedding_bag(TABLE, ids, w, "mean"), jit_compile=jit,
                         input_signature=SPECS)
    same = _weights([0, 2, 2, 5, 7])
    np.testing.assert_allclose(lookup(IDS, same).numpy(), ragged_embedding_bag(
        TABLE, IDS.values.numpy(), IDS.row_splits.numpy(), same.values.numpy(), "mean"), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=PARTITION):
        lookup(IDS, _weights(weight_splits))


@pytest.mark.parametrize("jit", [False, True])
def test_layer_sparse_weights_with_fewer_entries_fail_naming_the_weights(jit):
    import os

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    from pkm_serve.layers import EmbeddingBag

    layer = EmbeddingBag(10, 4, combiner="sum")
    layer.build()
    layer.embeddings.assign(TABLE)
    specs = [tf.SparseTensorSpec([2, 3], tf.int64), tf.SparseTensorSpec([2, 3], tf.float32)]
    lookup = tf.function(lambda ids, w: layer(ids, w), jit_compile=jit, input_signature=specs)
    positions = [[0, 0], [0, 2], [1, 1]]
    ids = tf.sparse.SparseTensor(positions, tf.constant([1, 2, 3], tf.int64), [2, 3])
    got = lookup(ids, tf.sparse.SparseTensor(positions, [1.0, 2.0, 3.0], [2, 3]))
    np.testing.assert_allclose(got.numpy(), [TABLE[1] + 2 * TABLE[2], 3 * TABLE[3]], rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must"):
        lookup(ids, tf.sparse.SparseTensor([[0, 0], [1, 1]], [1.0, 3.0], [2, 3]))
