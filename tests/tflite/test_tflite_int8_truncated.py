"""quantize_table_int8 and check_int8_tables given a .tflite cut short (a partial copy or
download; its first 8 bytes still read "TFL3") raise a ValueError that says the bytes are not a
whole flatbuffer; they raised the schema reader's struct.error ("unpack_from requires a buffer of
at least ... bytes"), which check_tflite_bytes exists to keep from users. The whole model still
quantizes and checks."""
import numpy as np
import pytest

from pkm_serve.tflite_model import build_embedding_bag_model, check_int8_tables, quantize_table_int8


def _model():
    return build_embedding_bag_model(np.random.default_rng(4).normal(size=(64, 16)).astype(np.float32), 3)


@pytest.mark.parametrize("keep", [16, 100, 0.5])
@pytest.mark.parametrize("function", [quantize_table_int8, check_int8_tables])
def test_a_truncated_model_is_a_value_error_saying_so(function, keep):
    model = quantize_table_int8(_model()) if function is check_int8_tables else _model()
    cut = model[:keep if isinstance(keep, int) else int(len(model) * keep)]
    with pytest.raises(ValueError, match=rf"{function.__name__}: the {len(cut)} bytes given are not a whole "
                                         "TFLite flatbuffer \\(truncated or corrupt"):
        function(cut)


def test_the_whole_model_still_quantizes_and_checks():
    assert check_int8_tables(quantize_table_int8(_model())) == 1
