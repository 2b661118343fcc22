"""A SavedModel saved from jit_compile functions, loaded in a process where TF ran an op before
pkm_serve was imported: TF had built its XLA JIT kernels without ours, and only tracing
ops.embedding_bag (or quantized.embedding_bag) added them, which loading a SavedModel never does."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, quantized
from tests.reference import embedding_bag as reference_bags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLE = np.arange(12, dtype=np.float32).reshape(4, 3) / 7.0
IDS = [[0, 3], [2, -1]]


class _Lookups(tf.Module):
    def __init__(self):
        super().__init__()
        self.table = tf.Variable(TABLE)
        self.int8_table = quantized.quantize_table(TABLE)

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    def dense(self, ids):
        return ops.embedding_bag(self.table, ids, combiner="mean")

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    def table_gradient(self, ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(self.table, ids, combiner="sum") ** 2)
        return tape.gradient(loss, self.table)

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, 2], tf.int64)])
    def int8(self, ids):
        return quantized.embedding_bag(self.int8_table, ids, combiner="sum")


_LOAD = """
import sys, json
import tensorflow as tf
tf.constant(1.0) + 1.0  # TF builds its XLA JIT kernels here, before the op library is loaded
import pkm_serve
model = tf.saved_model.load(sys.argv[1])
ids = tf.constant({ids}, tf.int64)
print(json.dumps({{name: getattr(model, name)(ids).numpy().tolist() for name in ("dense", "table_gradient", "int8")}}))
"""


@pytest.fixture(scope="module")
def saved_model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("jit_saved_model"))
    tf.saved_model.save(_Lookups(), path)
    return path


def test_jit_saved_model_runs_when_tf_ran_before_pkm_serve_was_imported(saved_model_dir):
    import json

    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _LOAD.format(ids=IDS), saved_model_dir], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = np.array(IDS)
    np.testing.assert_allclose(got["dense"], reference_bags(TABLE, ids, None, "mean"), rtol=1e-6)
    sums = reference_bags(TABLE, ids, None, "sum")
    want_gradient = np.zeros_like(TABLE, np.float64)
    for bag, row_ids in zip(sums, IDS):
        for i in row_ids:
            if i >= 0:
                want_gradient[i] += 2 * bag
    np.testing.assert_allclose(got["table_gradient"], want_gradient, rtol=1e-6)
    # int8 rows are within half a quantisation step (range / 255 / 2) of the float ones
    np.testing.assert_allclose(got["int8"], sums, atol=2 * TABLE.max() / 255)


_CHECK_KERNELS = """
import sys
import tensorflow as tf
if sys.argv[1] == "late":
    tf.constant(1.0) + 1.0  # TF builds its XLA JIT kernels before the op library is loaded
import pkm_serve.ops
tf.constant(1.0) + 1.0
from tensorflow.python.framework import kernels
print(sorted({k.device_type for k in kernels.get_registered_kernels_for_op("PkmCheckThen").kernel}))
"""


@pytest.mark.parametrize("order", ["early", "late"])
def test_the_run_time_check_compiles_for_every_xla_device(order):
    """PkmCheckThen (a check XLA keeps on the CPU) has a kernel for XLA's GPU JIT too, where it passes
    its value through as XLA drops an Assert: a SavedModel traced under jit_compile on the CPU holds
    it, and compiling it for a GPU found no kernel (whichever way the library was loaded)."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _CHECK_KERNELS, order], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    devices = proc.stdout.strip().splitlines()[-1]
    assert "'XLA_CPU_JIT'" in devices and "'XLA_GPU_JIT'" in devices, devices
