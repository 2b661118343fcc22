"""PkmCheckThen in a .tflite: the run-time check pkm_serve adds where XLA may compile a function for
the CPU (a ragged weighted lookup in a jit_compile function), which the stock converter keeps as a
custom op. No TFLite kernel ran it ("Encountered unresolved custom op: PkmCheckThen"); now the
delegate (and PkmCheckThenRegistration for C++ resolvers) does: the value passes through, and a
false condition is the runtime's error with the op's message, as TF's InvalidArgumentError."""
import os

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from tests.reference import embedding_bag, ragged_embedding_bag
from tests.tflite.test_tflite import ALL_INTERPRETERS, run_in

ops.load_library()
TABLE = np.random.default_rng(41).standard_normal((20, 4)).astype(np.float32)
PARTITION_MESSAGE = "weights must share the row partition of the indices"
VALUES = np.array([0, 7, 19, 3, 3, 11], np.int32)
SPLITS = np.array([0, 2, 2, 6], np.int64)
WEIGHTS = np.array([0.5, 2.0, -1.0, 1.5, 0.25, 3.0], np.float32)
OTHER_SPLITS = np.array([0, 1, 3, 6], np.int64)  # the same count and end: only the check tells them apart


def _jit_function(dtype):
    table = tf.constant(TABLE, dtype)
    specs = [tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.float32),
             tf.TensorSpec([None], tf.int64)]
    return tf.function(lambda v, s, w, ws: ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(v, s),
                                                             tf.RaggedTensor.from_row_splits(w, ws)),
                       input_signature=specs, jit_compile=True)


def _stock_converted_with_a_check(fn):
    """`fn`'s .tflite from the stock converter (custom ops allowed), which holds PkmCheckThen: the op
    library this repo builds registers it, so a trace without one is the check gone missing."""
    converter = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()])
    converter.allow_custom_ops = True
    model = converter.convert()
    assert b"PkmCheckThen" in model, "the jit_compile trace holds no PkmCheckThen: its run-time check is gone"
    return model


@pytest.fixture(scope="module", params=["float32", "float16"])
def converted(request, tmp_path_factory):
    """(jit_compile function, path of its stock-converted .tflite, numpy dtype of the table and weights)."""
    fn = _jit_function(tf.as_dtype(request.param))
    path = tmp_path_factory.mktemp("check_then") / f"{request.param}.tflite"
    path.write_bytes(_stock_converted_with_a_check(fn))
    return fn, str(path), np.dtype(request.param)


@pytest.mark.parametrize("interpreter", ALL_INTERPRETERS)
def test_a_passing_check_runs_the_lookup(converted, interpreter, tmp_path):
    fn, path, dtype = converted
    inputs = [VALUES, SPLITS, WEIGHTS, SPLITS]
    out, = run_in(interpreter, path, inputs, tmp_path)
    assert out.dtype == dtype
    # float64 of the values the op sees: the table and the weights in its dtype
    expected = ragged_embedding_bag(TABLE.astype(dtype), VALUES, SPLITS, WEIGHTS.astype(dtype))
    tolerance = 1e-5 if dtype == np.float32 else 4e-3  # float16's rounding of the output
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(out, fn(*inputs).numpy(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("interpreter", ALL_INTERPRETERS)
def test_a_failing_check_is_an_error_with_its_message(converted, interpreter, tmp_path):
    fn, path, _ = converted
    inputs = [VALUES, SPLITS, WEIGHTS, OTHER_SPLITS]
    with pytest.raises(tf.errors.InvalidArgumentError, match=PARTITION_MESSAGE):
        fn(*inputs)  # TF's own verdict on these inputs
    with pytest.raises(RuntimeError) as e:
        run_in(interpreter, path, inputs, tmp_path)
    assert str(e.value).splitlines()[0].startswith(PARTITION_MESSAGE), str(e.value)


def test_a_runtime_without_the_delegate_is_told_to_pass_it(converted):
    """A stock interpreter without the delegate still refuses the op: the hint says where its kernel is."""
    from ai_edge_litert.interpreter import Interpreter

    _, path, _ = converted
    with pytest.raises(RuntimeError) as e:
        Interpreter(model_path=path).allocate_tensors()
    first = tflite.runtime_messages(str(e.value))[0]
    assert "unresolved custom op: PkmCheckThen" in first and "delegate" in first, first
    assert "no TFLite kernel" not in first, first
    assert os.path.basename(tflite.delegate_path()) in first, first


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    """A jit_compile lookup of ids and weights masked apart (tf.boolean_mask: sizes known only at run
    time, dynamic tensors in TFLite), its .tflite's path: the check guards the weights' shape."""
    table = tf.constant(TABLE)
    specs = [tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.bool),
             tf.TensorSpec([None], tf.bool)]
    fn = tf.function(lambda ids, w, keep_ids, keep_w: ops.embedding_bag(
        table, tf.boolean_mask(ids, keep_ids), tf.boolean_mask(w, keep_w)), input_signature=specs, jit_compile=True)
    path = tmp_path_factory.mktemp("check_then_masked") / "masked.tflite"
    path.write_bytes(_stock_converted_with_a_check(fn))
    return fn, str(path)


@pytest.mark.parametrize("interpreter", ALL_INTERPRETERS)
def test_a_check_of_run_time_sizes_passes_or_fails_as_tf(masked, interpreter, tmp_path):
    """A false check here is met first by the bag's own shape check in Prepare (TFLite prepares a node
    before the check ahead of it runs): the same refusal in the bag's words."""
    fn, path = masked
    ids = np.arange(12, dtype=np.int32).reshape(4, 3) % 20
    weights = np.linspace(-1.0, 2.0, 12, dtype=np.float32).reshape(4, 3)
    keep = np.array([True, False, True, True])
    out, = run_in(interpreter, path, [ids, weights, keep, keep], tmp_path)
    np.testing.assert_allclose(out, embedding_bag(TABLE, ids[keep], weights[keep]), rtol=1e-5, atol=1e-5)
    other = np.array([True, True, True, True])
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must have the shape of indices"):
        fn(ids, weights, keep, other)
    with pytest.raises(RuntimeError, match="weights must have the shape of indices"):
        run_in(interpreter, path, [ids, weights, keep, other], tmp_path)
