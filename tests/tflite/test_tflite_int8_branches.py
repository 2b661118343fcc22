"""quantize_table_int8 of a model whose bags are looked up inside a tf.cond: the converter passes
the table to the IF op's branch subgraphs as an operand, so no bag op reads a constant table and
it is left float. The error said "no constant float32, float16 or bfloat16 params table of a
PkmEmbeddingBag op found" of a model that plainly has one; it now says where the table went."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite

ops.load_library()


def test_a_table_passed_into_tf_cond_branches_is_named_in_the_refusal():
    table = tf.Variable(np.random.default_rng(40).standard_normal((20, 4)).astype(np.float32))
    fn = tf.function(lambda ids, flag: tf.cond(flag[0] > 0, lambda: ops.embedding_bag(table, ids, None),
                                               lambda: ops.embedding_bag(table, ids, None, combiner="max")),
                     input_signature=[tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([1], tf.int32)])
    converter = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()])
    converter.allow_custom_ops = True
    model = converter.convert()
    ids = np.array([[1, 2, -1]], np.int32)
    float_out = tflite.run_tflite(model, [ids, np.array([1], np.int32)])[0]
    np.testing.assert_allclose(float_out, table.numpy()[[1, 2]].sum(0, keepdims=True), rtol=1e-6)
    with pytest.raises(ValueError, match=r"2 bag op\(s\) in a tf\.cond or tf\.while_loop branch"):
        tflite.quantize_table_int8(model)
