"""pkm_serve.backends.embedding_bag runs on Keras' backend, not on the tensor's framework. Under the default
TensorFlow backend a CPU torch tensor was taken as an array (a tf.Tensor came back) and one that requires
grad failed in torch's words ("Can't call numpy() on Tensor that requires grad"; round 49's audit). Another
framework's tensor is now a TypeError naming KERAS_BACKEND, under TF and JAX; their own tensors and numpy
arrays still give the numpy reference's numbers. One interpreter per backend (Keras fixes it per process)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = """
import json
import jax.numpy as jnp, numpy as np, tensorflow as tf, torch
from pkm_serve import backends
table = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
ids = np.array([[1, 2, -1], [5, 5, 0]], np.int64)
want = table[[1, 2]].sum(0), table[[5, 5, 0]].sum(0)
made = {"torch": lambda x: torch.tensor(x), "torch_grad": lambda x: torch.tensor(x, requires_grad=x.dtype.kind == "f"),
        "jax": jnp.asarray, "tensorflow": tf.constant, "numpy": lambda x: x}
report = {}
for name, make in made.items():
    try:
        out = np.asarray(backends.embedding_bag(make(table), make(ids)))
        report[name] = "ok" if np.allclose(out, np.stack(want), rtol=1e-6, atol=1e-6) else f"wrong {out.tolist()}"
    except TypeError as err:
        report[name] = "TypeError: " + str(err)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def reports():
    procs = {}
    for backend in ("tensorflow", "jax"):
        env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=ROOT)
        procs[backend] = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)
    out = {}
    for backend, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[backend] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_another_frameworks_tensor_names_keras_backend(reports, backend):
    report = reports[backend]
    for framework in ("torch", "torch_grad", "jax", "tensorflow"):
        native = framework == backend
        if native:
            assert report[framework] == "ok", report
            continue
        wanted = framework.split("_")[0]
        assert report[framework].startswith("TypeError: ") and f"is a {wanted} tensor" in report[framework] and \
            f"KERAS_BACKEND={wanted}" in report[framework] and repr(backend) in report[framework], report
    assert report["numpy"] == "ok", report
