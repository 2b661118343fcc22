"""After a sparse update the table stays readable without a copy.

A scatter update leaves a TF resource variable in copy-on-read mode, where every dense read
(ReadVariableOp, which the plain bag op's inference graphs use) copies the whole table. The
project's optimizers (LazyAdam and RowwiseAdagrad on row-sparse gradients, the fused update)
switch the variables they write back to copy-on-write, so that model.predict after training
reads the table in place. Whether a read copies is observed directly: two reads that are alive
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
