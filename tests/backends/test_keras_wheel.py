"""The TF-free Keras wheel (dist/pkm_serve_keras-*.whl, `make wheel-keras`) installed
on its own: under KERAS_BACKEND=jax and =torch its layers run our kernels from the
wheel's own libraries, and TensorFlow is never imported."""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = r"""
import os, sys
import numpy as np
import keras
import pkm_serve
from pkm_serve import backends
from pkm_serve.backends import _native
from pkm_serve.layers import EmbeddingBag
target = sys.argv[1]
assert pkm_serve.__file__.startswith(target), pkm_serve.__file__
assert backends.kernel_device() == "cpu", backends.kernel_device()
lib = _native.library_path(keras.backend.backend(), "cpu")
assert lib.startswith(target), lib
layer = EmbeddingBag(20, 3, combiner="mean")
layer.build()
table = np.arange(60, dtype="float32").reshape(20, 3)
layer.embeddings.assign(table)
out = keras.ops.convert_to_numpy(layer(np.array([[1, 4, -1], [-1, -1, -1]], "int32")))
np.testing.assert_allclose(out, [(table[1] + table[4]) / 2, np.zeros(3)])
assert "tensorflow" not in sys.modules, "the Keras wheel imported TensorFlow"
print("wheel ok", keras.backend.backend())
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    wheels = glob.glob(os.path.join(ROOT, "dist", "pkm_serve_keras-*.whl"))
    if not wheels:
        pytest.skip("no dist/pkm_serve_keras-*.whl: run `make wheel-keras`")
    target = str(tmp_path_factory.mktemp("keras_wheel"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                    "--target", target, wheels[0]], check=True)
    return target


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_wheel_runs_without_tensorflow(installed, backend, tmp_path):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=installed)
    env.pop("PKM_SERVE_LIB_DIR", None)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, installed], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "wheel ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
