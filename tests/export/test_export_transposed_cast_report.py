"""Keras mixed precision's Embedding -> Permute((2, 1)) -> GlobalAveragePooling1D(channels_first) casts the
permuted float16 rows to float32 before the mean: left composite, its reason told the user to apply "a
multiplier or mask" before the transpose, which the model has none of; it now names the cast. The exported
model still computes the original's outputs."""
import numpy as np
import tensorflow as tf

from round34_forms import D, K, N, TABLE


def test_keras_mixed_precision_permute_pooling_is_reported_as_a_cast_after_the_transpose(tmp_path):
    import keras
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inp = keras.Input(shape=(K,), dtype="int32", name="ids")
        emb = keras.layers.Embedding(N, D, name="emb")
        pooled = keras.layers.GlobalAveragePooling1D(data_format="channels_first")(keras.layers.Permute((2, 1))(
            emb(inp)))
        model = keras.Model(inp, pooled)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    emb.embeddings.assign(TABLE)
    model.export(str(tmp_path / "m"), format="tf_saved_model", verbose=False)
    from pkm_serve.export import export_saved_model
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    [site] = result.sites
    assert site.status != "fused" and "then cast before the reduction" in site.reason, site.reason
    assert "multiplier or mask" not in site.reason
    ids = np.random.default_rng(3).integers(0, N, (4, K)).astype(np.int32)
    loaded = tf.saved_model.load(result.dst)
    got = loaded.serve(ids).numpy()
    np.testing.assert_array_equal(got, model(ids).numpy())
    np.testing.assert_allclose(got, TABLE.astype(np.float16).astype(np.float64)[ids].mean(1), rtol=1e-2, atol=1e-3)
