"""quantized.quantize_table of a row-sharded table (a ShardedVariable, as ParameterServerStrategy's
variable_partitioner makes, or a list of [N_i, D] shards, as ops.embedding_bag takes them): one
int8 table of the shards' rows in order ("div" partitioning), whose bags match ops.embedding_bag
over the float shards within the quantisation bound and a numpy float64 dequantize-then-sum
exactly. It was a ValueError ("table must be [N, D], got shape ()" for a ShardedVariable, or
"(2, 10, 6)" for equal list shards; unequal ones failed in numpy)."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

from pkm_serve import ops, quantized

D = 6
ROWS = (7, 13, 4)


def _shards():
    rng = np.random.default_rng(11)
    return [rng.normal(size=(n, D)).astype(np.float32) for n in ROWS]


@pytest.mark.parametrize("form", ["sharded_variable", "list_of_variables", "list_of_arrays"])
def test_a_sharded_table_quantizes_to_its_rows_in_order(form):
    shards = _shards()
    table = {"sharded_variable": lambda: sharded_variable.ShardedVariable([tf.Variable(s) for s in shards]),
             "list_of_variables": lambda: [tf.Variable(s) for s in shards],
             "list_of_arrays": lambda: shards}[form]()
    q = quantized.quantize_table(table)
    whole = np.concatenate(shards).astype(np.float64)
    assert q.values.shape == whole.shape
    dequantized = q.values.numpy() * q.row_scales.numpy()[:, None].astype(np.float64) + q.row_biases.numpy()[:, None]
    assert np.all(np.abs(dequantized - whole) <= q.row_scales.numpy()[:, None] / 2 * (1 + 1e-6))

    ids = np.random.default_rng(2).integers(-1, sum(ROWS), size=(9, 4))
    got = quantized.embedding_bag(q, ids, combiner="mean").numpy()
    valid = ids >= 0
    want = np.stack([dequantized[row[ok]].mean(axis=0) if ok.any() else np.zeros(D)
                     for row, ok in zip(ids, valid)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    float_bags = ops.embedding_bag(table, tf.constant(ids), combiner="mean").numpy()
    assert np.abs(got - float_bags).max() <= q.row_scales.numpy().max()
