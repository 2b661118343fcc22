"""A check module run in a process of its own with KERAS_BACKEND set (a Keras backend is fixed per
process): backend_checks.py and keras_habit_checks.py print one JSON line per check passed."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(backend, args, module="backend_checks"):
    env = dict(os.environ, KERAS_BACKEND=backend, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", f"tests.backends.{module}", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, what, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed:\n{out[-3000:]}\n{err[-3000:]}"
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results


def installed(backend):
    return importlib.util.find_spec(backend) is not None


def results_by_backend(tmp_path_factory, checks, module, export_check):
    """result(backend) -> that backend's printed results: one process per backend of `checks`
    ({backend: [check, ...]}) started now, side by side, and waited for at the first ask.
    `export_check` needs TensorFlow too and gets a fresh SavedModel path after its name; a backend
    that is not installed (or lacks TensorFlow for it) is skipped."""
    import pytest

    procs = {}
    for backend, names in checks.items():
        if not installed(backend) or (export_check in names and not installed("tensorflow")):
            continue
        args = []
        for check in names:
            args += [check] + ([str(tmp_path_factory.mktemp("export") / "saved")] if check == export_check else [])
        procs[backend] = start(backend, args, module=module)
    done = {}

    def result(backend):
        if backend not in procs:
            pytest.skip(f"{backend} (or TensorFlow for {export_check}) is not installed")
        if backend not in done:
            done[backend] = finish(procs[backend], f"{backend} {checks[backend]}")
        return done[backend]

    return result
