"""A SavedModel saved from jit_compile functions, loaded in a process where TF ran an op before
pkm_serve was imported: TF had built its XLA JIT kernels without ours, and only tracing
ops.embedding_bag (or quantized.embedding_bag) added them, which loading a SavedModel never does.
Also the run-time check PkmCheckThen: its XLA kernels in either order of loading, and its lowering
when TF ran first (moved here from test_xla_round34_run_time_checks.py to share this file's process)."""

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


# Each case of a process where TF ran an op before pkm_serve was imported, in one such process (one
# TF start), in an order that keeps each case's start: the kernels are listed before anything is
# traced or compiled, the SavedModel is loaded and run before any pkm_serve function is traced.
_LATE = """
import sys, json
import tensorflow as tf
tf.constant(1.0) + 1.0  # TF builds its XLA JIT kernels here, before the op library is loaded
import pkm_serve
import pkm_serve.ops
tf.constant(1.0) + 1.0
from tensorflow.python.framework import kernels
print("kernels", sorted({{k.device_type for k in kernels.get_registered_kernels_for_op("PkmCheckThen").kernel}}))
try:  # a failure here is this case's alone: the next ones still run
    model = tf.saved_model.load(sys.argv[1])
    ids = tf.constant({ids}, tf.int64)
    print("saved_model", json.dumps({{name: getattr(model, name)(ids).numpy().tolist()
                                     for name in ("dense", "table_gradient", "int8")}}))
except Exception as err:
    print("saved_model_error", type(err).__name__, " ".join(str(err).split())[:3000])
from pkm_serve import ops
f = tf.function(lambda c: ops.load_library().pkm_check_then(c, tf.constant(2.0), message='bad bags'),
                jit_compile=True)
print("check_then", f(tf.constant(True)).numpy())
try:
    f(tf.constant(False))
except tf.errors.InvalidArgumentError as err:
    print("check_then", str(err).splitlines()[0])
"""

_EARLY_KERNELS = """
import tensorflow as tf
import pkm_serve.ops
tf.constant(1.0) + 1.0
from tensorflow.python.framework import kernels
print("kernels", sorted({k.device_type for k in kernels.get_registered_kernels_for_op("PkmCheckThen").kernel}))
"""


@pytest.fixture(scope="module")
def saved_model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("jit_saved_model"))
    tf.saved_model.save(_Lookups(), path)
    return path


def _printed(script, *args):
    """(process, {name: [printed values, in order]}) of `script` run in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env=env)
    printed = {}
    for line in proc.stdout.strip().splitlines():
        name, _, value = line.partition(" ")
        printed.setdefault(name, []).append(value)
    return proc, printed


@pytest.fixture(scope="module")
def late(saved_model_dir):
    return _printed(_LATE.format(ids=IDS), saved_model_dir)


@pytest.fixture(scope="module")
def early():
    return _printed(_EARLY_KERNELS)


def test_jit_saved_model_runs_when_tf_ran_before_pkm_serve_was_imported(late):
    import json

    proc, printed = late
    assert "saved_model" in printed, printed.get("saved_model_error") or proc.stderr[-3000:]
    got = json.loads(printed["saved_model"][0])
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


@pytest.mark.parametrize("order", ["early", "late"])
def test_the_run_time_check_compiles_for_every_xla_device(order, request):
    """PkmCheckThen (a check XLA keeps on the CPU) has a kernel for XLA's GPU JIT too, where it passes
    its value through as XLA drops an Assert: a SavedModel traced under jit_compile on the CPU holds
    it, and compiling it for a GPU found no kernel (whichever way the library was loaded)."""
    proc, printed = request.getfixturevalue(order)
    assert "kernels" in printed, proc.stderr[-3000:]
    devices = printed["kernels"][0]
    assert "'XLA_CPU_JIT'" in devices and "'XLA_GPU_JIT'" in devices, devices


def test_check_lowering_registered_when_tf_ran_first(late):
    """PkmCheckThen's XLA kernel is added late, as the lookups' are (pkm_xla_register_late)."""
    proc, printed = late
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = printed.get("check_then", [])
    assert len(lines) == 2 and lines[0] == "2.0" and lines[1].startswith("bad bags"), proc.stdout
