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
