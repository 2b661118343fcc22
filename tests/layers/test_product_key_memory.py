"""ProductKeyMemory: matches an independent numpy PKM, fused == composite, gradients, precision."""
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.layers import EmbeddingBag, OpLibraryUnavailableError, ProductKeyMemory
from tests.reference import product_key_memory

D_MODEL = 24
SMALL = dict(v_dim=20, k_dim=16, n_keys=12, heads=3, knn=5)


def make_pkm(implementation="fused", seed=0, x_shape=(None, D_MODEL), **overrides):
    config = dict(SMALL, **overrides)
    keras.utils.set_random_seed(seed)
    layer = ProductKeyMemory(implementation=implementation, **config)
    layer.build(x_shape)
    return layer


def randomise_batchnorm(layer, rng):
    """Non-trivial inference statistics so the reference exercises the BN maths."""
    bn = layer.query_bn
    width = layer.heads * layer.k_dim
    bn.moving_mean.assign(rng.normal(0, 0.3, width).astype(np.float32))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, width).astype(np.float32))
    bn.gamma.assign(rng.uniform(0.5, 1.5, width).astype(np.float32))
    bn.beta.assign(rng.normal(0, 0.1, width).astype(np.float32))


def copy_weights(source, target):
    for src, dst in zip(source.weights, target.weights):
        assert src.path.split("/", 1)[1] == dst.path.split("/", 1)[1]
        dst.assign(src.numpy())


@pytest.mark.parametrize("query_batchnorm", [True, False])
@pytest.mark.parametrize("x_shape", [(10, D_MODEL), (2, 3, D_MODEL)])
def test_matches_numpy_reference(query_batchnorm, x_shape):
    rng = np.random.default_rng(0)
    layer = make_pkm(query_batchnorm=query_batchnorm)
    if query_batchnorm:
        randomise_batchnorm(layer, rng)
    x = rng.standard_normal(x_shape).astype(np.float32)
    out = layer(x, training=False)
    assert out.shape == x_shape[:-1] + (SMALL["v_dim"],)
    np.testing.assert_allclose(out.numpy(), product_key_memory(layer, x), rtol=1e-4, atol=1e-5)


def test_tied_scores_pick_the_lowest_slots_eager_and_under_xla():
    """A zero input row on a fresh layer ties every key score: TF's top_k(sorted=False) kept
    other slots eagerly than under XLA (and JAX, PyTorch, .tflite); both now take the lowest."""
    layer = make_pkm()
    x = np.random.default_rng(1).standard_normal((4, D_MODEL)).astype(np.float32)
    x[0] = x[2] = 0.0
    want = product_key_memory(layer, x)
    eager = layer(x, training=False).numpy()
    xla = tf.function(lambda v: layer(v, training=False), jit_compile=True)(x).numpy()
    np.testing.assert_allclose(eager, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(xla, want, rtol=1e-4, atol=1e-5)


def test_mask_passes_through_so_a_masked_mean_ignores_the_padding_length():
    """Embedding(mask_zero=True) -> ProductKeyMemory -> GlobalAveragePooling1D: the mask reaches the
    mean (the layer dropped it: the result changed with the padding length)."""
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(30, D_MODEL, mask_zero=True)
    layer = ProductKeyMemory(**SMALL)
    ids = np.array([[3, 5, 0, 0], [1, 2, 3, 4], [7, 0, 0, 0]], np.int32)
    outs = []
    for length in (4, 9):
        inputs = keras.Input((length,), dtype="int32")
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(layer(embedding(inputs))))
        outs.append(model(np.pad(ids, ((0, 0), (0, length - 4)))).numpy())
    per_token = product_key_memory(layer, embedding.embeddings.numpy()[ids])  # [3, 4, v_dim]
    want = np.stack([per_token[i, ids[i] != 0].mean(0) for i in range(len(ids))])
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outs[1], want, rtol=1e-4, atol=1e-5)


def test_masked_rows_stay_out_of_the_query_batchnorm():
    """Training: the batch-norm moments (so the outputs and the moving mean) count unmasked rows only."""
    layer = make_pkm()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, D_MODEL)).astype(np.float32)
    mask = np.array([[True] * 4 + [False] * 2, [True] * 6])
    x[~mask] = 50.0  # padding content
    bn = layer.query_bn
    before = bn.moving_mean.numpy().astype(np.float64)
    kernel, bias = layer.query_proj.kernel.numpy(), layer.query_proj.bias.numpy()
    query_mean = (x[mask].astype(np.float64) @ kernel + bias).mean(0)
    out = layer(x, training=True, mask=mask).numpy()
    np.testing.assert_allclose(bn.moving_mean.numpy(), before * bn.momentum + query_mean * (1 - bn.momentum),
                               rtol=1e-5, atol=1e-6)
    unpadded = layer(x[mask], training=True).numpy()
    np.testing.assert_allclose(out[mask], unpadded, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "xla"])
def test_a_training_batch_of_padding_alone_keeps_the_moving_moments(jit):
    """Every row masked: no row to count, so the moving mean and variance stay (Keras' masked
    moments are 0 there, and the moving variance decayed 2.0 -> 1.98 per step); a later batch
    with rows moves them by the momentum rule over its unmasked rows."""
    layer = make_pkm()
    x = np.random.default_rng(5).standard_normal((2, 3, D_MODEL)).astype(np.float32)
    layer(x)
    bn = layer.query_bn
    bn.moving_mean.assign(np.full(bn.moving_mean.shape, 0.5, np.float32))
    bn.moving_variance.assign(np.full(bn.moving_variance.shape, 2.0, np.float32))
    call = tf.function(lambda x, m: layer(x, training=True, mask=m), jit_compile=jit)
    call(x, np.zeros((2, 3), bool))
    np.testing.assert_array_equal(bn.moving_mean.numpy(), 0.5)
    np.testing.assert_array_equal(bn.moving_variance.numpy(), 2.0)
    mask = np.array([[True, False, False], [True, True, False]])
    call(x, mask)
    kernel, bias = layer.query_proj.kernel.numpy(), layer.query_proj.bias.numpy()
    query_mean = (x[mask].astype(np.float64) @ kernel + bias).mean(0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * bn.momentum + query_mean * (1 - bn.momentum),
                               rtol=1e-5, atol=1e-6)


def test_v_dim_defaults_to_input_dim_and_paper_defaults():
    layer = ProductKeyMemory()
    assert (layer.n_keys, layer.heads, layer.knn, layer.k_dim) == (512, 4, 32, 128)
    layer.build((None, 32))
    assert layer.memory.embeddings.shape == (512 * 512, 32)
    assert layer.keys.shape == (4, 2, 512, 64)
    assert layer.compute_output_shape((None, 7, 32)) == (None, 7, 32)


def test_fused_equals_composite_and_gradients_reach_queries_keys_values():
    rng = np.random.default_rng(1)
    fused = make_pkm("fused")
    composite = make_pkm("composite", seed=1)
    copy_weights(fused, composite)
    x = tf.constant(rng.standard_normal((16, D_MODEL)), tf.float32)
    upstream = tf.constant(rng.standard_normal((16, SMALL["v_dim"])), tf.float32)

    def forward_and_grads(layer):
        watched = [layer.query_proj.kernel, layer.keys, layer.memory.embeddings]
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)  # batch statistics: BN gradient path too
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, [x] + [v.value for v in watched])
        return out, [tf.convert_to_tensor(g).numpy() for g in grads]

    out, grads = forward_and_grads(fused)
    out_ref, grads_ref = forward_and_grads(composite)
    np.testing.assert_allclose(out.numpy(), out_ref.numpy(), rtol=1e-5, atol=1e-6)
    for name, g, g_ref in zip(["input", "query kernel", "keys", "values"], grads, grads_ref):
        assert np.abs(g).sum() > 0, f"no gradient reaches the {name}"
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5, err_msg=name)
    # Only the selected slots of the value table get gradient.
    touched_rows = np.count_nonzero(np.abs(grads[3]).sum(axis=1))
    assert 0 < touched_rows <= 16 * SMALL["heads"] * SMALL["knn"]


def test_selected_slots_are_valid_and_weights_are_softmax():
    rng = np.random.default_rng(2)
    layer = make_pkm()
    query = tf.constant(rng.standard_normal((8, SMALL["heads"] * SMALL["k_dim"])), tf.float32)
    indices, weights = layer.select_slots(query)
    assert indices.dtype == tf.int64 and indices.shape == (8, SMALL["heads"] * SMALL["knn"])
    assert indices.numpy().min() >= 0 and indices.numpy().max() < SMALL["n_keys"] ** 2
    per_head = weights.numpy().reshape(8, SMALL["heads"], SMALL["knn"])
    np.testing.assert_allclose(per_head.sum(axis=-1), 1.0, rtol=1e-5)
    # within a head the knn slots are distinct
    for row in indices.numpy().reshape(8, SMALL["heads"], SMALL["knn"]).reshape(-1, SMALL["knn"]):
        assert len(set(row)) == SMALL["knn"]


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_forward_and_backward(policy):
    rng = np.random.default_rng(3)
    reference = make_pkm()
    x = rng.standard_normal((12, D_MODEL)).astype(np.float32)
    expected = reference(x, training=False).numpy()
    keras.config.set_dtype_policy(policy)
    layer = make_pkm()
    copy_weights(reference, layer)
    assert layer.memory.embeddings.dtype == "float32"  # stored in float32
    with tf.GradientTape() as tape:
        out = layer(x, training=False)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    variables = [layer.query_proj.kernel.value, layer.keys.value, layer.memory.embeddings.value]
    grads = tape.gradient(loss, variables)
    assert out.dtype == tf.as_dtype(layer.compute_dtype)
    for g in grads:
        g = tf.convert_to_tensor(g).numpy()
        assert g.dtype == np.float32 and np.isfinite(g).all() and np.abs(g).sum() > 0
    # Half-precision scores can reorder near-tied slots, so compare loosely on average.
    error = np.abs(out.numpy().astype(np.float32) - expected).mean() / np.abs(expected).mean()
    assert error < (0.05 if policy == "mixed_float16" else 0.15), error


def test_model_with_pkm_fits_under_mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((128, D_MODEL)).astype(np.float32)
    y = rng.standard_normal((128, SMALL["v_dim"])).astype(np.float32)
    inputs = keras.Input((D_MODEL,))
    outputs = keras.layers.Activation("linear", dtype="float32")(ProductKeyMemory(**SMALL)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")  # loss-scaled under mixed_float16
    history = model.fit(x, y, epochs=15, batch_size=32, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k_dim must be even"):
        ProductKeyMemory(k_dim=15)
    with pytest.raises(ValueError, match="knn"):
        ProductKeyMemory(n_keys=8, knn=9)
    with pytest.raises(ValueError, match="heads"):
        ProductKeyMemory(heads=0)


def test_missing_op_library_is_a_clear_error_unless_fallback(monkeypatch):
    def missing():
        raise ops.OpLibraryNotFoundError("pkm_serve op library not found at /nowhere/_pkm_ops.so")

    monkeypatch.setattr(ops, "load_library", missing)
    with pytest.raises(OpLibraryUnavailableError, match="make build"):
        ProductKeyMemory(**SMALL)
    with pytest.warns(RuntimeWarning, match="composite"):
        layer = ProductKeyMemory(fallback="composite", **SMALL)
    x = np.random.default_rng(5).standard_normal((4, D_MODEL)).astype(np.float32)
    np.testing.assert_allclose(
        layer(x).numpy(), product_key_memory(layer, x), rtol=1e-4, atol=1e-5
    )


def _fit_and_list_moved(model, layer):
    x = np.random.default_rng(0).standard_normal((32, 8)).astype("float32")
    y = np.random.default_rng(1).standard_normal((32, 8)).astype("float32")
    before = [v.numpy().copy() for v in layer.weights]
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    return [v.path for v, b in zip(layer.weights, before) if not np.array_equal(b, v.numpy())]


@pytest.mark.parametrize("how", ["constructor", "before_build", "reloaded"])
def test_a_frozen_layer_stays_frozen(how, tmp_path):
    # Its query projection, batch-norm and value table trained on (only `keys` stayed): Keras'
    # setter freezes sub-layers that exist, and these were made trainable in __init__ / build.
    layer = ProductKeyMemory(v_dim=8, k_dim=4, n_keys=8, heads=2, knn=3, name="pkm",
                             trainable=how != "constructor" and how != "reloaded")
    if how == "before_build":
        layer.trainable = False
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(8, name="head")(layer(inputs)))
    if how == "reloaded":
        model.get_layer("pkm").trainable = False
        model.save(tmp_path / "frozen.keras")
        model = keras.models.load_model(tmp_path / "frozen.keras")
        layer = model.get_layer("pkm")
    assert [v.path for v in model.trainable_weights] == ["head/kernel", "head/bias"]
    assert _fit_and_list_moved(model, layer) == []


def test_model_quantize_leaves_the_query_projection_alone():
    # Keras' int8 Dense made the search pick other slots: outputs moved by 20-44%.
    layer = ProductKeyMemory(v_dim=8, k_dim=4, n_keys=8, heads=2, knn=3)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, layer(inputs))
    x = np.random.default_rng(2).standard_normal((16, 8)).astype("float32")
    before = model.predict(x, verbose=0)
    with pytest.warns(UserWarning, match="query projection 'query_proj' is not quantized"):
        model.quantize("int8")
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)


def test_numpy_integer_sizes_are_taken_as_python_ints():
    # They were refused ("n_keys must be a positive integer, got np.int64(12)"); Keras' layers take
    # them. Kept as Python ints: an int32 n_keys * n_keys would wrap and a config must be JSON.
    sizes = {k: (np.int32 if k == "n_keys" else np.int64)(v) for k, v in SMALL.items()}
    layer = ProductKeyMemory(**sizes)
    x = np.random.default_rng(6).standard_normal((5, D_MODEL)).astype(np.float32)
    np.testing.assert_allclose(layer(x).numpy(), product_key_memory(layer, x), rtol=1e-4, atol=1e-5)
    config = layer.get_config()
    assert {k: type(config[k]) for k in SMALL} == {k: int for k in SMALL}
    json.dumps(config)
    bag = EmbeddingBag(np.int64(30), np.int32(4))
    assert (type(bag.input_dim), type(bag.output_dim)) == (int, int)
    with pytest.raises(ValueError, match="knn must be a positive integer"):
        ProductKeyMemory(knn=np.float32(4))


def test_a_scalar_input_is_a_clear_error():
    # It was an IndexError (tuple index out of range) from build.
    with pytest.raises(ValueError, match="min_ndim=1"):
        ProductKeyMemory(**SMALL)(np.float32(1.0))


def test_an_input_signature_with_an_unknown_last_dimension():
    """tf.function(input_signature=[TensorSpec([None, None])]): the layer reads the width it was built
    with (it was a TypeError converting [-1, None] to a tensor), and a wrong width at run time is an
    error naming d_model rather than a reshape into other rows."""
    rng = np.random.default_rng(3)
    layer = make_pkm()
    randomise_batchnorm(layer, rng)
    serve = tf.function(lambda x: layer(x, training=False),
                        input_signature=[tf.TensorSpec([None, None], tf.float32)])
    x = rng.standard_normal((7, D_MODEL)).astype(np.float32)
    out = serve(x)
    assert out.shape == (7, SMALL["v_dim"])
    np.testing.assert_allclose(out.numpy(), product_key_memory(layer, x), rtol=1e-4, atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"d_model = {D_MODEL}"):
        serve(rng.standard_normal((D_MODEL, D_MODEL // 2)).astype(np.float32))  # same size, other width
