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
