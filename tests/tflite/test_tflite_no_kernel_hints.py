"""A .tflite converted (allow_custom_ops) from a model holding one of pkm_serve's ops that no
TFLite kernel runs, the delegate's included: pkm_serve.quantized's PkmQuantizedEmbeddingBag /
PkmQuantizedRaggedEmbeddingBag. The runtime said only "Encountered unresolved custom op: ...",
which reads as if the delegate had not been passed; the refusal now says what to do instead.
(The PkmCheckThen of a jit_compile function now runs in the delegate: test_tflite_check_then.py.)"""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, quantized, tflite, tflite_cli

ops.load_library()
TABLE = np.random.default_rng(40).standard_normal((20, 4)).astype(np.float32)


def _converted(ragged):
    table = quantized.quantize_table(TABLE)
    if ragged:
        specs = [tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int64)]
        fn = tf.function(lambda v, s: quantized.embedding_bag(table, tf.RaggedTensor.from_row_splits(v, s), None),
                         input_signature=specs)
    else:
        fn = tf.function(lambda ids: quantized.embedding_bag(table, ids, None),
                         input_signature=[tf.TensorSpec([None, 3], tf.int32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()])
    converter.allow_custom_ops = True
    return converter.convert()


@pytest.mark.parametrize("ragged", [False, True])
def test_the_refusal_says_how_to_get_an_int8_tflite(tmp_path, capsys, ragged):
    model = _converted(ragged)
    op = "PkmQuantizedRaggedEmbeddingBag" if ragged else "PkmQuantizedEmbeddingBag"
    assert op.encode() in model
    inputs = [np.array([0, 1], np.int32), np.array([0, 2], np.int64)] if ragged else [np.zeros((1, 3), np.int32)]
    with pytest.raises(RuntimeError) as e:
        tflite.run_tflite(model, inputs)
    first = str(e.value).splitlines()[0]
    assert f"unresolved custom op: {op}" in first and "tflite.quantize_table_int8" in first, first
    (tmp_path / "q.tflite").write_bytes(model)
    assert tflite_cli.console_main([str(tmp_path / "q.tflite")]) == 1
    assert "tflite.quantize_table_int8" in capsys.readouterr().err

