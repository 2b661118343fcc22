"""Row-sparse gradients (sparse_gradient=True) and sharded tables, against a
float64 numpy reference of the table gradient and against the dense op."""

import itertools
import zlib

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import bag_forward_backward

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
RTOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / (1.0 + np.abs(b)))) if a.size else 0.0


def densify(g):
    return tf.cast(tf.convert_to_tensor(g), tf.float32).numpy()


def grads(fn, table, weights, d_out):
    with tf.GradientTape() as tape:
        tape.watch([table, weights])
        out = fn()
    return tape.gradient(out, [table, weights], output_gradients=tf.cast(d_out, out.dtype))


CASES = list(itertools.product(DTYPES, ("int32", "int64"), ops.WEIGHTED_COMBINERS, (True, False), ("dense", "ragged")))


@pytest.mark.parametrize("dtype_name,index_dtype,combiner,weighted,layout", CASES)
def test_sparse_gradient_densifies_to_dense_and_reference(dtype_name, index_dtype, combiner, weighted, layout):
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, index_dtype, combiner, weighted, layout)).encode()))
    dtype, n, d = DTYPES[dtype_name], 97, 12
    table = tf.cast(rng.standard_normal((n, d)), dtype)
    if layout == "dense":
        idx = rng.integers(0, n, size=(9, 6))
        idx[rng.random(idx.shape) < 0.2] = -1
        idx[0, :] = -1  # an all-padding bag
        idx[1, :3] = 5  # a repeated row
        bags = [list(r) for r in idx]
        indices = tf.constant(idx, index_dtype)
        w_np = rng.uniform(0.1, 1.0, size=idx.shape)
        weights = tf.cast(w_np, dtype)
        w_bags = list(w_np)
        call_w = weights if weighted else None
    else:
        bags = [list(rng.integers(-1, n, size=rng.integers(0, 8))) for _ in range(10)]
        bags[2] = []
        indices = tf.ragged.constant(bags, dtype=index_dtype, ragged_rank=1, inner_shape=())
        indices = tf.RaggedTensor.from_row_splits(tf.cast(indices.flat_values, index_dtype), indices.row_splits)
        w_bags = [rng.uniform(0.1, 1.0, size=len(b)) for b in bags]
        weights = tf.RaggedTensor.from_row_splits(tf.cast(np.concatenate(w_bags), dtype), indices.row_splits)
        call_w = weights if weighted else None
    d_out = rng.standard_normal((len(bags), d))
    w_tensor = weights.flat_values if layout == "ragged" else weights

    def run(sparse):
        with tf.GradientTape() as tape:
            tape.watch([table, w_tensor])
            out = ops.embedding_bag(table, indices, call_w, combiner, sparse_gradient=sparse)
        return tape.gradient(out, [table, w_tensor], output_gradients=tf.cast(d_out, out.dtype))

    (g_sparse, dw_sparse), (g_dense, dw_dense) = run(True), run(False)
    assert isinstance(g_sparse, tf.IndexedSlices)
    valid = np.array([i for b in bags for i in b if i >= 0], np.int64)
    rows = g_sparse.indices.numpy()
    np.testing.assert_array_equal(rows, np.unique(valid))  # each touched row once, ascending
    assert len(rows) <= min(n, len(valid))
    assert g_sparse.values.dtype == dtype and g_sparse.values.shape == (len(rows), d)
    assert rel_err(densify(g_sparse), densify(g_dense)) <= RTOL[dtype_name]
    _, ref, _ = bag_forward_backward(tf.cast(table, tf.float32).numpy(), bags, w_bags if weighted else None,
                                     combiner, d_out)
    assert rel_err(densify(g_sparse), ref) <= RTOL[dtype_name] * 4
    if weighted:
        assert rel_err(densify(dw_sparse), densify(dw_dense)) <= RTOL[dtype_name]
    else:
        assert dw_sparse is None and dw_dense is None


def test_sparse_gradient_rows_never_exceed_touched_rows_on_hot_rows():
    # 4096 lookups of 3 distinct rows: an IndexedSlices of B*K rows would hold 4096.
    n, d = 1 << 16, 4
    table = tf.Variable(tf.random.normal([n, d], seed=1))
    idx = tf.constant(np.tile([[7, 7, 65535, 9]], (1024, 1)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ops.embedding_bag(table, idx, sparse_gradient=True))
    g = tape.gradient(loss, table)
    np.testing.assert_array_equal(g.indices.numpy(), [7, 9, 65535])
    np.testing.assert_allclose(g.values.numpy(), np.array([[2048.0], [1024.0], [1024.0]]) * np.ones((1, d)))


def test_sparse_gradient_in_tf_function_and_all_padding():
    table = tf.Variable(tf.ones([10, 3]))

    @tf.function
    def step(idx):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(table, idx, combiner="mean", sparse_gradient=True))
        return tape.gradient(loss, table)

    g = step(tf.constant([[1, 2], [2, -1]]))
    np.testing.assert_array_equal(g.indices.numpy(), [1, 2])
    np.testing.assert_allclose(g.values.numpy(), [[0.5] * 3, [1.5] * 3])
    g = step(tf.constant([[-1, -1], [-1, -1]]))
    assert g.indices.shape == (0,) and g.values.shape == (0, 3)


def test_sparse_grad_op_rejects_bad_inputs():
    lib = ops.load_library()
    table, idx, w = tf.ones([5, 2]), tf.constant([[0, 1]]), tf.ones([1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must have the forward output's shape"):
        lib.pkm_embedding_bag_sparse_grad(tf.ones([2, 2]), table, idx, w, combiner="sum", has_weights=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 5 is out of range"):
        lib.pkm_embedding_bag_sparse_grad(tf.ones([1, 2]), table, tf.constant([[0, 5]]), w,
                                          combiner="sum", has_weights=True)


# ---- sharded tables ------------------------------------------------------------

@pytest.mark.parametrize("combiner,weighted,layout", list(itertools.product(
    ops.WEIGHTED_COMBINERS, (True, False), ("dense", "ragged", "rank3"))))
def test_sharded_table_equals_unsharded(combiner, weighted, layout):
    # A seed fixed per case (hash() of a str changes with each process's PYTHONHASHSEED).
    rng = np.random.default_rng(zlib.crc32(f"{combiner}-{weighted}-{layout}".encode()))
    n, d = 50, 6
    full = rng.standard_normal((n, d)).astype(np.float32)
    table = tf.Variable(full)
    shards = [tf.Variable(full[:17]), tf.Variable(full[17:18]), tf.Variable(full[18:])]
    if layout == "ragged":
        bags = [list(rng.integers(-1, n, size=rng.integers(0, 7))) for _ in range(8)]
        indices = tf.ragged.constant(bags, dtype=tf.int64)
        weights = tf.ragged.constant([list(rng.uniform(0.1, 1, len(b))) for b in bags], dtype=tf.float32)
        w_flat = weights.flat_values
    else:
        shape = (8, 5) if layout == "dense" else (2, 4, 5)
        indices = tf.constant(rng.integers(-1, n, size=shape))
        weights = tf.constant(rng.uniform(0.1, 1, size=shape).astype(np.float32))
        w_flat = weights
    call_w = weights if weighted else None
    for sparse in (False, True):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(w_flat)
            ref = ops.embedding_bag(table, indices, call_w, combiner)
            out = ops.embedding_bag(shards, indices, call_w, combiner, sparse_gradient=sparse)
            ref_loss, loss = tf.reduce_sum(ref * ref), tf.reduce_sum(out * out)
        assert rel_err(out, ref) <= 1e-5
        g_ref, dw_ref = tape.gradient(ref_loss, [table, w_flat])
        *g_shards, dw = tape.gradient(loss, shards + [w_flat])
        if sparse:
            assert all(isinstance(g, tf.IndexedSlices) for g in g_shards if g is not None)
        g = np.concatenate([densify(g) if g is not None else np.zeros(s.shape, np.float32)
                            for g, s in zip(g_shards, shards)])
        assert rel_err(g, densify(g_ref)) <= 1e-5
        if weighted:
            # mean/sqrtn's d_weights subtract two float32 dot products (g.row - g.out), whose
            # sums the sharded and unsharded ops add in different orders: up to 7.6e-6 over
            # 60 random draws, 1.5e-5 once.
            assert rel_err(dw, dw_ref) <= 1e-4


def test_sharded_variable_and_errors():
    from tensorflow.python.distribute import sharded_variable

    full = np.arange(40, dtype=np.float32).reshape(10, 4)
    sv = sharded_variable.ShardedVariable([tf.Variable(full[:5], name="s0"), tf.Variable(full[5:], name="s1")])
    assert ops.is_sharded(sv)
    idx = tf.constant([[0, 9, -1], [4, 5, 5]])
    np.testing.assert_allclose(ops.embedding_bag(sv, idx, combiner="mean").numpy(),
                               ops.embedding_bag(full, idx, combiner="mean").numpy(), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = 10 is out of range \[0, 10\)"):
        ops.embedding_bag(sv, tf.constant([[10]]))
    with pytest.raises(ValueError, match="same width"):
        ops.embedding_bag([tf.ones([2, 3]), tf.ones([2, 4])], idx)
    with pytest.raises(TypeError, match="share one dtype"):
        ops.embedding_bag([tf.ones([2, 4]), tf.ones([2, 4], tf.float16)], idx)
    assert ops.is_sharded([np.ones((2, 4)), np.ones((3, 4))])
    # A nested list of numbers is one table, not shards.
    assert not ops.is_sharded([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_allclose(ops.embedding_bag([[1.0, 2.0], [3.0, 4.0]], [[0, 1]]).numpy(), [[4.0, 6.0]])


@pytest.mark.parametrize("combiner,dtype_name", list(itertools.product(ops.WEIGHTED_COMBINERS, DTYPES)))
def test_variable_table_reads_in_kernel_and_matches_tensor_path(combiner, dtype_name):
    # A variable under a tape goes through PkmResourceEmbeddingBag (no dense
    # read, which copies the table once the variable has had a sparse update).
    rng = np.random.default_rng(5)
    dtype = DTYPES[dtype_name]
    init = tf.cast(rng.standard_normal((30, 4)), dtype).numpy()
    var = tf.Variable(init)
    var.scatter_sub(tf.IndexedSlices(tf.zeros([1, 4], dtype), tf.constant([0])))  # copy-on-read mode from here on
    idx = tf.constant(rng.integers(-1, 30, size=(6, 5)))
    w = tf.cast(rng.uniform(0.1, 1, size=(6, 5)), dtype)

    @tf.function
    def via_variable():
        with tf.GradientTape() as tape:
            tape.watch(w)
            out = ops.embedding_bag(var, idx, w, combiner, sparse_gradient=True)
            loss = tf.reduce_sum(out * out)
        ops_used = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
        assert "PkmResourceEmbeddingBag" in ops_used and "ReadVariableOp" not in ops_used
        return (out,) + tuple(tape.gradient(loss, [var, w]))

    out, g, dw = via_variable()
    table = tf.constant(init)
    with tf.GradientTape() as tape:
        tape.watch([table, w])
        ref = ops.embedding_bag(table, idx, w, combiner, sparse_gradient=True)
        ref_loss = tf.reduce_sum(ref * ref)
    g_ref, dw_ref = tape.gradient(ref_loss, [table, w])
    assert out.dtype == dtype and g.values.dtype == dtype
    np.testing.assert_array_equal(densify(out), densify(ref))  # the same kernel on the same bytes
    np.testing.assert_array_equal(g.indices.numpy(), g_ref.indices.numpy())
    np.testing.assert_array_equal(densify(g.values), densify(g_ref.values))
    np.testing.assert_array_equal(densify(dw), densify(dw_ref))
    # Without a tape (inference, export) the plain op reads the variable.
    assert "PkmResourceEmbeddingBag" not in {
        op.type for op in tf.function(lambda: ops.embedding_bag(var, idx, sparse_gradient=True))
        .get_concrete_function().graph.get_operations()}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = 30 is out of range"):
        with tf.GradientTape():
            ops.embedding_bag(var, tf.constant([[30]]), sparse_gradient=True)
