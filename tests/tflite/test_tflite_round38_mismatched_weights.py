"""Ragged weights of another row partition than the ids in a .tflite the stock converter makes of
a graph with ids and weights as separate ragged inputs: the converter drops the graph's Assert,
so the lookup's refusal of the marked row splits is the only check there (bags of ragged size,
and uniform bags under a ragged outer dim, which until round 38 went silently into the ids'
bags). The refusal named XLA as the one that dropped the check, untrue in TFLite."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from tests.reference import bag_list

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0
IDS = np.array([[1, 2], [3, 4], [5, 6]], np.int64)
WEIGHTS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
SPLITS, OTHER_SPLITS = np.array([0, 1, 3], np.int64), np.array([0, 2, 3], np.int64)
MISMATCH = (r"mismatched partitions of ids and weights: .* the graph's own check of that \(an Assert\) "
            r"did not run \(XLA and the TFLite converter drop it\)")


@pytest.fixture(scope="module")
def model():
    """One .tflite (one conversion) of two lookups of the same rows, each with its own weight
    splits: uniform bags of 2 under the ragged outer dim, and the rows' ids as bags of ragged size."""
    table = tf.constant(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int64, name="a_ids"),
                                  tf.TensorSpec([None], tf.int64, name="b_splits"),
                                  tf.TensorSpec([None, 2], tf.float32, name="c_weights"),
                                  tf.TensorSpec([None], tf.int64, name="d_uniform_weight_splits"),
                                  tf.TensorSpec([None], tf.int64, name="e_ragged_weight_splits")])
    def lookups(ids, splits, weights, uniform_weight_splits, ragged_weight_splits):
        uniform = ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(ids, splits),
                                    tf.RaggedTensor.from_row_splits(weights, uniform_weight_splits))
        ragged = ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(tf.reshape(ids, [-1]), 2 * splits),
                                   tf.RaggedTensor.from_row_splits(tf.reshape(weights, [-1]), 2 * ragged_weight_splits))
        return uniform.flat_values, ragged

    converter = tf.lite.TFLiteConverter.from_concrete_functions([lookups.get_concrete_function()], lookups)
    converter.allow_custom_ops = True
    return converter.convert()


def _invoke(model, uniform_weight_splits, ragged_weight_splits):
    """{"uniform_bags": [3, D], "ragged_bags": [2, D]} (the converter names outputs by no role: told by shape)."""
    interpreter = tflite.make_interpreter(model, interpreter="litert")
    by_name = {"a_ids": IDS, "b_splits": SPLITS, "c_weights": WEIGHTS,
               "d_uniform_weight_splits": uniform_weight_splits, "e_ragged_weight_splits": ragged_weight_splits}
    details = interpreter.get_input_details()
    for detail in details:
        interpreter.resize_tensor_input(detail["index"], by_name[detail["name"]].shape)
    interpreter.allocate_tensors()
    for detail in details:
        interpreter.set_tensor(detail["index"], by_name[detail["name"]])
    interpreter.invoke()
    outs = [interpreter.get_tensor(detail["index"]) for detail in interpreter.get_output_details()]
    return {"uniform_bags" if len(out) == len(IDS) else "ragged_bags": out for out in outs}


def test_weights_of_another_partition_are_refused_in_tflite(model):
    out = _invoke(model, SPLITS, SPLITS)
    np.testing.assert_allclose(out["uniform_bags"], bag_list(TABLE, list(IDS), list(WEIGHTS)), rtol=1e-5)
    rows = [IDS[:1].reshape(-1), IDS[1:].reshape(-1)]
    np.testing.assert_allclose(out["ragged_bags"], bag_list(TABLE, rows, [WEIGHTS[:1].reshape(-1),
                                                                         WEIGHTS[1:].reshape(-1)]), rtol=1e-5)
    for uniform_weight_splits, ragged_weight_splits in [(OTHER_SPLITS, SPLITS), (SPLITS, OTHER_SPLITS)]:
        with pytest.raises(RuntimeError, match=MISMATCH):
            _invoke(model, uniform_weight_splits, ragged_weight_splits)
