"""After a sparse update the table stays readable without a copy.

A scatter update leaves a TF resource variable in copy-on-read mode, where every dense read
(ReadVariableOp, which the plain bag op's inference graphs use) copies the whole table. The
project's optimizers (LazyAdam and RowwiseAdagrad on row-sparse gradients, the fused update)
switch the variables they write back to copy-on-write, and a table read with
sparse_gradient=True has its scatter methods wrapped to do the same for stock Keras
optimizers, so that model.predict after training reads the table in place. Whether a read copies is observed directly: two reads that are alive
at once share one buffer (DLPack data pointers) exactly when the variable does not copy on read.
"""

import ctypes

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import optimizers
from pkm_serve.layers import EmbeddingBag
from tests.reference import bag_forward_backward

ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _data_pointer(tensor):
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    managed = ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor")
    return ctypes.cast(managed, ctypes.POINTER(ctypes.c_void_p))[0]  # DLTensor.data comes first


def _reads_copy(variable):
    from tensorflow.python.ops import gen_resource_variable_ops

    first = gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)
    second = gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)
    return _data_pointer(first) != _data_pointer(second)


def test_the_probe_sees_copy_on_read():
    # The premise: a raw scatter update makes TF copy on every read; nothing of ours undoes it.
    table = tf.Variable(np.ones((50, 8), np.float32))
    assert not _reads_copy(table)
    table.scatter_add(tf.IndexedSlices(tf.ones((1, 8)), tf.constant([3])))
    assert _reads_copy(table)


@pytest.mark.parametrize("optimizer, fused", [("lazy_adam", False), ("rowwise_adagrad", False),
                                              ("lazy_adam", True)])
def test_predict_after_sparse_training_reads_the_table_in_place(optimizer, fused):
    n, d, k, b = 300, 16, 5, 32
    rng = np.random.default_rng(3)
    layer = EmbeddingBag(n, d, sparse_gradient=not fused, fused_optimizer=fused)
    inputs = keras.Input((k,), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    opt = optimizers.LazyAdam(0.05) if optimizer == "lazy_adam" else optimizers.RowwiseAdagrad(0.5)
    model.compile(optimizer=opt, loss="mse")
    x = rng.integers(0, n, (b, k)).astype(np.int32)
    y = rng.standard_normal((b, d)).astype(np.float32)
    before = layer.embeddings.numpy().copy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    table = layer.embeddings.value
    after = table.numpy()
    assert not np.array_equal(after, before), "training did not move the table"
    assert not _reads_copy(table), "the table copies on every read after training"
    # And predict reads the trained table (float64 reference of the bag sums).
    got = model.predict_on_batch(x)
    want = bag_forward_backward(after.astype(np.float64), x.tolist(), None, "sum", np.zeros((b, d)))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not _reads_copy(table)


def _fit_bag_model(optimizer, sparse_gradient, table, x, y):
    layer = EmbeddingBag(table.shape[0], table.shape[1], sparse_gradient=sparse_gradient)
    inputs = keras.Input((x.shape[1],), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    layer.embeddings.assign(table)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, layer


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_stock_keras_optimizers_leave_the_sparse_table_read_in_place(optimizer):
    # Stock Keras optimizers apply a row-sparse gradient with scatter_sub / scatter_add; the
    # layer's table switches back to copy-on-write after each one, and trains as a dense one does.
    n, d, k, b = 300, 16, 5, 32
    rng = np.random.default_rng(5)
    table = rng.standard_normal((n, d)).astype(np.float32)
    x = rng.integers(0, n, (b, k)).astype(np.int32)
    y = rng.standard_normal((b, d)).astype(np.float32)
    model, layer = _fit_bag_model(keras.optimizers.get(optimizer), True, table, x, y)
    _, dense_layer = _fit_bag_model(keras.optimizers.get(optimizer), False, table, x, y)
    after = layer.embeddings.numpy()
    assert not np.array_equal(after, table), "training did not move the table"
    np.testing.assert_allclose(after, dense_layer.embeddings.numpy(), rtol=1e-5, atol=1e-6)
    assert not _reads_copy(layer.embeddings.value), "the table copies on every read after training"
    got = model.predict_on_batch(x)
    want = bag_forward_backward(after.astype(np.float64), x.tolist(), None, "sum", np.zeros((b, d)))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not _reads_copy(layer.embeddings.value)


@pytest.mark.parametrize("built_in_trace", [False, True])
def test_a_custom_loop_with_a_stock_optimizer_leaves_the_table_read_in_place(built_in_trace):
    # built_in_trace: the layer's first call (and its table's creation) inside the traced step, where
    # tf.function makes the variable an UnliftedInitializerVariable.
    n, d, k = 200, 8, 4
    rng = np.random.default_rng(6)
    layer = EmbeddingBag(n, d, combiner="mean", sparse_gradient=True)
    optimizer = keras.optimizers.SGD(0.1)
    x = tf.constant(rng.integers(0, n, (16, k)), tf.int32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(layer(x)))
        grads = tape.gradient(loss, layer.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))

    if built_in_trace:
        step()
    else:
        layer(x)
    before = layer.embeddings.numpy()
    step()
    step()
    assert not np.array_equal(layer.embeddings.numpy(), before)
    assert not _reads_copy(layer.embeddings.value)


def test_inference_graphs_of_a_sparse_trained_layer_still_freeze():
    # The switch lives beside the scatter in the training graph only: the variable freezer
    # (TFLite conversion, export) cannot rewrite a DisableCopyOnRead of a frozen variable.
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    n, d, k, b = 120, 8, 3, 16
    rng = np.random.default_rng(7)
    x = rng.integers(0, n, (b, k)).astype(np.int32)
    model, layer = _fit_bag_model(keras.optimizers.SGD(0.5), True,
                                  rng.standard_normal((n, d)).astype(np.float32), x,
                                  rng.standard_normal((b, d)).astype(np.float32))
    serve = tf.function(lambda ids: model(ids, training=False)).get_concrete_function(
        tf.TensorSpec([None, k], tf.int32))
    assert "DisableCopyOnRead" not in {op.type for op in serve.graph.get_operations()}
    frozen = convert_variables_to_constants_v2(serve)
    np.testing.assert_allclose(frozen(tf.constant(x))[0].numpy(), model.predict_on_batch(x),
                               rtol=1e-6, atol=1e-6)


def test_the_op_on_a_variable_with_a_sparse_gradient_and_a_stock_optimizer():
    from pkm_serve import ops

    rng = np.random.default_rng(8)
    table = tf.Variable(rng.standard_normal((100, 8)).astype(np.float32))
    x = tf.constant(rng.integers(0, 100, (12, 3)), tf.int32)
    optimizer = keras.optimizers.Adagrad(0.1)
    want = table.numpy().astype(np.float64)
    accumulator = np.full_like(want, 0.1)  # Keras Adagrad's initial_accumulator_value
    d_out = np.ones((12, 8))
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(table, x, sparse_gradient=True))
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices)
        optimizer.apply_gradients([(grad, table)])
        d_table = bag_forward_backward(want, x.numpy().tolist(), None, "sum", d_out)[1]
        accumulator += d_table ** 2
        want -= 0.1 * d_table / np.sqrt(accumulator + 1e-7)
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-5, atol=1e-6)
    assert not _reads_copy(table)


class _TableLayer(keras.layers.Layer):
    """A user's own layer: its Keras variable straight into the op."""

    def __init__(self, n, d, sparse_gradient, **kwargs):
        super().__init__(**kwargs)
        self.n, self.d, self.sparse_gradient = n, d, sparse_gradient

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.n, self.d), initializer="uniform", name="table")

    def call(self, indices):
        from pkm_serve import ops

        return ops.embedding_bag(self.table, indices, sparse_gradient=self.sparse_gradient)


def test_the_op_on_a_keras_variable_with_a_sparse_gradient_and_a_stock_optimizer():
    n, d, k, b = 300, 16, 5, 32
    rng = np.random.default_rng(9)
    table = rng.standard_normal((n, d)).astype(np.float32)
    x = rng.integers(0, n, (b, k)).astype(np.int32)
    y = rng.standard_normal((b, d)).astype(np.float32)
    trained = {}
    for sparse in (True, False):
        layer = _TableLayer(n, d, sparse)
        inputs = keras.Input((k,), dtype="int32")
        model = keras.Model(inputs, layer(inputs))
        layer.table.assign(table)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        assert isinstance(tape.gradient(loss, layer.table), tf.IndexedSlices) == sparse
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        trained[sparse] = layer.table.numpy()
        if sparse:
            assert not _reads_copy(layer.table.value), "the table copies on every read after training"
    assert not np.array_equal(trained[True], table)
    np.testing.assert_allclose(trained[True], trained[False], rtol=1e-5, atol=1e-6)
