"""TF's auto-clustering on the CPU (TF_XLA_FLAGS="--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit")
compiles a plain tf.function's lookup with XLA, where nothing checks that weights masked to another
run-time size than the ids match them: they were read at the ids' positions, zero past their own
size (silent wrong bags). The run-time check XLA keeps (PkmCheckThen) now goes into such graphs too,
so the mismatch is the InvalidArgumentError it is without auto-clustering.

A machine with a GPU clusters its CPU ops too (lookups of the CPU-only op library, or under
tf.device("/CPU:0")): there the check went in only where TF saw no GPU. A GPU is faked for pkm_serve's
decision alone: TF itself sees none and clusters the lookup on the CPU, as it does the CPU lookups of a
GPU machine."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IMPORTS = """
import numpy as np
import tensorflow as tf
from pkm_serve import _xla, ops
"""

_LOOKUPS = """
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
tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()  # asked while a graph is built
"""

_FAKE_GPU = """
real_list = tf.config.list_logical_devices
fake_gpu = tf.config.LogicalDevice("/job:localhost/replica:0/task:0/device:GPU:0", "GPU")
tf.config.list_logical_devices = lambda kind=None: [fake_gpu] if kind == "GPU" else real_list(kind)
"""

_GPU_LIBRARY_DECISIONS = """
_xla._xla_device_types = frozenset({"CPU", "GPU"})  # the op library with GPU kernels
tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
with tf.device("/CPU:0"):
    tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
@tf.function
def scoped():
    with tf.device("/CPU:0"):
        seen.append(_xla.cpu_autoclustering())
scoped()
"""


# Both scripts in one process (one TF start): the plain machine's first, then the faked GPU's, each
# printing its lines under its own prefix. pkm_serve decides per trace (nothing cached), and each
# script traces its own tf.functions.
_PREFIXED_PRINT = """
import builtins
def print(*values):  # each line under the running script's name
    builtins.print(SCRIPT, *values)
"""
_SCRIPTS = {"plain": _LOOKUPS, "gpu_machine": _FAKE_GPU + _LOOKUPS + _GPU_LIBRARY_DECISIONS}


@pytest.fixture(scope="module")
def autoclustered_runs():
    """{script name: {name: printed value}} of each script run with TF's CPU auto-clustering on (TF
    reads TF_XLA_FLAGS once, at start), with the process' stdout and stderr."""
    flags = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit --tf_xla_min_cluster_size=1"
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_XLA_FLAGS": flags}
    script = _IMPORTS + _PREFIXED_PRINT
    for name, body in _SCRIPTS.items():
        script += f"SCRIPT = {name!r}\n{body}\nprint(\"decisions\", seen)\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    lines = {name: {} for name in _SCRIPTS}
    for line in proc.stdout.strip().splitlines():
        name, _, rest = line.partition(" ")
        if name in lines:
            key, _, value = rest.partition(" ")
            lines[name][key] = value
    return proc, lines


def _checked_lines(runs, name):
    """The printed values of script `name`, after checking its bags: the same masks give numpy's
    bags, the mismatch the InvalidArgumentError."""
    proc, lines = runs
    lines = lines[name]
    table = [[3.0 * r + c for c in range(3)] for r in range(10)]
    expected = [[2 * (table[1][c] + 0.5 * table[2][c]) for c in range(3)],
                [2 * (3.0 * table[5][c] + 4.0 * table[6][c]) for c in range(3)]]
    assert proc.returncode == 0 and lines.get("same") == str(expected), proc.stderr[-3000:]
    assert lines["mismatch"] == "InvalidArgumentError True", proc.stdout
    return lines


def test_masked_weights_mismatch_fails_under_cpu_autoclustering(autoclustered_runs):
    assert _checked_lines(autoclustered_runs, "plain")["decisions"] == "[True]"


def test_cpu_lookups_of_a_gpu_machine_are_checked_under_cpu_autoclustering(autoclustered_runs):
    lines = _checked_lines(autoclustered_runs, "gpu_machine")
    # CPU-only library: checked; GPU library: not where the lookup goes to the GPU, checked where a
    # tf.device scope (around the call, or in the function) puts it on the CPU.
    assert lines["decisions"] == "[True, False, True, True]"


@pytest.mark.parametrize("flags, set_jit, expected", [
    ("", True, False),  # TF clusters CPU graphs only with --tf_xla_cpu_global_jit
    ("--tf_xla_cpu_global_jit", False, False),
    ("--tf_xla_cpu_global_jit", True, True),
    ("--tf_xla_cpu_global_jit=false --tf_xla_auto_jit=2", False, False),
    ("--tf_xla_auto_jit=fusible --tf_xla_cpu_global_jit=true", False, True),
    ("--tf_xla_auto_jit=-1 --tf_xla_cpu_global_jit", True, False),
    # single-gpu(N) sets the level of graphs on one GPU; CPU graphs keep the session's (set_jit)
    ("--tf_xla_auto_jit=single-gpu(2) --tf_xla_cpu_global_jit", True, True),
    ("--tf_xla_auto_jit=single-gpu(2) --tf_xla_cpu_global_jit", False, False),
])
def test_which_flags_mean_cpu_autoclustering(monkeypatch, flags, set_jit, expected):
    import tensorflow as tf

    from pkm_serve import _xla

    monkeypatch.setenv("TF_XLA_FLAGS", flags)
    monkeypatch.setattr(tf.config.optimizer, "get_jit", lambda: "autoclustering" if set_jit else "")
    seen = []
    tf.function(lambda: seen.append(_xla.cpu_autoclustering()))()
    assert seen == [expected]
    assert _xla.cpu_autoclustering() is False  # eager ops are never clustered
