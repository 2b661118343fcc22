"""TF's CPU auto-clustering (TF_XLA_FLAGS --tf_xla_cpu_global_jit) clusters the CPU ops of a machine
with a GPU too: lookups of the CPU-only op library, or under tf.device("/CPU:0"), run in CPU clusters
there, where weights masked to another size than the ids were silent wrong bags (the run-time check
went in only where TF saw no GPU). A GPU is faked for pkm_serve's decision alone: TF itself sees
none and clusters the lookup on the CPU, as it does the CPU lookups of a GPU machine."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import numpy as np
import tensorflow as tf
from pkm_serve import _xla, ops

real_list = tf.config.list_logical_devices
fake_gpu = tf.config.LogicalDevice("/job:localhost/replica:0/task:0/device:GPU:0", "GPU")
tf.config.list_logical_devices = lambda kind=None: [fake_gpu] if kind == "GPU" else real_list(kind)
table = np.arange(30, dtype=np.float32).reshape(10, 3)

@tf.function
def lookup(ids, weights, ids_mask, weights_mask):
    out = ops.embedding_bag(table, tf.boolean_mask(ids, ids_mask), tf.boolean_mask(weights, weights_mask))
    return tf.nn.relu(out) * 2.0

ids = tf.constant([[1, 2], [3, 4], [5, 6]])
weights = tf.constant([[1.0, 0.5], [2.0, 0.25], [3.0, 4.0]])
keep = tf.constant([True, False, True])
print("same", lookup(ids, weights, keep, keep).numpy().tolist())
try:
    print("mismatch", lookup(ids, weights, keep, tf.constant([True, True, True])).numpy().tolist())
except tf.errors.InvalidArgumentError as error:
    print("mismatch InvalidArgumentError", "weights must have the shape of indices" in str(error))
seen = []
tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
_xla._xla_device_types = frozenset({"CPU", "GPU"})  # the op library with GPU kernels
tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
with tf.device("/CPU:0"):
    tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
@tf.function
def scoped():
    with tf.device("/CPU:0"):
        seen.append(_xla.cpu_autoclustering())
scoped()
print("decisions", seen)
"""


def test_cpu_lookups_of_a_gpu_machine_are_checked_under_cpu_autoclustering():
    flags = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit --tf_xla_min_cluster_size=1"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_XLA_FLAGS": flags}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    table = [[3.0 * r + c for c in range(3)] for r in range(10)]
    expected = [[2 * (table[1][c] + 0.5 * table[2][c]) for c in range(3)],
                [2 * (3.0 * table[5][c] + 4.0 * table[6][c]) for c in range(3)]]
    assert lines["same"] == str(expected), proc.stderr[-3000:]
    assert lines["mismatch"] == "InvalidArgumentError True", proc.stdout
    # CPU-only library: checked; GPU library: not where the lookup goes to the GPU, checked where a
    # tf.device scope (around the call, or in the function) puts it on the CPU.
    assert lines["decisions"] == "[True, False, True, True]", proc.stderr[-3000:]


@pytest.mark.parametrize("flags, set_jit, expected", [
    # single-gpu(N) sets the level of graphs on one GPU; CPU graphs keep the session's (set_jit)
    ("--tf_xla_auto_jit=single-gpu(2) --tf_xla_cpu_global_jit", True, True),
    ("--tf_xla_auto_jit=single-gpu(2) --tf_xla_cpu_global_jit", False, False),
])
def test_single_gpu_auto_jit_leaves_cpu_graphs_at_the_session_level(monkeypatch, flags, set_jit, expected):
    import tensorflow as tf

    from pkm_serve import _xla

    monkeypatch.setenv("TF_XLA_FLAGS", flags)
    monkeypatch.setattr(tf.config.optimizer, "get_jit", lambda: "autoclustering" if set_jit else "")
    seen = []
    tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
    assert seen == [expected]
