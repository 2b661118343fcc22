"""The fused TF op against independent references: a float64 numpy
implementation for the forward, the stock-TF composite (autodiff) and finite
differences for the gradients."""

import itertools
import zlib

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import _library, ops
from tests import reference

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
RTOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def to_np(x):
    return tf.cast(x, tf.float32).numpy().astype(np.float64)


def assert_close(actual, expected, dtype_name, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = 1.0 + np.abs(expected)
    err = np.max(np.abs(actual - expected) / scale) if actual.size else 0.0
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert err <= RTOL[dtype_name], f"{what}: max relative error {err:.3g} > {RTOL[dtype_name]}"


def random_case(rng, lead_shape, k, n, d, dtype, index_dtype, padding=True):
    params = tf.cast(rng.standard_normal((n, d)), dtype)
    idx = rng.integers(0, n, size=lead_shape + (k,))
    if padding and idx.size:
        idx[rng.random(idx.shape) < 0.15] = -1
        idx.reshape(-1, k)[0, :] = -1  # one bag entirely padding
    weights = rng.uniform(0.1, 1.0, size=idx.shape)
    return params, tf.constant(idx, index_dtype), tf.cast(weights, dtype)


CASES = list(itertools.product(
    DTYPES, ("int32", "int64"), ops.WEIGHTED_COMBINERS, (True, False), ((7,), (3, 5), (2, 3, 4))))


@pytest.mark.parametrize("dtype_name,index_dtype,combiner,weighted,lead_shape", CASES)
def test_forward_and_gradients_match_references(dtype_name, index_dtype, combiner, weighted, lead_shape):
    # A seed fixed per case (hash() of strings changes between processes).
    rng = np.random.default_rng(zlib.crc32(repr((dtype_name, index_dtype, combiner, weighted, lead_shape)).encode()))
    dtype = DTYPES[dtype_name]
    lead = lead_shape[:-1] if len(lead_shape) > 1 else ()
    # rank-1 indices ([K]) for the (7,) case: a single bag
    k = lead_shape[-1]
    params, indices, weights = random_case(rng, lead, k, n=40, d=16, dtype=dtype, index_dtype=index_dtype)
    w = weights if weighted else None

    params_var = tf.Variable(params)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(weights)
        fused = ops.embedding_bag(params_var, indices, w, combiner)
        composite = ops.embedding_bag_composite(params_var, indices, w, combiner)
        upstream = tf.cast(tf.reshape(tf.range(tf.size(fused)) % 7, fused.shape), fused.dtype) - 3
        loss_fused = tf.reduce_sum(tf.cast(fused * upstream, tf.float32))
        loss_composite = tf.reduce_sum(tf.cast(composite * upstream, tf.float32))

    assert fused.dtype == dtype and fused.shape == indices.shape[:-1] + [16]
    flat_idx = indices.numpy().reshape(-1, k)
    flat_w = None if w is None else to_np(weights).reshape(-1, k)
    expected = reference.bag_list(to_np(params), flat_idx.tolist(), flat_w, combiner)
    assert_close(to_np(fused).reshape(-1, 16), expected, dtype_name, "forward")

    d_fused = tape.gradient(loss_fused, [params_var, weights])
    d_comp = tape.gradient(loss_composite, [params_var, weights])
    assert isinstance(d_fused[0], tf.Tensor), "d_params must be dense, not IndexedSlices"
    assert_close(to_np(d_fused[0]), to_np(tf.convert_to_tensor(d_comp[0])), dtype_name, "d_params")
    if weighted:
        assert_close(to_np(d_fused[1]), to_np(d_comp[1]), dtype_name, "d_weights")
    else:
        assert d_fused[1] is None


@pytest.mark.parametrize("combiner", ops.WEIGHTED_COMBINERS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("ragged_rank", [1, 2])
def test_ragged_bags(combiner, dtype_name, ragged_rank):
    rng = np.random.default_rng(7)
    dtype = DTYPES[dtype_name]
    params = tf.Variable(tf.cast(rng.standard_normal((30, 8)), dtype))
    bags = [list(rng.integers(-1, 30, size=rng.integers(0, 6))) for _ in range(9)]
    bags[2] = []  # empty bag
    wts = [list(rng.uniform(0.1, 1, size=len(b))) for b in bags]
    indices = tf.ragged.constant(bags, dtype=tf.int64)
    weights = tf.ragged.constant(wts, dtype=tf.float32)
    if ragged_rank == 2:
        indices = tf.RaggedTensor.from_row_lengths(indices, [4, 0, 5])
        weights = tf.RaggedTensor.from_row_lengths(weights, [4, 0, 5])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(weights.flat_values)
        fused = ops.embedding_bag(params, indices, weights, combiner)
        composite = ops.embedding_bag_composite(params, indices, weights, combiner)
        lf = tf.reduce_sum(tf.cast(fused.flat_values if ragged_rank == 2 else fused, tf.float32) ** 2)
        lc = tf.reduce_sum(tf.cast(composite.flat_values if ragged_rank == 2 else composite, tf.float32) ** 2)
    got = fused.flat_values if ragged_rank == 2 else fused
    expected = reference.bag_list(to_np(params), bags, [np.float32(x).tolist() for x in wts], combiner)
    # weights were cast to the table dtype by the op: compare with those values
    w_cast = [to_np(tf.cast(tf.constant(x, tf.float32), dtype)).tolist() for x in wts]
    expected = reference.bag_list(to_np(params), bags, w_cast, combiner)
    assert_close(to_np(got), expected, dtype_name, "ragged forward")
    assert np.all(to_np(got)[2] == 0), "empty bag must give zeros"
    gf = tape.gradient(lf, [params, weights.flat_values])
    gc = tape.gradient(lc, [params, weights.flat_values])
    assert_close(to_np(gf[0]), to_np(tf.convert_to_tensor(gc[0])), dtype_name, "ragged d_params")
    assert_close(to_np(gf[1]), to_np(gc[1]), dtype_name, "ragged d_weights")


def test_ragged_outer_dims_with_uniform_bags():
    params = tf.random.normal([20, 4])
    values = tf.constant(np.random.default_rng(0).integers(0, 20, (5, 3)))
    indices = tf.RaggedTensor.from_row_lengths(values, [2, 3])
    out = ops.embedding_bag(params, indices)
    expected = ops.embedding_bag_composite(params, indices)
    assert isinstance(out, tf.RaggedTensor)
    np.testing.assert_allclose(out.flat_values.numpy(), expected.flat_values.numpy(), rtol=1e-5)


@pytest.mark.parametrize("combiner", ops.WEIGHTED_COMBINERS)
def test_finite_difference_gradients(combiner):
    rng = np.random.default_rng(3)
    params = tf.constant(rng.standard_normal((6, 5)), tf.float32)
    indices = tf.constant([[0, 2, 2, -1], [5, 1, 0, 3]])
    weights = tf.constant(rng.uniform(0.5, 1.5, (2, 4)), tf.float32)
    theoretical, numerical = tf.test.compute_gradient(
        lambda p, w: ops.embedding_bag(p, indices, w, combiner), [params, weights], delta=1e-2)
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, atol=2e-3, rtol=2e-2)


def test_gradient_inside_tf_function_is_dense_and_trains():
    table = tf.Variable(tf.random.normal([100, 8], seed=1))
    opt = tf.keras.optimizers.SGD(0.1)
    indices = tf.constant(np.random.default_rng(1).integers(0, 100, (16, 4)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(table, indices, combiner="mean") ** 2)
        grad = tape.gradient(loss, table)
        opt.apply_gradients([(grad, table)])
        return loss, grad

    first, grad = step()
    assert isinstance(grad, tf.Tensor) and grad.shape == (100, 8)
    for _ in range(20):
        last, _ = step()
    assert last < 0.5 * first


def test_autocast_variable_under_mixed_precision():
    import keras  # a pinned dependency (tensorflow 2.21 ships with Keras 3)

    class TableLayer(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(10, 4), initializer="ones", name="table")

        def call(self, indices, weights):
            return ops.embedding_bag(self.table, indices, weights)

    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = TableLayer()
        with tf.GradientTape() as tape:
            out = layer(tf.constant([[1, 2, 3]]), tf.constant([[0.5, 0.25, 0.25]]))
            loss = tf.reduce_sum(tf.cast(out, tf.float32))
        assert out.dtype == tf.float16  # the float32 variable was read autocast
        np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), np.ones((1, 4)))
        (grad,) = tape.gradient(loss, layer.trainable_variables)
        expected = np.zeros((10, 4))
        expected[1], expected[2], expected[3] = 0.5, 0.25, 0.25
        np.testing.assert_allclose(tf.cast(grad, tf.float32).numpy(), expected)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_empty_inputs():
    params = tf.random.normal([5, 3])
    out = ops.embedding_bag(params, tf.zeros([4, 0], tf.int32))
    assert out.shape == (4, 3) and np.all(out.numpy() == 0)
    out = ops.embedding_bag(params, tf.zeros([0, 6], tf.int64), tf.zeros([0, 6]))
    assert out.shape == (0, 3)


# ---- bad input: clear errors, never a crash ---------------------------------

def test_out_of_range_index_names_position_and_value():
    params = tf.random.normal([10, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[5\] = 12 is out of range \[0, 10\)"):
        ops.embedding_bag(params, tf.constant([[0, 1, 2], [3, 4, 12]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"out of range"):
        ops.embedding_bag(params, tf.ragged.constant([[1], [99, 2]]))


def test_out_of_range_in_graph_mode_and_gradient():
    params = tf.Variable(tf.random.normal([10, 4]))

    @tf.function
    def f(i):
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(ops.embedding_bag(params, i))
        return tape.gradient(y, params)

    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        f(tf.constant([[1, 10]]))
    lib = ops.load_library()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 10"):
        lib.pkm_embedding_bag_grad(tf.ones([1, 4]), params, tf.constant([[1, 10]]), tf.ones([1, 2]))


def test_shape_and_dtype_errors():
    params = tf.random.normal([10, 4])
    idx = tf.constant([[1, 2]])
    lib = ops.load_library()
    with pytest.raises(ValueError, match="params must be a"):
        ops.embedding_bag(tf.random.normal([10, 4, 2]), idx)
    with pytest.raises(ValueError, match="rank >= 1"):
        ops.embedding_bag(params, tf.constant(3))
    with pytest.raises(ValueError, match="weights shape"):
        ops.embedding_bag(params, idx, tf.ones([1, 3]))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.embedding_bag(tf.zeros([10, 4], tf.float64), idx)
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.embedding_bag(params, tf.constant([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="combiner must be one of"):
        ops.embedding_bag(params, idx, combiner="min")
    # The raw op (what a graph or another front end feeds) checks too.
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="weights must have the shape|Shapes"):
        lib.pkm_embedding_bag(params, idx, tf.ones([2, 1]))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank 2|matrix"):
        lib.pkm_embedding_bag(tf.ones([10]), idx, tf.ones([1, 2]))
    with pytest.raises((tf.errors.InvalidArgumentError, TypeError, ValueError), match="combiner|not in list"):
        lib.pkm_embedding_bag(params, idx, tf.ones([1, 2]), combiner="min")
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-decreasing"):
        lib.pkm_ragged_embedding_bag(params, tf.constant([1, 2, 3]), tf.constant([0, 2, 1, 3], tf.int64),
                                     tf.ones([3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="number of values"):
        lib.pkm_ragged_embedding_bag(params, tf.constant([1, 2, 3]), tf.constant([0, 2, 5], tf.int64),
                                     tf.ones([3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_splits"):
        lib.pkm_ragged_embedding_bag(params, tf.constant([1, 2, 3]), tf.constant([1, 2, 3], tf.int64),
                                     tf.ones([3]))


def test_ragged_weights_must_partition_like_indices():
    params = tf.random.normal([10, 4])
    indices = tf.ragged.constant([[1, 2], [3]])
    shifted = tf.ragged.constant([[1.0], [2.0, 3.0]])  # same 3 values, other bags
    for fn in (ops.embedding_bag, ops.embedding_bag_composite):
        with pytest.raises(ValueError, match="row partition of the indices"):  # as TF's lookup
            fn(params, indices, shifted)
    with pytest.raises(TypeError, match="RaggedTensor"):
        ops.embedding_bag(params, indices, tf.ones([3]))


def test_unused_weights_input_must_be_empty():
    lib = ops.load_library()
    params = tf.random.normal([10, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be empty"):
        lib.pkm_embedding_bag(params, tf.constant([[1, 2]]), tf.ones([1, 2]), has_weights=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be empty"):
        lib.pkm_embedding_bag_grad(tf.ones([1, 4]), params, tf.constant([[1, 2]]), tf.ones([1, 2]),
                                   has_weights=False)
    d_params, d_weights = lib.pkm_embedding_bag_grad(tf.ones([1, 4]), params, tf.constant([[1, 2]]),
                                                     tf.zeros([0]), has_weights=False)
    assert d_weights.shape == (0,)
    expected = np.zeros((10, 4))
    expected[[1, 2]] = 1.0
    np.testing.assert_array_equal(d_params.numpy(), expected)


def test_missing_library_error_is_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("PKM_SERVE_OPS_LIB", str(tmp_path / "nope.so"))
    monkeypatch.setattr(_library, "_lib", None)
    with pytest.raises(ops.OpLibraryNotFoundError, match="make build"):
        ops.load_library()
    assert not ops.is_available()


# ---- tables over 2^31 elements ----------------------------------------------

@pytest.mark.slow
@pytest.mark.large
def test_table_over_2_pow_31_elements_forward_and_backward():
    """float16 table of 2^28 + 8 rows x 8 = 2^31 + 64 elements (4 GB): rows past
    element 2^31 are read and their gradients written at the right place."""
    n, d = 2**28 + 8, 8
    high_rows = np.array([n - 1, n - 5, 2**28, 3], np.int64)  # offsets up to ~2^31 + 56
    values = (np.arange(len(high_rows) * d, dtype=np.float32).reshape(-1, d) % 13 + 1) / 8
    # The rows are set before the variable exists: a scatter into the variable would put it
    # in copy-on-read mode, and every read would then copy the 4 GB (~5 s of CPU).
    table = tf.Variable(tf.scatter_nd(high_rows[:, None], tf.constant(values, tf.float16), [n, d]))
    indices = tf.constant([[n - 1, 3, -1], [2**28, n - 5, n - 1]], tf.int64)
    weights = tf.constant([[1.0, 2.0, 5.0], [0.5, 1.0, 0.25]], tf.float16)
    upstream = tf.constant(np.arange(2 * d, dtype=np.float32).reshape(2, d) / 16, tf.float16)
    with tf.GradientTape() as tape:
        tape.watch(weights)
        out = ops.embedding_bag(table, indices, weights)
        loss = tf.reduce_sum(tf.cast(out * upstream, tf.float32))
    d_table, d_weights = tape.gradient(loss, [table, weights])

    rows = {r: values[i] for i, r in enumerate(high_rows)}
    expected = np.stack([1.0 * rows[n - 1] + 2.0 * rows[3],
                         0.5 * rows[2**28] + 1.0 * rows[n - 5] + 0.25 * rows[n - 1]])
    np.testing.assert_allclose(to_np(out), expected, rtol=1e-2)

    g = to_np(upstream)
    expected_rows = {n - 1: 1.0 * g[0] + 0.25 * g[1], 3: 2.0 * g[0], 2**28: 0.5 * g[1], n - 5: 1.0 * g[1]}
    got = to_np(tf.gather(d_table, list(expected_rows)))
    np.testing.assert_allclose(got, np.stack(list(expected_rows.values())), rtol=1e-2)
    # Nothing else was written: the extremes of the whole gradient are those rows' extremes.
    all_expected = np.concatenate([np.stack(list(expected_rows.values())).ravel(), [0.0]])
    assert float(tf.reduce_max(d_table)) == pytest.approx(all_expected.max(), rel=1e-2)
    assert float(tf.reduce_min(d_table)) == pytest.approx(all_expected.min(), rel=1e-2, abs=1e-3)
    np.testing.assert_allclose(to_np(d_weights)[0], [g[0] @ rows[n - 1], g[0] @ rows[3], 0.0], rtol=1e-2)


@pytest.mark.slow
@pytest.mark.large
def test_sparse_gradient_of_a_table_of_2_pow_31_rows_or_more_names_its_rows():
    """float16 table of 2^31 + 8 rows x 1 (4 GB): the row-sparse gradient's dense_shape is the
    table's shape. An int32 one (as tf.gather's, for tf.cond) wrapped to -2147483640 for a
    variable and failed ("Shape output type is 32-bit") for a tensor."""
    n = 2**31 + 8
    table = tf.Variable(tf.zeros([n, 1], tf.float16))
    ids = tf.constant([[n - 1, 3]], tf.int64)
    for params in (table, tf.convert_to_tensor(table)):
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss = tf.reduce_sum(tf.cast(ops.embedding_bag(params, ids, sparse_gradient=True), tf.float32))
        grad = tape.gradient(loss, params)
        assert isinstance(grad, tf.IndexedSlices)
        assert grad.dense_shape.numpy().tolist() == list(table.shape)   # the reference: [n, 1]
        assert sorted(grad.indices.numpy().tolist()) == [3, n - 1]
