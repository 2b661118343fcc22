"""Keras mixed precision's Permute((2, 1)) + channels_first pooling: the Embedding's float16 rows transposed to
[B, D, K], then GlobalAveragePooling1D casts them to float32 before its mean (Cast after the Transpose). It was
reported ("a cast after the transpose is not fused"); the cast commutes with the transpose, so the site is the
mixed-precision mean of the rows as gathered. One Keras model (mean and max pooling, each on its own Permute),
exported once; outputs against numpy float64 and the Keras model."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import K, N, RNG, TABLE

D = TABLE.shape[1]
HALF_TOLERANCE = 2e-3  # float16 rows and output


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import keras
    from pkm_serve.export import export_saved_model
    tmp_path = tmp_path_factory.mktemp("transposed_half")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inp = keras.Input(shape=(K,), dtype="int32", name="ids")
        emb = keras.layers.Embedding(N, D, name="emb")
        channels_first = [keras.layers.Permute((2, 1))(emb(inp)) for _ in range(2)]
        model = keras.Model(inp, keras.layers.Concatenate()([
            keras.layers.GlobalAveragePooling1D(data_format="channels_first")(channels_first[0]),
            keras.layers.GlobalMaxPooling1D(data_format="channels_first")(channels_first[1])]))
        emb.embeddings.assign(TABLE)
        model.export(str(tmp_path / "m"), format="tf_saved_model", verbose=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    ids = RNG.integers(0, N, (4, K)).astype(np.int32)
    fused_model, original_model = tf.saved_model.load(result.dst), tf.saved_model.load(str(tmp_path / "m"))
    fused, original = fused_model.serve(ids).numpy(), original_model.serve(ids).numpy()
    rows = TABLE.astype(np.float64)[ids]
    return result, original, fused, np.concatenate([rows.mean(1), rows.max(1)], 1)


def test_permuted_half_rows_pooled_in_float32_are_fused(exported):
    result = exported[0]
    assert sorted((s.status, s.combiner) for s in result.sites) == [("fused", "max"), ("fused", "mean")], \
        [s.reason for s in result.sites]
    # the mean of the rows in float32 without their float16 rounding (as without the Permute)
    assert [(s.cast_to, s.rounded_to) for s in result.sites if s.combiner == "mean"] == [("float32", "float16")]


def test_permuted_half_rows_pooled_compute_the_bags(exported):
    _, original, fused, expected = exported
    assert fused.dtype == original.dtype == np.float16
    np.testing.assert_allclose(original.astype(np.float64), expected, rtol=HALF_TOLERANCE, atol=HALF_TOLERANCE)
    np.testing.assert_allclose(fused.astype(np.float64), expected, rtol=HALF_TOLERANCE, atol=HALF_TOLERANCE)
