"""Checks that only the run can make, under jit_compile on the CPU: XLA drops tf.debugging.Assert,
so ragged weights of another row partition than the ids, and EmbeddingBag's sparse weights at other
positions than the sparse ids, were silently put in the wrong bags under XLA (an
InvalidArgumentError outside it). They now fail with the same message (the op library's
PkmCheckThen, a custom call XLA keeps)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import ops, quantized  # noqa: E402
from pkm_serve.layers import EmbeddingBag  # noqa: E402
from tests.reference import bag_list  # noqa: E402

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0
PARTITION = r"weights must share the row partition of the indices \(ragged dimension 1 differs\)"
# The lookup's own refusal where XLA dropped the graph's Assert (until round 38 it read
# "row_splits[0] must be 0, got -1", which named neither ids nor weights).
MISMATCH_UNDER_JIT = r"mismatched partitions of ids and weights: weights must share the row partition of the indices"


@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
@pytest.mark.parametrize("jit", [False, True])
def test_ragged_weights_of_another_partition_fail_under_jit(jit, combiner):
    lookup = tf.function(
        lambda v, s, wv, ws: ops.embedding_bag(TABLE, tf.RaggedTensor.from_row_splits(v, s),
                                               tf.RaggedTensor.from_row_splits(wv, ws), combiner=combiner),
        jit_compile=jit)
    ids, splits, weights = [1, 2, 3], tf.constant([0, 1, 3], tf.int64), [1.0, 10.0, 100.0]
    got = lookup(tf.constant(ids), splits, tf.constant(weights), splits)
    np.testing.assert_allclose(got.numpy(), bag_list(TABLE, [[1], [2, 3]], [[1.0], [10.0, 100.0]], combiner),
                               rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=PARTITION):
        lookup(tf.constant(ids), splits, tf.constant(weights), tf.constant([0, 2, 3], tf.int64))


def test_ragged_weights_check_keeps_the_gradient_under_jit():
    @tf.function(jit_compile=True)
    def d_weights(values, splits, w_values, w_splits):
        with tf.GradientTape() as tape:
            tape.watch(w_values)
            out = ops.embedding_bag(TABLE, tf.RaggedTensor.from_row_splits(values, splits),
                                    tf.RaggedTensor.from_row_splits(w_values, w_splits))
            loss = tf.reduce_sum(out)
        return tape.gradient(loss, w_values)

    splits = tf.constant([0, 1, 3], tf.int64)
    got = d_weights(tf.constant([1, 2, 3]), splits, tf.ones([3]), splits)
    np.testing.assert_allclose(got.numpy(), TABLE[[1, 2, 3]].sum(axis=1), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=PARTITION):
        d_weights(tf.constant([1, 2, 3]), splits, tf.ones([3]), tf.constant([0, 0, 3], tf.int64))


@pytest.mark.parametrize("jit", [False, True, "traced_without_jit"])
def test_sparse_weights_at_other_positions_fail_under_jit(jit):
    """traced_without_jit: a concrete function traced without XLA (as a reloaded SavedModel is),
    called in a jit_compile function: XLA dropped its asserts and the weights of other positions
    were read as the ids' ([60, 70, 80] for bag 1); now the op refuses the bags, naming the mismatch."""
    layer = EmbeddingBag(10, 3)
    layer.build()
    layer.embeddings.assign(TABLE)
    ids = tf.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([1, 2, 3], tf.int64), [2, 2])
    same = tf.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([1.0, 10.0, 100.0]), [2, 2])
    moved = tf.SparseTensor([[0, 0], [1, 0], [1, 1]], tf.constant([1.0, 10.0, 100.0]), [2, 2])
    error = "sparse weights must hold an entry at each position"
    if jit == "traced_without_jit":
        traced = tf.function(lambda w: layer(ids, w)).get_concrete_function(tf.SparseTensorSpec([2, 2], tf.float32))
        call, error = tf.function(lambda w: traced(w), jit_compile=True), MISMATCH_UNDER_JIT
    else:
        call = tf.function(lambda w: layer(ids, w), jit_compile=jit)
    np.testing.assert_allclose(call(same).numpy(), bag_list(TABLE, [[1, 2], [3]], [[1.0, 10.0], [100.0]]),
                               rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=error):
        call(moved)


class _RaggedWeightedLookup(tf.Module):
    def __init__(self, table_kind):
        super().__init__()
        self.table_kind = table_kind
        if table_kind == "int8":
            self.table = quantized.quantize_table(TABLE)
        elif table_kind == "sharded":
            self.table = [tf.Variable(TABLE[:4]), tf.Variable(TABLE[4:])]
        else:
            self.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)] * 2 + [tf.TensorSpec([None], tf.float32),
                                                                          tf.TensorSpec([None], tf.int64)])
    def __call__(self, values, splits, w_values, w_splits):
        lookup = quantized.embedding_bag if self.table_kind == "int8" else ops.embedding_bag
        return lookup(self.table, tf.RaggedTensor.from_row_splits(values, splits),
                      tf.RaggedTensor.from_row_splits(w_values, w_splits))


@pytest.fixture(scope="module", params=["saved_model", "int8", "sharded"])
def reloaded_lookup(request, tmp_path_factory):
    """A graph traced without XLA: a reloaded SavedModel, or the concrete function of an int8 or
    sharded table's lookup (traced once, so a jit_compile function that calls it compiles that graph)."""
    if request.param == "saved_model":
        path = str(tmp_path_factory.mktemp("ragged_weights_saved_without_jit"))
        tf.saved_model.save(_RaggedWeightedLookup("float32"), path)
        return tf.saved_model.load(path), TABLE, None
    module = _RaggedWeightedLookup(request.param)
    table = quantized.dequantize(module.table).numpy() if request.param == "int8" else TABLE
    return module.__call__.get_concrete_function(), table, module  # the module keeps the variables


@pytest.mark.parametrize("jit", [False, True])
def test_saved_without_jit_ragged_weights_of_another_partition_fail_under_jit(reloaded_lookup, jit):
    """A SavedModel traced without XLA holds the partition check as an Assert, which XLA drops when
    a jit_compile function calls the reloaded model: the weights went silently into the ids' bags
    ([96, 107, 118] for bag 1). The op now gets the ids' row splits marked as mismatched there and fails
    naming the mismatch (until round 38 with "row_splits[0] must be 0, got -1")."""
    lookup, table, _ = reloaded_lookup
    call = tf.function(lambda *args: lookup(*args), jit_compile=jit)
    ids, splits, weights = tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1, 3], tf.int64), [1.0, 10.0, 100.0]
    np.testing.assert_allclose(call(ids, splits, tf.constant(weights), splits).numpy(),
                               bag_list(table, [[1], [2, 3]], [[1.0], [10.0, 100.0]]), rtol=1e-5)
    error = MISMATCH_UNDER_JIT if jit else PARTITION
    with pytest.raises(tf.errors.InvalidArgumentError, match=error):
        call(ids, splits, tf.constant(weights), tf.constant([0, 2, 3], tf.int64))
