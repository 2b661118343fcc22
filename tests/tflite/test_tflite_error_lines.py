"""The Python interpreters join the runtime's messages as they come, and TFLite's messages end
without a newline (its C++ and Java reporters add one; the delegate's follow that, as TFLite's own
kernels do): a kernel's message ran into the runtime's own ("...padding)Node number 1
(PkmDelegate) failed to invoke."), and `pkm-serve tflite`, which prints the first line of a
refusal, printed both. tflite.runtime_messages splits them; the CLI and the servable use it."""
import numpy as np
import pytest
from flatbuffers import flexbuffers

from pkm_serve import tflite

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
    assert tflite.console_main([str(path), "--interpreter", "litert"]) == 1
    err = capsys.readouterr().err
    assert err.endswith("')\n") and "Node number" not in err, err
    assert err.startswith("pkm-serve tflite: error: PkmDelegate: node 0: unknown custom_options "
                          "key 'combinr'"), err
