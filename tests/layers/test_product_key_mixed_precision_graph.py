"""ProductKeyMemory under mixed_bfloat16 / mixed_float16 in a tf.function (Keras' predict, fit, evaluate
run one): grappler fused the query projection's 16-bit MatMul and bias add into one op that rounds once,
where eager TF, JAX and PyTorch round the product and the sum each; the query moved by an ulp and the
product-key search picked other slots for 33 of 256 rows of a trained model (outputs up to 0.17 apart),
predict disagreeing with model(x) and with the same .keras file under JAX / PyTorch. The projection now
rounds each op in a graph too: its query is the numpy emulation of 16-bit ops (to float32 accumulation)."""
import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.layers import ProductKeyMemory

HALF = {"mixed_bfloat16": ml_dtypes.bfloat16, "mixed_float16": np.float16}


def _trained_model(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(3)
    x = keras.Input((32,))
    layer = ProductKeyMemory(v_dim=16, k_dim=16, n_keys=32, heads=4, knn=8)
    model = keras.Model(x, layer(x))
    rng = np.random.default_rng(1)
    features = rng.normal(size=(256, 32)).astype("float32")
    layer.query_proj.set_weights([rng.normal(size=w.shape).astype("float32") * 0.3
                                  for w in layer.query_proj.get_weights()])
    # Moving statistics away from (0, 1), as after fit.
    layer.query_bn.set_weights([rng.uniform(0.5, 1.5, size=(64,)), rng.normal(size=(64,)) * 0.1,
                                rng.normal(size=(64,)), rng.uniform(0.5, 2.0, size=(64,))])
    return model, layer, features


def _half_query(layer, features, half):
    """The query projection as 16-bit ops: the product of the rounded inputs and kernel (exact in
    float64) rounded once, then the rounded bias added and the sum rounded."""
    kernel, bias = (np.asarray(w, np.float64) for w in layer.query_proj.get_weights())
    x = features.astype(half).astype(np.float64)
    product = (x @ kernel.astype(half).astype(np.float64)).astype(half).astype(np.float64)
    return (product + bias.astype(half).astype(np.float64)).astype(half).astype(np.float64)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_query_in_a_graph_is_the_16_bit_emulation(policy):
    model, layer, features = _trained_model(policy)
    graph = tf.function(lambda x: layer.query_proj(x))(tf.constant(features))
    want = _half_query(layer, features, HALF[policy])
    got = np.asarray(tf.cast(graph, tf.float64))
    off = got != want
    # float32 accumulation may land across a 16-bit rounding boundary from float64's: one ulp, rarely
    # (a fused MatMul and bias add put 28% of the values an ulp off).
    ulp = np.spacing(want.astype(HALF[policy])).astype(np.float64)
    assert off.sum() <= got.size // 1000, f"{off.sum()} of {got.size} query values off the 16-bit emulation"
    assert np.all(np.abs(got - want)[off] <= ulp[off]), "a query value more than an ulp off"


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_predict_picks_the_slots_of_the_eager_call(policy):
    model, _, features = _trained_model(policy)
    eager = np.asarray(tf.cast(model(features), tf.float32))
    predicted = model.predict(features, verbose=0, batch_size=64).astype(np.float32)
    rows = np.abs(predicted - eager).max(axis=-1) > 0
    assert rows.sum() == 0, f"{rows.sum()} of {len(rows)} rows differ (max {np.abs(predicted - eager).max()})"
