"""quantized.embedding_bag argument checks. Given tf.SparseTensor ids or weights (a VarLenFeature's, as
tf.nn.embedding_lookup_sparse takes them) it raises the float op's TypeError naming the ragged form
to pass; it was TF's conversion ValueError ("Attempt to convert a value (SparseTensor(...")
naming neither the argument nor a way out. The ragged form it names gives the bags of a float64
dequantize-then-sum reference. An output_dtype without a kernel is a TypeError naming it."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import quantized

N, D = 12, 5


def _table():
    values, scales, biases = quantized.quantize_rows(np.random.default_rng(3).normal(size=(N, D)))
    return quantized.QuantizedTable(values, scales, biases)


def _sparse_ids():
    return tf.sparse.SparseTensor(indices=[[0, 0], [0, 2], [2, 1]], values=tf.constant([4, 7, 11], tf.int64),
                                  dense_shape=[3, 3])


def test_sparse_ids_are_a_type_error_naming_the_ragged_form():
    with pytest.raises(TypeError, match=r"indices is a tf\.SparseTensor.*RaggedTensor\.from_value_rowids"):
        quantized.embedding_bag(_table(), _sparse_ids())


def test_sparse_weights_are_a_type_error_naming_them():
    ids = tf.ragged.constant([[4, 7], [], [11]], tf.int64)
    weights = tf.sparse.from_dense(tf.constant([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]))
    with pytest.raises(TypeError, match=r"weights is a tf\.SparseTensor"):
        quantized.embedding_bag(_table(), ids, weights)


def test_the_ragged_form_named_gives_the_sparse_bags():
    table, ids = _table(), tf.sparse.reorder(_sparse_ids())
    ragged = tf.RaggedTensor.from_value_rowids(ids.values, ids.indices[:, 0], nrows=ids.dense_shape[0])
    got = quantized.embedding_bag(table, ragged).numpy()
    rows = table.values * table.row_scales[:, None].astype(np.float64) + table.row_biases[:, None]
    want = np.stack([rows[4] + rows[7], np.zeros(D), rows[11]])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("output_dtype", [tf.float64, tf.int32])
def test_an_output_dtype_the_op_has_no_kernel_for_is_a_type_error_naming_it(output_dtype):
    """It was the op's InvalidArgumentError about its attr 'T', an argument the caller never saw."""
    with pytest.raises(TypeError, match=f"output_dtype must be float32, float16 or bfloat16, got {output_dtype.name}"):
        quantized.embedding_bag(_table(), np.array([[1, 2]]), output_dtype=output_dtype)


@pytest.mark.parametrize("output_dtype", [tf.float16, tf.bfloat16])
def test_half_output_dtypes_give_the_float32_bags_rounded(output_dtype):
    table, ids = _table(), np.array([[1, 2, -1], [3, 3, 3]])
    got = quantized.embedding_bag(table, ids, output_dtype=output_dtype)
    want = quantized.embedding_bag(table, ids)
    assert got.dtype == output_dtype
    np.testing.assert_array_equal(got.numpy(), tf.cast(want, output_dtype).numpy())
