"""The Python interpreters join the runtime's messages as they come, and TFLite's messages end
without a newline (its C++ and Java reporters add one; the delegate's follow that, as TFLite's own
kernels do): a kernel's message ran into the runtime's own ("...padding)Node number 1
(PkmDelegate) failed to invoke."), and `pkm-serve tflite`, which prints the first line of a
refusal, printed both. tflite.runtime_messages splits them; the CLI and the servable use it."""
import re

import numpy as np
import pytest
from flatbuffers import flexbuffers

from pkm_serve import tflite, tflite_cli

TABLE = np.random.default_rng(36).standard_normal((50, 4)).astype(np.float32)


def _interpreter(model_bytes):
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    return litert.Interpreter(model_content=model_bytes,
                              experimental_delegates=[tflite.load_delegate("litert")])


def test_an_invoke_error_is_its_own_message():
    interp = _interpreter(tflite.build_embedding_bag_model(TABLE, 3, batch=1))
    interp.allocate_tensors()
    ids, weights = interp.get_input_details()
    interp.set_tensor(ids["index"], np.array([[0, 99, -1]], np.int32))
    interp.set_tensor(weights["index"], np.ones((1, 3), np.float32))
    with pytest.raises(RuntimeError) as e:
        interp.invoke()
    lines = tflite.runtime_messages(str(e.value))
    assert lines[0] == ("PkmEmbeddingBag: indices[1] = 99 is out of range [0, 50) "
                        "(negative indices are padding)"), lines
    assert lines[1].startswith("Node number ") and lines[1].endswith("failed to invoke."), lines


def test_each_of_two_prepare_errors_is_its_own_message():
    # A node with one input: the kernel's reason, then the delegate's, then the runtime's.
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(
        bytearray(tflite.build_embedding_bag_model(TABLE, 3, batch=1)), 0))
    model.subgraphs[0].operators[0].inputs = [0]
    builder = flatbuffers.Builder(1 << 12)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    interp = _interpreter(bytes(builder.Output()))
    with pytest.raises(RuntimeError) as e:
        interp.allocate_tensors()
    assert not str(e.value).startswith("PkmEmbeddingBag: expects 2 or 3 inputs (params, indices[, weights]), got 1\n")
    lines = tflite.runtime_messages(str(e.value))
    assert lines[:2] == ["PkmEmbeddingBag: expects 2 or 3 inputs (params, indices[, weights]), got 1",
                         "PkmDelegate: node 0 is malformed (see above)"], lines
    assert lines[2].startswith("Node number ") and lines[2].endswith("failed to prepare."), lines


def test_the_cli_prints_the_delegates_reason_alone(tmp_path, capsys):
    path = tmp_path / "misspelt.tflite"
    path.write_bytes(tflite.build_embedding_bag_model(
        TABLE, 3, custom_options=bytes(flexbuffers.Dumps({"combinr": "sum"}))))
    assert tflite_cli.console_main([str(path), "--interpreter", "litert"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("')\n") and "Node number" not in err, err
    assert err.startswith("pkm-serve tflite: error: PkmDelegate: node 0: unknown custom_options "
                          "key 'combinr'"), err


def _stock_gather_model():
    """GATHER of a [10, 2] table by [-1, 3] int32 ids and RESHAPE of a [-1, 4] input to [1, 4],
    as the stock converter writes them (no op of ours)."""
    tf = pytest.importorskip("tensorflow")
    module = tf.Module()
    module.table = tf.Variable(TABLE[:10, :2])
    module.serve = tf.function(
        lambda ids, x: {"g": tf.gather(module.table, ids), "r": tf.reshape(x, [1, 4])},
        input_signature=[tf.TensorSpec([None, 3], tf.int32, name="ids"),
                         tf.TensorSpec([None, 4], tf.float32, name="x")])
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [module.serve.get_concrete_function()], module)
    return converter.convert()


def test_stock_kernels_messages_each_on_their_own():
    # A negative GATHER index: TF_LITE_ENSURE's "... was not true." and the kernel's own
    # message came as one; then, on the same interpreter (the runtime's text keeps every
    # message so far), a RESHAPE refusal ran into the runtime's "failed to invoke.".
    interp = _interpreter(_stock_gather_model())
    run = interp.get_signature_runner("serving_default")
    with pytest.raises(RuntimeError) as first:
        run(ids=np.array([[0, 1, -1]], np.int32), x=np.ones((1, 4), np.float32))
    with pytest.raises(RuntimeError) as second:
        run(ids=np.array([[0, 1, 2]] * 2, np.int32), x=np.ones((2, 4), np.float32))
    lines = tflite.runtime_messages(str(second.value))
    assert str(second.value).startswith(str(first.value)), (first.value, second.value)
    assert lines[0].endswith("indices_has_only_positive_elements was not true."), lines
    assert lines[1:3] == ["gather index out of bounds", "Node number 0 (GATHER) failed to invoke."], lines
    assert lines[3] and not lines[3].startswith("Node number"), lines   # the RESHAPE refusal's reason
    assert all(re.fullmatch(r"Node number \d+ \(\w+\) failed to (invoke|prepare)\.", line)
               for line in lines if line.startswith("Node number")), lines


def test_tflite_runtime_text_with_source_locations_splits_at_each_message():
    # As tflite_runtime 2.14 gave it for the model above (GATHER, then RESHAPE on its interpreter).
    text = ("gather index out of boundsNode number 0 (GATHER) failed to invoke./tensorflow/tensorflow/lite/"
            "kernels/reshape.cc:92 num_input_elements != num_output_elements (8 != 4)Node number 1 "
            "(RESHAPE) failed to prepare.")
    assert tflite.runtime_messages(text) == [
        "gather index out of bounds", "Node number 0 (GATHER) failed to invoke.",
        "/tensorflow/tensorflow/lite/kernels/reshape.cc:92 num_input_elements != num_output_elements (8 != 4)",
        "Node number 1 (RESHAPE) failed to prepare."]


def test_run_tflite_gives_the_runtimes_messages_one_a_line():
    """run_tflite raised the runtime's text as it came: "...(negative indices are
    padding)Node number 1 (PkmDelegate) failed to invoke." in one line."""
    with pytest.raises(RuntimeError) as refused:
        tflite.run_tflite(tflite.build_embedding_bag_model(TABLE, 3), [np.array([[0, 99, -1]], np.int32),
                                                                       np.ones((1, 3), np.float32)])
    lines = str(refused.value).splitlines()
    assert lines[0] == "PkmEmbeddingBag: indices[1] = 99 is out of range [0, 50) (negative indices are padding)", lines
    assert re.fullmatch(r"Node number \d+ \(PkmDelegate\) failed to invoke\.", lines[1]), lines


def test_a_fused_chains_message_after_another_is_its_own():
    """The fused chain's messages start "PkmEmbeddingBag (fused GATHER/MUL/SUM): ", which the
    splitter did not know: after a refused strict resize ("...identified by -1.") on the same
    interpreter it stayed glued to that message. Reference: a fresh interpreter's messages."""
    tf = pytest.importorskip("tensorflow")
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    table = tf.constant(TABLE)
    fn = tf.function(lambda ids, w: tf.reduce_sum(tf.gather(table, ids) * w[..., None], axis=1),
                     input_signature=[tf.TensorSpec([1, 3], tf.int32), tf.TensorSpec([1, 3], tf.float32)])
    model = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()]).convert()

    def refusal(interp, resize_first):
        interp.allocate_tensors()
        ids, w = sorted(interp.get_input_details(), key=lambda d: d["dtype"] != np.int32)
        if resize_first:
            with pytest.raises(RuntimeError, match="identified by -1"):
                interp.resize_tensor_input(ids["index"], [2, 3], strict=True)
        interp.set_tensor(ids["index"], np.array([[0, 99, 1]], np.int32))
        interp.set_tensor(w["index"], np.ones((1, 3), np.float32))
        with pytest.raises(RuntimeError) as refused:
            interp.invoke()
        return tflite.runtime_messages(str(refused.value))

    def fused():
        return litert.Interpreter(model_content=model, experimental_delegates=[
            tflite.load_delegate("litert", fuse_composites=True)])
    fresh = refusal(fused(), False)
    assert fresh[0].startswith("PkmEmbeddingBag (fused GATHER/MUL/SUM): indices[1] = 99"), fresh
    reused = refusal(fused(), True)
    assert reused[0].endswith("identified by -1.") and reused[1:] == fresh, reused
