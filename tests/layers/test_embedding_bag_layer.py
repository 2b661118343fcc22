"""EmbeddingBag layer: values, gradients, ragged bags, mixed precision, config, errors."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.layers import EmbeddingBag, OpLibraryUnavailableError
from tests.reference import combine_bag, embedding_bag

N, D = 50, 8


def make_layer(combiner="sum", implementation="fused", seed=0, **kwargs):
    layer = EmbeddingBag(
        N,
        D,
        combiner=combiner,
        embeddings_initializer=keras.initializers.RandomNormal(seed=seed),
        implementation=implementation,
        **kwargs,
    )
    layer.build()
    return layer


def random_bags(rng, shape, pad_fraction=0.2):
    indices = rng.integers(0, N, size=shape)
    indices[rng.random(shape) < pad_fraction] = -1  # padding
    weights = rng.uniform(0.1, 2.0, size=shape).astype(np.float32)
    return indices, weights


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 4)])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_dense_bags_match_numpy(combiner, shape, with_weights, index_dtype):
    rng = np.random.default_rng(1)
    layer = make_layer(combiner)
    indices, weights = random_bags(rng, shape)
    indices = indices.astype(index_dtype)
    weights = weights if with_weights else None
    out = layer(indices, weights=weights)
    assert out.shape == shape[:-1] + (D,) and out.dtype == tf.float32
    expected = embedding_bag(layer.embeddings.numpy(), indices, weights, combiner)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_ragged_bags_match_numpy(combiner, with_weights):
    rng = np.random.default_rng(2)
    layer = make_layer(combiner)
    lengths = [3, 0, 1, 7, 2]  # includes an empty bag
    rows = [rng.integers(-1, N, size=n) for n in lengths]
    row_weights = [rng.uniform(0.1, 2.0, size=n).astype(np.float32) for n in lengths]
    indices = tf.ragged.constant(rows, dtype=tf.int64)
    weights = tf.ragged.constant(row_weights, dtype=tf.float32) if with_weights else None
    out = layer(indices, weights=weights)
    table = layer.embeddings.numpy()
    expected = np.stack(
        [
            combine_bag(table, r, w if with_weights else None, combiner)
            for r, w in zip(rows, row_weights)
        ]
    )
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.numpy()[1], 0.0)


def _shuffled_sparse(dense, present, order):
    positions = np.argwhere(present)[order]
    return tf.sparse.SparseTensor(positions, dense[tuple(positions.T)], dense.shape)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_sparse_ids_read_the_entries_present(combiner):
    """[batch, K] tf.SparseTensor ids (a VarLenFeature's, keras.Input(sparse=True)), in any entry order,
    with sparse weights: each bag holds the entries present, as tf.nn.embedding_lookup_sparse reads
    them; eager, in a model and under XLA (it raised "Attempt to convert a value (SparseTensor ...)")."""
    rng = np.random.default_rng(8)
    layer = make_layer(combiner)
    ids, weights = rng.integers(0, N, size=(7, 5)), rng.uniform(0.1, 2.0, size=(7, 5)).astype(np.float32)
    present = rng.random(ids.shape) < 0.6
    present[2] = False  # an empty bag
    order = rng.permutation(int(present.sum()))
    sparse_ids, sparse_weights = _shuffled_sparse(ids, present, order), _shuffled_sparse(weights, present, order)
    expected = embedding_bag(layer.embeddings.numpy(), np.where(present, ids, -1), weights, combiner)
    inputs = [keras.Input((5,), dtype="int64", sparse=True), keras.Input((5,), sparse=True)]
    model = keras.Model(inputs, layer(inputs[0], weights=inputs[1]))
    xla = tf.function(lambda i, w: layer(i, weights=w), jit_compile=True)
    for how, out in (("eager", layer(sparse_ids, weights=sparse_weights)),
                     ("model", model([sparse_ids, sparse_weights])), ("xla", xla(sparse_ids, sparse_weights))):
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=how)
    unweighted = embedding_bag(layer.embeddings.numpy(), np.where(present, ids, -1), None, combiner)
    np.testing.assert_allclose(layer(sparse_ids).numpy(), unweighted, rtol=1e-5, atol=1e-6)
    elsewhere = _shuffled_sparse(weights, np.roll(present, 1, axis=1), order)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sparse weights must hold an entry at each position"):
        layer(sparse_ids, weights=elsewhere)
    with pytest.raises(ValueError, match=r"SparseTensor indices must be \[batch, K\] \(rank 2\)"):
        layer(tf.sparse.from_dense(ids.reshape(7, 5, 1)))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_gradients_in_tf_function_match_composite(combiner):
    rng = np.random.default_rng(6)
    lengths = [4, 1, 0, 6]
    indices = tf.RaggedTensor.from_row_lengths(
        rng.integers(-1, N, size=sum(lengths)), tf.constant(lengths, tf.int64)
    )
    weights = indices.with_flat_values(tf.constant(rng.uniform(0.1, 2.0, sum(lengths)), tf.float32))
    fused, composite = make_layer(combiner), make_layer(combiner, implementation="composite")
    composite.embeddings.assign(fused.embeddings.numpy())
    upstream = tf.constant(rng.standard_normal((len(lengths), D)), tf.float32)

    def grads(layer):
        @tf.function
        def step(indices, weights):
            with tf.GradientTape() as tape:
                tape.watch(weights.flat_values)
                loss = tf.reduce_sum(layer(indices, weights=weights) * upstream)
            return tape.gradient(loss, [layer.embeddings.value, weights.flat_values])

        return [tf.convert_to_tensor(g).numpy() for g in step(indices, weights)]

    (d_table, d_weights), (d_table_ref, d_weights_ref) = grads(fused), grads(composite)
    np.testing.assert_allclose(d_table, d_table_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_weights, d_weights_ref, rtol=1e-5, atol=1e-6)
    assert np.abs(d_weights).sum() > 0


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_gradients_match_composite(combiner):
    """Fused and composite layers with the same table give the same dense gradients."""
    rng = np.random.default_rng(3)
    indices, weights = random_bags(rng, (7, 6))
    fused, composite = make_layer(combiner), make_layer(combiner, implementation="composite")
    composite.embeddings.assign(fused.embeddings.numpy())
    upstream = tf.constant(rng.standard_normal((7, D)), tf.float32)

    def grads(layer):
        w = tf.constant(weights)
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum(layer(indices, weights=w) * upstream)
        return tape.gradient(loss, [layer.embeddings.value, w])

    (d_table, d_weights), (d_table_ref, d_weights_ref) = grads(fused), grads(composite)
    assert isinstance(d_table, tf.Tensor), "the table gradient must be dense, not IndexedSlices"
    np.testing.assert_allclose(d_table.numpy(), tf.convert_to_tensor(d_table_ref).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_weights.numpy(), d_weights_ref.numpy(), rtol=1e-5, atol=1e-6)
    assert np.abs(d_table.numpy()).sum() > 0 and np.abs(d_weights.numpy()).sum() > 0


def test_trains_inside_a_functional_model():
    rng = np.random.default_rng(4)
    indices_in = keras.Input((5,), dtype="int32")
    weights_in = keras.Input((5,))
    out = EmbeddingBag(N, D, combiner="mean")(indices_in, weights=weights_in)
    model = keras.Model([indices_in, weights_in], keras.layers.Dense(1)(out))
    assert model.output_shape == (None, 1)
    indices, weights = random_bags(rng, (64, 5))
    target = rng.standard_normal((64, 1)).astype(np.float32)
    model.compile(keras.optimizers.Adam(0.05), "mse")
    before = model.evaluate([indices, weights], target, verbose=0)
    model.fit([indices, weights], target, epochs=30, batch_size=64, verbose=0)
    after = model.evaluate([indices, weights], target, verbose=0)
    assert after < 0.5 * before


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float16", "bfloat16"])
def test_precision_policies_forward_and_backward(policy):
    rng = np.random.default_rng(5)
    indices, weights = random_bags(rng, (9, 6))
    reference_layer = make_layer("mean")
    table = reference_layer.embeddings.numpy()
    keras.config.set_dtype_policy(policy)
    layer = make_layer("mean")
    layer.embeddings.assign(table)  # rounds to half under the pure policies
    compute_dtype = tf.as_dtype(layer.compute_dtype)
    with tf.GradientTape() as tape:
        out = layer(indices, weights=weights)  # float32 weights: cast inside
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    (d_table,) = tape.gradient(loss, [layer.embeddings.value])
    assert out.dtype == compute_dtype
    assert d_table.dtype == tf.as_dtype(layer.variable_dtype)
    expected = embedding_bag(table, indices, weights, "mean")
    tolerance = 2e-2 if "bfloat16" in policy else 2e-3
    np.testing.assert_allclose(out.numpy().astype(np.float32), expected, atol=tolerance, rtol=tolerance)
    d_expected = _mean_table_grad_numpy(2.0 * expected, indices, weights)
    np.testing.assert_allclose(
        d_table.numpy().astype(np.float32), d_expected, atol=4 * tolerance, rtol=4 * tolerance
    )


def _mean_table_grad_numpy(upstream, indices, weights):
    d_table = np.zeros((N, D))
    for bag_idx, bag_w, g in zip(indices, weights, upstream):
        valid = bag_idx >= 0
        w_sum = bag_w[valid].sum()
        for index, weight in zip(bag_idx[valid], bag_w[valid]):
            d_table[index] += weight / w_sum * g
    return d_table


def test_out_of_range_index_is_a_clear_error():
    layer = make_layer()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"70 .*out of range|out of range.*70"):
        layer(np.array([[1, 70, 2]]))


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="combiner"):
        EmbeddingBag(N, D, combiner="min")
    with pytest.raises(ValueError, match="input_dim"):
        EmbeddingBag(0, D)
    with pytest.raises(ValueError, match="implementation"):
        EmbeddingBag(N, D, implementation="fast")
    with pytest.raises(ValueError, match="fallback"):
        EmbeddingBag(N, D, fallback="dense")
    layer = make_layer()
    with pytest.raises(TypeError, match="integers"):
        layer(tf.constant([["a", "b"]]))
    with pytest.raises(ValueError, match="shape of indices"):
        layer(np.array([[1, 2, 3]]), weights=np.ones((1, 2), np.float32))


def test_float_indices_are_cast_like_keras_embedding():
    layer = make_layer()
    indices = np.array([[1, 2, 3]])
    np.testing.assert_array_equal(layer(indices.astype(np.float32)).numpy(), layer(indices).numpy())


def test_pretrained_rows_are_taken_as_keras_embedding_takes_them(tmp_path):
    """EmbeddingBag(N, D, weights=[matrix]) starts from those rows, as keras.layers.Embedding does
    (it was Keras' "Unrecognized keyword arguments passed to EmbeddingBag"); as there, the rows are
    not in get_config, and a .keras file carries them."""
    matrix = np.random.default_rng(11).normal(size=(N, D)).astype(np.float32)
    indices = np.array([[1, 2, -1], [4, 4, 0]])
    expected = embedding_bag(matrix, indices, combiner="mean")
    for given in ([matrix], matrix):
        layer = EmbeddingBag(N, D, combiner="mean", weights=given, trainable=False)
        np.testing.assert_allclose(layer(indices).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert "weights" not in layer.get_config()
    ids = keras.Input((3,), dtype="int32")
    keras.Model(ids, layer(ids)).save(tmp_path / "bag.keras")
    np.testing.assert_allclose(keras.models.load_model(tmp_path / "bag.keras")(indices).numpy(), expected,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        EmbeddingBag(N + 1, D, weights=[matrix])


def test_missing_op_library_is_a_clear_error_unless_fallback(monkeypatch):
    def missing():
        raise ops.OpLibraryNotFoundError("pkm_serve op library not found at /nowhere/_pkm_ops.so")

    monkeypatch.setattr(ops, "load_library", missing)
    with pytest.raises(OpLibraryUnavailableError, match=r"make build.*fallback='composite'"):
        EmbeddingBag(N, D)
    with pytest.warns(RuntimeWarning, match="composite"):
        layer = EmbeddingBag(N, D, fallback="composite")
    indices = np.array([[1, 2, -1], [4, 4, 4]])
    out = layer(indices)
    expected = embedding_bag(layer.embeddings.numpy(), indices)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_config_round_trip_keeps_initializer_regularizer_constraint():
    layer = EmbeddingBag(
        N,
        D,
        combiner="sqrtn",
        embeddings_initializer=keras.initializers.RandomUniform(-0.5, 0.5, seed=7),
        embeddings_regularizer=keras.regularizers.L2(0.01),
        embeddings_constraint=keras.constraints.MaxNorm(1.0),
        fallback="composite",
    )
    clone = EmbeddingBag.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert isinstance(clone.embeddings_constraint, keras.constraints.MaxNorm)
    clone.build()
    table = clone.embeddings.numpy()
    assert table.min() >= -0.5 and table.max() <= 0.5
    clone(np.array([[1, 2]]))
    (penalty,) = clone.losses
    np.testing.assert_allclose(float(penalty), 0.01 * np.sum(table.astype(np.float64) ** 2), rtol=1e-5)


TF_KERAS_CHILD = """
import numpy as np
import tensorflow as tf
import keras
from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
def refused(build):
    try:
        build()
    except TypeError as err:
        assert "tf_keras" in str(err) and "Keras 3" in str(err), err
        return
    raise AssertionError("accepted with tf_keras")

refused(lambda: EmbeddingBag(10, 4)(tf.keras.Input((3,), dtype="int32")))
refused(lambda: ProductKeyMemory(v_dim=4, k_dim=4, n_keys=4, heads=1, knn=2)(tf.keras.Input((8,))))

class Legacy(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.bag = EmbeddingBag(10, 4)
    def call(self, ids):
        return self.bag(ids)

refused(lambda: Legacy()(np.zeros((2, 3), "int32")))
model = keras.Sequential([keras.Input((3,), dtype="int32"), EmbeddingBag(10, 4)])  # Keras 3 still works
assert len(model.trainable_weights) == 1 and model(np.zeros((2, 3), "int32")).shape == (2, 4)
"""


def test_tf_keras_models_are_refused():
    """Under TF_USE_LEGACY_KERAS=1 a tf_keras Input made the layers TFOpLambda layers with the table
    baked in, untrained: a TypeError names tf_keras (a fresh process: the flag is read at TF import)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("tf_keras")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=root)
    env.pop("KERAS_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", TF_KERAS_CHILD], cwd=root, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
