"""ProductKeyMemory under mixed_bfloat16 in jax.jit against the TF backend (the reference):
XLA kept float32 between the query projection's bfloat16 ops under jit, so the query
rounded otherwise than eager JAX and TF, and 14 of 256 rows read other slots (outputs
29% apart). Each backend runs in its own interpreter (a Keras backend is per process)."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")

_SCRIPT = """
import sys
import numpy as np
import keras
import pkm_serve.layers  # registers the layers for load_model
from tests.backends.backend_checks import _mixed_inputs, _mixed_pkm_model
path = sys.argv[1]
if keras.backend.backend() == "jax":
    import jax
    model = _mixed_pkm_model()
    model.save(path + ".keras")
    np.save(path + ".jit.npy", np.asarray(jax.jit(lambda x: model(x))(_mixed_inputs())).astype("float32"))
else:
    model = keras.models.load_model(path + ".keras")
    np.save(path + ".tf.npy", keras.ops.convert_to_numpy(model(_mixed_inputs())).astype("float32"))
"""


def _run(backend, path):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, path], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_mixed_bfloat16_pkm_under_jax_jit_matches_tf(tmp_path):
    path = str(tmp_path / "mixed")
    _run("jax", path)
    _run("tensorflow", path)
    got, want = np.load(path + ".jit.npy"), np.load(path + ".tf.npy")
    # The same slots: outputs differ by bfloat16 rounding only (as test_backends' .keras round trip).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.max(np.abs(want)))
