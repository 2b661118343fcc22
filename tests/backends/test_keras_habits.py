"""Keras habits around EmbeddingBag / ProductKeyMemory on the TensorFlow, JAX and PyTorch backends,
each backend in its own process (keras_habit_checks.py holds the checks). A backend that is not
installed is skipped."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKENDS = ["tensorflow", "jax", "torch"]
CHECKS = ["table_dtype", "half_float_ids", "mask", "batch_axis", "tied_table"]


def run_checks(backend, checks, extra_env=None):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **(extra_env or {}))
    proc = subprocess.run([sys.executable, "-m", "tests.backends.keras_habit_checks", *checks], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{backend} {checks} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_habits(backend):
    """table_dtype: under mixed_bfloat16 / mixed_float16 a direct call reads the float32 table (it read a
    16-bit copy: 0.02 off, and off the same layer in a model). half_float_ids: float ids that a
    subclassed Model rounded to 16 bits (257 -> 256) are a clear error (they read other rows). mask: a
    Keras mask over the leading dims passes on to a following pooling (it was dropped). batch_axis:
    keras.Input(shape=()) ids are a clear error (the whole batch was one bag). tied_table: a layer tying
    its weights to the table reads it in its compute dtype, as keras.layers.Embedding's."""
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed (requirements-backends.lock)")
    assert run_checks(backend, CHECKS) == dict.fromkeys(CHECKS, "ok")
