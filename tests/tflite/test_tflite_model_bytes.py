"""pkm_serve.tflite's entry points on model bytes that are no TFLite flatbuffer:
a ValueError saying so, not a struct.error from deep in the schema reader."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pkm_serve import tflite  # noqa: E402


@pytest.mark.parametrize("data", [b"garbage", b"", b"\x00" * 64, b"PK\x03\x04" + b"\x00" * 60])
def test_bytes_that_are_no_tflite_model_are_a_value_error(data):
    with pytest.raises(ValueError, match="not a TFLite flatbuffer"):
        tflite.quantize_table_int8(data)
    with pytest.raises(ValueError, match="not a TFLite flatbuffer"):
        tflite.make_interpreter(data, use_delegate=False)


def test_without_a_schema_module_the_error_names_the_function_called(monkeypatch):
    """Where neither ai_edge_litert nor tensorflow is installed (a tflite_runtime device), every
    model-file function said "quantize_table_int8 needs ...", build_embedding_bag_model's too."""
    import importlib
    import numpy as np
    from pkm_serve import tflite_model
    real = importlib.import_module

    def without_schemas(name, *args):
        if name.endswith("schema_py_generated"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)
    monkeypatch.setattr(tflite_model.importlib, "import_module", without_schemas)
    for call, name in ((lambda: tflite_model.build_embedding_bag_model(np.ones((2, 2), np.float32), 1),
                        "build_embedding_bag_model"),
                       (tflite_model.flatbuffer_schema, "flatbuffer_schema")):
        with pytest.raises(ImportError, match=rf"^{name} needs the TFLite flatbuffer schema of ai_edge_litert "
                                              "or tensorflow, and neither is installed"):
            call()


def test_a_memoryview_or_mmap_of_the_model_runs_as_its_bytes(tmp_path):
    """make_interpreter / run_tflite took bytes and bytearray only: a memoryview (a slice of a
    larger buffer, say) or an mmap of the file was "expected str, bytes or os.PathLike object,
    not memoryview" (the runtimes' own model_content refuses them too)."""
    import mmap
    import numpy as np
    table = np.random.default_rng(38).standard_normal((6, 3)).astype(np.float32)
    model = tflite.build_embedding_bag_model(table, 2, combiner="sum")
    ids, weights = np.array([[0, 5], [2, -1]], np.int32), np.array([[1.0, 2.0], [0.5, 3.0]], np.float32)
    want = [table[0] + 2 * table[5], 0.5 * table[2]]
    path = tmp_path / "m.tflite"
    path.write_bytes(model)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        for content in (memoryview(b"xx" + model)[2:], mapped, np.frombuffer(model, np.uint8)):
            (out,) = tflite.run_tflite(content, [ids, weights])
            np.testing.assert_allclose(out, want, rtol=1e-6)
    with pytest.raises(TypeError, match="model must be a path .* or the model's bytes .*, got int"):
        tflite.make_interpreter(3)
    with pytest.raises(TypeError, match="must be contiguous"):
        tflite.make_interpreter(memoryview(model)[::2])
    with pytest.raises(ValueError, match="not a TFLite flatbuffer"):
        tflite.make_interpreter(memoryview(b"garbage!" * 4))


def test_a_model_keeping_its_buffers_after_the_flatbuffer_is_not_quantized():
    """A model over 2 GB keeps its buffers after the flatbuffer (Buffer.offset/size): the table,
    no inline data, was taken for no constant ("no ... params table found", untrue), and any
    other such buffer would have been dropped by the repack. It is refused as what it is; the
    same model with inline buffers is the reference that quantizes."""
    import flatbuffers
    import numpy as np
    schema = tflite.flatbuffer_schema()
    model = tflite.build_embedding_bag_model(np.arange(18, dtype=np.float32).reshape(6, 3), 2)
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model), 0))
    moved = [(b, bytes(np.asarray(b.data, np.uint8))) for b in m.buffers if b.data is not None and len(b.data)]
    for b, _ in moved:
        b.data, b.offset, b.size = None, 1 << 40, 1 << 40   # (fixed-width fields: packed at any value alike)
    def packed():
        builder = flatbuffers.Builder(0)
        builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
        return bytearray(builder.Output())
    position = len(packed())
    for b, data in moved:
        b.offset, b.size = -(-position // 16) * 16, len(data)
        position = b.offset + len(data)
    outside = packed()
    for b, data in moved:
        outside += bytes(b.offset - len(outside)) + data
    ids, weights = np.array([[0, 5]], np.int32), np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(tflite.run_tflite(bytes(outside), [ids, weights])[0],
                                  tflite.run_tflite(model, [ids, weights])[0])   # the runtime reads it
    tflite.quantize_table_int8(model)
    with pytest.raises(ValueError, match=r"keeps 1 buffer\(s\) outside its flatbuffer \(offset/size"):
        tflite.quantize_table_int8(bytes(outside))
