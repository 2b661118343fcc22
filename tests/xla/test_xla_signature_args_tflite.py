"""A jit_compile function whose ids and weights are its arguments with a None dimension (a serving
signature's batch): XLA compiles it for their run-time shapes, so the lowering's own shape check
refuses weights of another shape, and no run-time check op is needed there. Round 35 put
PkmCheckThen into such functions too, and a .tflite the stock converter made of them held it as a
custom op no TFLite runtime resolves ("Encountered unresolved custom op: PkmCheckThen"). Sizes
known only at run time inside the function (masks, also through a nested function or a tf.cond)
keep the check."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export.tflite_export import custom_ops
from tests.reference import embedding_bag

RNG = np.random.default_rng(352)
TABLE = RNG.standard_normal((30, 4)).astype(np.float32)
IDS = RNG.integers(-1, 30, size=(5, 3)).astype(np.int32)
WEIGHTS = RNG.uniform(0.1, 1.0, size=IDS.shape).astype(np.float32)
SIGNATURE = [tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([None, 3], tf.float32)]


def _jit_lookup(combiner):
    return tf.function(lambda ids, weights: ops.embedding_bag(TABLE, ids, weights, combiner), jit_compile=True,
                       input_signature=SIGNATURE)


def test_stock_tflite_conversion_of_a_jit_signature_runs():
    combiner = "sqrtn"
    lookup = _jit_lookup(combiner)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([lookup.get_concrete_function()], lookup)
    converter.allow_custom_ops = True
    model = converter.convert()
    assert custom_ops(model) == ["PkmEmbeddingBag"]
    interpreter = tflite.make_interpreter(model)
    inputs = sorted(interpreter.get_input_details(), key=lambda d: d["dtype"] != np.int32)  # ids, weights
    for detail, value in zip(inputs, (IDS, WEIGHTS)):
        interpreter.resize_tensor_input(detail["index"], value.shape)
    interpreter.allocate_tensors()
    for detail, value in zip(inputs, (IDS, WEIGHTS)):
        interpreter.set_tensor(detail["index"], value)
    interpreter.invoke()
    got = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
    want = embedding_bag(TABLE.astype(np.float64), IDS, WEIGHTS, combiner)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lookup(IDS, WEIGHTS).numpy(), want, rtol=1e-5, atol=1e-5)


def test_arguments_of_other_shapes_are_still_refused():
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must have the shape of indices"):
        _jit_lookup("sum")(IDS, WEIGHTS[:4])


def _masked_mismatch(where):
    keep, keep_all = tf.constant([True, False, True, True, False]), tf.constant([True] * 5)

    @tf.function
    def inner(ids, weights):
        return ops.embedding_bag(TABLE, ids, weights)

    @tf.function(jit_compile=True)
    def lookup(ids, weights):
        masked_ids, masked_weights = tf.boolean_mask(ids, keep), tf.boolean_mask(weights, keep_all)
        if where == "nested_function":
            return inner(masked_ids, masked_weights)
        return tf.cond(tf.reduce_any(keep), lambda: ops.embedding_bag(TABLE, masked_ids, masked_weights),
                       lambda: tf.zeros([3, 4]))

    inner(IDS, WEIGHTS)  # traced at the top level first
    return lookup(IDS, WEIGHTS)


@pytest.mark.parametrize("where", ["nested_function", "cond_branch"])
def test_run_time_sizes_inside_the_function_keep_the_check(where):
    with pytest.raises(tf.errors.InvalidArgumentError, match="their run-time sizes differ"):
        _masked_mismatch(where)
