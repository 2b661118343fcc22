"""Keras 3's own `.tflite` export, `model.export(path, format="litert")`, of a model with the fused
PKM and EmbeddingBag layers (TF backend): with `allow_custom_ops=True` (passed on to the converter)
the file runs in LiteRT with the pkm_serve delegate and gives the model's outputs; without it the
converter refuses the custom op, as README's TFLite section says. Reference: the Keras model."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")


@pytest.fixture(scope="module")
def model():
    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras' litert export of the fused op runs under the TensorFlow backend")
    keras.utils.set_random_seed(35)
    x, ids = keras.Input((16,), name="x"), keras.Input((5,), dtype="int32", name="ids")
    pkm = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=16, heads=2, knn=4, query_batchnorm=True)(x)
    bag = EmbeddingBag(40, 8, combiner="mean")(ids)
    return keras.Model([x, ids], keras.layers.Dense(3)(keras.layers.Concatenate()([pkm, bag])))


def test_litert_export_with_custom_ops_runs_with_the_delegate(model, tmp_path):
    from pkm_serve import tflite
    rng = np.random.default_rng(1)
    features = rng.normal(size=(6, 16)).astype("float32")
    ids = rng.integers(-1, 40, size=(6, 5)).astype("int32")
    want = model.predict([features, ids], verbose=0)
    path = str(tmp_path / "model.tflite")
    model.export(path, format="litert", verbose=False, allow_custom_ops=True)
    got = tflite.run_tflite(path, {"x": features, "ids": ids})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_litert_export_without_custom_ops_names_the_op(model, tmp_path):
    with pytest.raises(Exception, match="PkmEmbeddingBag' op is neither a custom op nor a flex op"):
        model.export(str(tmp_path / "model.tflite"), format="litert", verbose=False)
