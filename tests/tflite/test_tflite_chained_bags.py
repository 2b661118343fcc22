"""A bag whose weights or table are another bag's output, with no other op between: the delegate
claims both nodes into one partition, where the first one's output is read by no node of the
plan, so the runtime gave it no memory and every invoke failed with "PkmEmbeddingBag: output
buffer is not allocated" (a fused stock GATHER -> SUM chain's too, with fuse_composites). Such
outputs are now the partition node's temporaries, which the arena allocates; the bag reading one
keeps an arena output (made dynamic, an empty one failed the Python runtimes' get_tensor with
"Invalid tensor size"). Models from the real converter; the reference is numpy float64."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_tflite import run_in  # noqa: E402  (in-process, or the TF-free venv)

N, K, D = 20, 3, 5
RNG = np.random.default_rng(40)
SCORES = RNG.standard_normal((N, K)).astype(np.float32)   # rows of K: a bag of them is K weights
VALUES = RNG.standard_normal((N, D)).astype(np.float32)


def _weights_from_a_bag(first, second):
    return ops.embedding_bag(VALUES, second, ops.embedding_bag(SCORES, first, None), combiner="mean")


def _table_from_a_bag(first, second):   # the first bag's [B, K] output is the second's table
    return ops.embedding_bag(ops.embedding_bag(SCORES, first, None, combiner="max"), second, None)


def _reference(chain, first, second):
    def bag(table, ids, weights=None, combiner="sum"):
        rows = np.where(ids[..., None] >= 0, table.astype(np.float64)[np.maximum(ids, 0)], 0.0)
        if combiner == "max":
            return np.where(ids[..., None] >= 0, rows, -np.inf).max(-2)
        w = np.ones(ids.shape) if weights is None else weights
        total = (rows * w[..., None]).sum(-2)
        return total / w.sum(-1, keepdims=True) if combiner == "mean" else total
    if chain is _weights_from_a_bag:
        return bag(VALUES, second, bag(SCORES, first), "mean")
    return bag(bag(SCORES, first, combiner="max"), second)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    paths = {}
    for chain in (_weights_from_a_bag, _table_from_a_bag):
        fn = tf.function(chain, input_signature=[tf.TensorSpec([None, 4], tf.int32),
                                                 tf.TensorSpec([None, K], tf.int32)])
        converter = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()])
        converter.allow_custom_ops = True
        path = tmp_path_factory.mktemp("chained") / f"{chain.__name__}.tflite"
        path.write_bytes(converter.convert())
        paths[chain] = str(path)
    return paths


@pytest.mark.parametrize("interpreter", ["litert", "tf", "tflite_runtime"])
@pytest.mark.parametrize("chain", [_weights_from_a_bag, _table_from_a_bag], ids=["weights", "table"])
def test_a_bag_reading_another_bags_output(converted, chain, interpreter, tmp_path):
    for batch in (2, 0, 5):   # other shapes, an empty one too: the output is allocated again
        first = RNG.integers(0, N, (batch, 4)).astype(np.int32)
        second = RNG.integers(0, max(batch, 1) if chain is _table_from_a_bag else N, (batch, K)).astype(np.int32)
        out, = run_in(interpreter, converted[chain], [first, second], tmp_path, num_threads=2)
        np.testing.assert_allclose(out, _reference(chain, first, second), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interpreter", ["litert", "tf", "tflite_runtime"])
def test_a_fused_stock_chain_reading_another_fused_chains_output(interpreter, tmp_path):
    # GATHER -> SUM whose table is another GATHER -> SUM's output: fuse_composites claims both.
    scores = tf.constant(SCORES)
    fn = tf.function(lambda first, second: tf.reduce_sum(
        tf.gather(tf.reduce_sum(tf.gather(scores, first), axis=1), second), axis=1),
        input_signature=[tf.TensorSpec([None, 4], tf.int32), tf.TensorSpec([None, K], tf.int32)])
    path = tmp_path / "stock.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()]).convert())
    for batch in (3, 0):
        first = RNG.integers(0, N, (batch, 4)).astype(np.int32)
        second = RNG.integers(0, max(batch, 1), (batch, K)).astype(np.int32)
        out, = run_in(interpreter, str(path), [first, second], tmp_path, fuse_composites=True)
        want = SCORES.astype(np.float64)[first].sum(1)[second].sum(1)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
