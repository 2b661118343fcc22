"""`--tflite` on a model the stock TFLite converter itself mis-converts: the error
says the .tflite is non-finite where the SavedModel is finite and that the stock
converter's .tflite of the original (unfused) model is too, instead of blaming
the fused op ("fused differs from original by up to inf"); the same where the
garbage it reads happens to be finite (4.5e+26 in one CI run)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import ExportError, export_saved_model

ops.load_library()


def _keras_two_heads_tf_saved(path):
    """Keras 3 Embedding -> GlobalAveragePooling1D -> two Dense heads, saved with
    tf.saved_model.save (not model.export): the stock converter's .tflite of it
    gives NaN/inf (TF 2.x / Keras 3 as pinned)."""
    import keras
    keras.utils.set_random_seed(4)
    i = keras.Input((5,), dtype="int32", name="ids")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(200, 8)(i))
    m = keras.Model(i, {"a": keras.layers.Dense(2, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)})
    tf.saved_model.save(m, str(path))


def test_non_finite_tflite_of_a_model_the_converter_mis_converts_names_the_converter(tmp_path):
    _keras_two_heads_tf_saved(tmp_path / "m")
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    stock = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "m")).convert()
    from pkm_serve import tflite
    ids = np.random.default_rng(4).integers(0, 200, (8, 5)).astype(np.int32)
    runner = tflite.make_interpreter(stock, use_delegate=False).get_signature_runner("serving_default")
    theirs = runner(inputs=ids) if "inputs" in runner.get_input_details() else runner(ids=ids)
    want = {k: v.numpy() for k, v in original(tf.constant(ids)).items()}
    if all(np.all(np.isfinite(v)) for v in theirs.values()):
        pytest.skip("this converter converts the model correctly: nothing to report")
    assert all(np.all(np.isfinite(v)) for v in want.values())
    with pytest.raises(ExportError) as err:
        export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                           tflite=str(tmp_path / "m.tflite"))
    message = str(err.value)
    # The mis-converted model reads garbage: non-finite in one run, huge finite values in another.
    assert ("gives non-finite values (inf/NaN) where the SavedModel's outputs are finite" in message
            or "the .tflite differs from the SavedModel by" in message), message
    assert "of the ORIGINAL model" in message and "not the fused op" in message, message
    assert "fused differs from original" not in message


def test_non_finite_outputs_counts_only_new_non_finite_values():
    from pkm_serve.export.tflite_export import _non_finite_outputs
    want = {"a": np.array([1.0, np.nan, 2.0], np.float32), "b": np.array([1, 2], np.int32)}
    got = {"a": np.array([np.inf, np.nan, np.nan], np.float32), "b": np.array([1, 3], np.int32)}
    assert _non_finite_outputs(want, got) == {"a": (3, 2)}
    assert _non_finite_outputs(want, {"a": want["a"] + 1, "b": got["b"]}) == {}


def test_where_the_stock_conversion_of_the_original_is_right_the_fused_tflite_is_named(tmp_path):
    from pkm_serve.export.tflite_export import _mismatch_message
    module = tf.Module()
    module.t = tf.Variable(np.random.default_rng(1).normal(size=(20, 4)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32, name="ids")])
    def f(ids):
        return {"out": tf.reduce_sum(tf.gather(module.t, ids), axis=1)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    ids = np.array([[1, 2, 3], [0, 0, 19]], np.int32)
    want = {"out": f(tf.constant(ids))["out"].numpy()}
    message = _mismatch_message("serving_default", ValueError("x"), {"out": (8, 8)}, str(tmp_path / "m"),
                                {"ids": ids}, want)
    assert "'out' (8 of 8 elements)" in message
    assert "matches the SavedModel on the same inputs: the fused .tflite is at fault" in message
    finite = _mismatch_message("serving_default", ValueError(
        "signature 'serving_default' output 'out': fused differs from original by up to 3"), {},
        str(tmp_path / "m"), {"ids": ids}, want)
    assert finite.startswith("signature 'serving_default' output 'out': the .tflite differs from the "
                             "SavedModel by up to 3. ")
    assert "matches the SavedModel on the same inputs: the fused .tflite is at fault" in finite
