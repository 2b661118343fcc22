"""run_tflite's inputs by signature input name (as the SavedModel's signature
names them), beside the tensor names."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pkm_serve import tflite  # noqa: E402

import tensorflow as tf  # noqa: E402  (the converter)

TABLE = np.random.default_rng(7).normal(size=(20, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def two_input_model(tmp_path_factory):
    """serving_default(ids int32 [None, 3], w float32 [None, 3]) -> sum of w * table[ids]."""
    path = str(tmp_path_factory.mktemp("sig") / "m")
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32, name="ids"),
                                  tf.TensorSpec([None, 3], tf.float32, name="w")])
    def f(ids, w):
        return {"out": tf.reduce_sum(tf.gather(module.t, ids) * w[..., None], axis=1)}
    module.f = f
    tf.saved_model.save(module, path, signatures={"serving_default": f})
    return tf.lite.TFLiteConverter.from_saved_model(path).convert()


def _inputs():
    ids = np.array([[1, 2, 3], [4, 5, 19]], np.int32)
    w = np.array([[1, 0.5, 2], [1, 1, 1]], np.float32)
    return ids, w, (TABLE[ids] * w[..., None]).sum(1)


def test_run_tflite_takes_signature_input_names(two_input_model):
    ids, w, want = _inputs()
    got = tflite.run_tflite(two_input_model, {"ids": ids, "w": w}, use_delegate=False)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Tensor names still work, and the two kinds mix.
    interp = tflite.make_interpreter(two_input_model, use_delegate=False)
    names = {d["name"] for d in interp.get_input_details()}
    assert names == {"serving_default_ids:0", "serving_default_w:0"}
    got = tflite.run_tflite(two_input_model, {"serving_default_ids:0": ids, "w": w},
                            use_delegate=False)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_run_tflite_names_the_accepted_inputs_for_an_unknown_one(two_input_model):
    ids, w, _ = _inputs()
    with pytest.raises(ValueError) as err:
        tflite.run_tflite(two_input_model, {"idx": ids, "w": w}, use_delegate=False)
    message = str(err.value)
    for part in ("unknown ['idx']", "tensor names ['serving_default_ids:0', 'serving_default_w:0']",
                 "signature input names ['ids', 'w']",
                 "missing ['serving_default_ids:0' (signature name 'ids')]"):
        assert part in message, message
    with pytest.raises(ValueError, match="same input tensor"):
        tflite.run_tflite(two_input_model, {"ids": ids, "serving_default_ids:0": ids, "w": w},
                          use_delegate=False)


@pytest.mark.parametrize("interpreter", ["litert", "tf"])
def test_numpy_integer_thread_counts_are_taken_as_ints_are(interpreter):
    """num_threads=np.int64(2) (a count read from a config array) was refused by load_delegate
    ("must be an integer") and by the runtimes' Interpreter ("type of num_threads should be int")."""
    model = tflite.build_embedding_bag_model(TABLE, 3)
    ids = np.array([[1, 2, 3], [4, -1, 19]], np.int32)
    w = np.array([[1, 0.5, 2], [1, 1, -3]], np.float32)
    want = (np.where(ids[..., None] >= 0, TABLE.astype(np.float64)[ids], 0) * w[..., None]).sum(1)
    for threads in (np.int64(2), np.int32(3), np.uint8(1)):
        assert tflite.load_delegate(interpreter, num_threads=threads, fuse_composites=np.True_) is not None
        (got,) = tflite.run_tflite(model, [ids, w], interpreter=interpreter, num_threads=threads)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for bad in (np.True_, 2.0, np.float64(2), np.int64(0), np.int64(257)):
        with pytest.raises(ValueError, match=r"num_threads must be an integer in \[1, 256\]"):
            tflite.make_interpreter(model, interpreter, num_threads=bad)


def _one_input_bag_model():
    """The one-op bag model without its weights input: PkmEmbeddingBag(table, indices), a sum."""
    import flatbuffers
    from flatbuffers import flexbuffers
    schema = tflite.flatbuffer_schema()
    options = bytes(flexbuffers.Dumps({"combiner": "sum", "has_weights": False}))
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(
        bytearray(tflite.build_embedding_bag_model(TABLE, 3, custom_options=options)), 0))
    model.subgraphs[0].operators[0].inputs = [0, 1]
    model.subgraphs[0].inputs = [1]
    builder = flatbuffers.Builder(1 << 12)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def test_one_array_is_a_one_input_models_input_not_a_list_of_rows():
    """run_tflite(model, ids) with ids of shape [1, 3] took ids[0] for the one input, silently:
    this model answered a [4] (no batch dimension), a stock GATHER -> SUM(axis 1) model a [3] of
    each id's row summed (garbage); ids of two rows were "model has 1 inputs, got 2 arrays"."""
    model = _one_input_bag_model()
    for ids in (np.array([[1, 2, 3]], np.int32), np.array([[1, 2, 3], [4, -1, 19]], np.int32)):
        want = np.where(ids[..., None] >= 0, TABLE.astype(np.float64)[ids], 0).sum(1)
        # A tf.Tensor (or any array but numpy's) is one array too: it was still taken row by row.
        for given in (ids, tf.constant(ids)):
            (got,) = tflite.run_tflite(model, given)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="model has 2 inputs, got 1 arrays"):
        tflite.run_tflite(tflite.build_embedding_bag_model(TABLE, 3), np.zeros((2, 3), np.int32))


def test_without_the_delegate_thread_counts_are_the_runtimes_own(two_input_model):
    """use_delegate=False: more than the delegate's 256 threads went to the Interpreter as
    given (the runtimes take any int >= 1); the numpy-integer change refused it with the
    delegate's [1, 256] though no delegate was loaded."""
    ids, w, want = _inputs()
    for threads in (300, np.int64(300), np.int32(2)):
        (got,) = tflite.run_tflite(two_input_model, [ids, w], use_delegate=False, num_threads=threads)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_threads must be an integer >= 1 without the delegate"):
            tflite.make_interpreter(two_input_model, use_delegate=False, num_threads=bad)


def test_the_delegates_option_values_may_have_spaces_around_them():
    """A stock load_delegate(path, {"num_threads": "2 "}) (a value read from a config file, its
    newline or a trailing space kept) failed to load where " 2" loaded: TFLite's own delegate
    flags read a number with an istringstream, which takes both. Spaces around a value are
    ignored now, for fuse_composites too; anything else that is not a whole number in [1, 256]
    still fails, naming the value given."""
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    model = tflite.build_embedding_bag_model(TABLE, 3)
    ids, w, want = _inputs()
    for options in ({"num_threads": "2 "}, {"num_threads": "\t3\n"}, {"num_threads": " 2"},
                    {"num_threads": "4", "fuse_composites": " true "}):
        interp = litert.Interpreter(model_content=model, experimental_delegates=[
            litert.load_delegate(tflite.delegate_path(), options)])
        details = interp.get_input_details()
        for d, value in zip(details, (ids, w)):
            interp.resize_tensor_input(d["index"], value.shape)
        interp.allocate_tensors()
        for d, value in zip(details, (ids, w)):
            interp.set_tensor(d["index"], value)
        interp.invoke()
        got = interp.get_tensor(interp.get_output_details()[0]["index"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert "DELEGATE" in tflite.ops_in_plan(interp)
    for key, value, words in [("num_threads", v, "num_threads must be an integer in [1, 256]")
                              for v in ("2x", "2 2", "+ 2", " ", "", "2.0", "0x2", "257", "0")] + [
                                  ("fuse_composites", "yes", "fuse_composites must be true or false")]:
        with pytest.raises(ValueError) as refused:
            litert.load_delegate(tflite.delegate_path(), {key: value})
        assert f"libpkm_tflite: {words}, got '{value}'" in str(refused.value), (value, str(refused.value))


def test_a_quantized_int8_inputs_refusal_says_so_not_indices():
    """A full-integer quantized model's int8 input given floats was refused as "expects int8
    indices, got float32" (it holds quantized activations, not indices); the refusal now gives
    its quantization, and values quantized so run (numpy float64 reference)."""
    module = tf.Module()
    module.f = tf.function(lambda x: {"y": x * 2.0 + 1.0}, input_signature=[tf.TensorSpec([1, 4], tf.float32, name="x")])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([module.f.get_concrete_function()], module)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([np.full((1, 4), v, np.float32)] for v in (-1.0, 1.0))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    model = converter.convert()
    (x_detail,), (y_detail,) = (tflite.make_interpreter(model, use_delegate=False).get_input_details(),
                                tflite.make_interpreter(model, use_delegate=False).get_output_details())
    (s, z), (out_s, out_z) = x_detail["quantization"], y_detail["quantization"]
    x = np.array([[-0.5, 0.0, 0.25, 0.9]])
    for key in (None, "serving_default"):
        with pytest.raises(ValueError) as refused:
            tflite.run_tflite(model, [x.astype(np.float32)], use_delegate=False, signature_key=key)
        message = str(refused.value)
        assert "indices" not in message and "expects int8 values (quantized: q = round(x / " in message, message
        assert f"{s:.6g}" in message and f"{abs(z)})" in message, message
        with pytest.raises(ValueError, match=r"is int8 \(quantized: .*values \[1, 200\] do not fit \[-128, 127\]"):
            tflite.run_tflite(model, [np.array([[1, 2, 3, 200]])], use_delegate=False, signature_key=key)
        q = (np.rint(x / s) + z).astype(np.int8)
        (y,) = tflite.run_tflite(model, [q], use_delegate=False, signature_key=key)
        assert y.dtype == np.int8
        np.testing.assert_allclose((y.astype(np.float64) - out_z) * out_s, x * 2 + 1, atol=2 * s + 2 * out_s)
