"""pkm_serve.export.quantize_tables(model, dst) of a tf_keras (Keras 2) model, whose
model.export takes only the path: it raised TypeError ("unexpected keyword argument 'format'")
from both of its attempts; now it exports and quantizes as for Keras 3, the result within the
tolerance of the tf_keras model's own predictions. Something that is no Keras model is one
ExportError (it was an AttributeError)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import ExportError, quantize_tables

tf_keras = pytest.importorskip("tf_keras")
N, D, K = 300, 16, 5


def test_a_tf_keras_model_is_quantized(tmp_path, capsys):
    tf_keras.utils.set_random_seed(3)
    ids_in = tf_keras.Input(shape=(K,), dtype="int32", name="ids")
    pooled = tf_keras.layers.GlobalAveragePooling1D()(tf_keras.layers.Embedding(N, D)(ids_in))
    model = tf_keras.Model(ids_in, tf_keras.layers.Dense(3)(pooled))
    ids = np.random.default_rng(0).integers(0, N, size=(16, K)).astype(np.int32)
    want = model.predict(ids, verbose=0)
    result = quantize_tables(model, str(tmp_path / "q"), quiet=True)
    assert "Endpoint" not in capsys.readouterr().out  # tf_keras' own listing is not printed
    assert result.quantization["variables_bytes_after"] < 0.5 * result.quantization["variables_bytes_before"]
    serve = tf.saved_model.load(result.dst).signatures["serving_default"]
    got = next(iter(serve(tf.constant(ids)).values())).numpy()
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_something_that_is_no_keras_model_is_an_export_error(tmp_path):
    with pytest.raises(ExportError, match="model must be a Keras model .* got str"):
        quantize_tables("model.keras", str(tmp_path / "q"))
