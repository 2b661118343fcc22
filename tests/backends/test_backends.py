"""The layers and ops on the JAX and PyTorch Keras backends, each in its own
process (a Keras backend is fixed per process): numbers vs the float64
reference, errors, jit/vmap and torch.compile, fit, memory, no TensorFlow
import, and .keras files moving between backends (TF included).

The checks themselves are in backend_checks.py; jax and torch come from
requirements-backends.lock. A backend that is not installed is skipped.
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKENDS = ["jax", "torch"]


def run_checks(backend, *args, timeout=240):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed (requirements-backends.lock)")
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tests.backends.backend_checks", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{backend} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_layers_and_fit(backend):
    """Forward/d_table/d_weights vs float64 (fp32/fp16/bf16, 3 combiners, ragged),
    clear errors, jit/vmap or opcheck + torch.compile, no TF import, fit learns."""
    out = run_checks(backend, "no_tf", "ops", "errors", "transforms", "fit")
    assert '"ops_cases": 21' in out, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_backward_memory(backend):
    """fwd+bwd at B=4096 K=128 D=512 grows the process < 600 MB (asserted in the check)."""
    assert "memory_growth_mb" in run_checks(backend, "memory")


def test_keras_file_moves_between_backends(tmp_path):
    """One .keras file saved under JAX loads under PyTorch and TensorFlow (and one
    saved under PyTorch under JAX) with the same outputs."""
    saved = {}
    for backend in BACKENDS:
        path, out = tmp_path / f"{backend}.keras", tmp_path / f"{backend}_out.npy"
        run_checks(backend, "save", str(path), str(out))
        saved[backend] = (path, np.load(out))
    for source, target in [("jax", "torch"), ("jax", "tensorflow"), ("torch", "jax")]:
        out = tmp_path / f"{source}_in_{target}.npy"
        run_checks(target, "load", str(saved[source][0]), str(out))
        np.testing.assert_allclose(np.load(out), saved[source][1], rtol=1e-5, atol=1e-5,
                                   err_msg=f"saved under {source}, loaded under {target}")
