"""pkm_serve uses three private TF APIs for forward-mode autodiff (a table of
special-case jvps, a query for an active accumulator's tangents, a reset of a
busy accumulator) and pfor's converter registry (tf.vectorized_map). A TF
without them must still import pkm_serve and look up and differentiate as
before; only those jvps and the vectorized lookup are lost."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One child process imports TF once (~5 s of CPU) and forks one grandchild per case; each case
# removes its private APIs and imports pkm_serve in its own fresh grandchild, as a process that
# had only imported TF would. Each case's exit status, stdout and stderr come back separately.
_FORKING_DRIVER = """
import json, os, sys, tempfile, traceback
import tensorflow  # noqa: F401  (the shared cost; pkm_serve is imported by each case)
cases, results = json.loads(sys.stdin.read()), {}
for name, script in cases.items():
    paths = [tempfile.mkstemp()[1] for _ in range(2)]
    pid = os.fork()
    if pid == 0:
        for fd, path in zip((1, 2), paths):
            os.dup2(os.open(path, os.O_WRONLY), fd)
        status = 0
        try:
            exec(compile(script, name, "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    outputs = []
    for path in paths:
        with open(path) as f:
            outputs.append(f.read())
        os.unlink(path)
    results[name] = [os.waitstatus_to_exitcode(wait_status), *outputs]
print(json.dumps(results))
"""

_SCRIPT = """
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import forwardprop, forwardprop_util
from tensorflow.python.ops.parallel_for import pfor
del forwardprop._SPECIAL_CASES, forwardprop_util.push_forwardprop_state, forwardprop_util.pack_tangents
del pfor.RegisterPFor
import warnings
warnings.simplefilter("error")  # a failed registration is only a RuntimeWarning in pkm_serve/__init__
from pkm_serve import ops
table = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
ids = tf.constant([[0, 2], [1, -1]])
w = tf.constant([[1.0, 2.0], [3.0, 0.0]])
for sparse in (False, True):
    with tf.GradientTape() as tape:
        out = ops.embedding_bag(table, ids, weights=w, sparse_gradient=sparse)
    d_table = tf.convert_to_tensor(tape.gradient(out, table))
    print(out.numpy().ravel().tolist(), d_table.numpy().ravel().tolist())
"""


@pytest.fixture(scope="module")
def case_runs():
    """{case: (exit status, stdout, stderr)} of both scripts."""
    cases = {"no_forward_mode_apis": _SCRIPT, "no_tape_query": _NO_RECORD_SCRIPT}
    proc = subprocess.run([sys.executable, "-c", _FORKING_DRIVER], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: tuple(result) for name, result in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def test_lookups_and_gradients_work_without_the_private_forward_mode_apis(case_runs):
    returncode, stdout, stderr = case_runs["no_forward_mode_apis"]
    assert returncode == 0, stderr[-3000:]
    table = np.arange(12, dtype=np.float64).reshape(4, 3)
    out = np.stack([table[0] + 2 * table[2], 3 * table[1]]).ravel().tolist()
    d_table = np.array([[1.0] * 3, [3.0] * 3, [2.0] * 3, [0.0] * 3]).ravel().tolist()
    lines = stdout.strip().splitlines()
    assert len(lines) == 2, stdout
    for line in lines:
        assert line == f"{out} {d_table}"


_NO_RECORD_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
import tensorflow.python.eager as eager
del eager.record  # TF's own modules keep theirs; `from tensorflow.python.eager import record` fails
sys.modules["tensorflow.python.eager.record"] = None
from pkm_serve import ops
table = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
ids = tf.constant([[0, 2], [1, -1]])
w = tf.constant([[1.0, 2.0], [3.0, 0.0]])

def step():
    with tf.GradientTape() as tape:
        out = ops.embedding_bag(table, ids, weights=w, sparse_gradient=True)
    return out, tf.convert_to_tensor(tape.gradient(out, table))

for run in (step, tf.function(step, jit_compile=True)):
    out, d_table = run()
    print(out.numpy().ravel().tolist(), d_table.numpy().ravel().tolist())
"""


def test_sparse_gradient_without_the_private_tape_query_falls_back_to_correct_gradients(case_runs):
    """A TF without ``record.could_possibly_record``: the eager lookup reads the variable in the kernel
    and under XLA the dense-gradient op runs; both give the reference numbers (an ImportError before)."""
    returncode, stdout, stderr = case_runs["no_tape_query"]
    assert returncode == 0, stderr[-3000:]
    table = np.arange(12, dtype=np.float64).reshape(4, 3)
    out = np.stack([table[0] + 2 * table[2], 3 * table[1]]).ravel().tolist()
    d_table = np.array([[1.0] * 3, [3.0] * 3, [2.0] * 3, [0.0] * 3]).ravel().tolist()
    assert stdout.strip().splitlines() == [f"{out} {d_table}"] * 2, stdout
