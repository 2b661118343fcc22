"""The pip user's path, as `make test` runs it: a real fresh venv (no system site-packages)
pip-installs the built TF wheel with [serving,tflite] (pinned like requirements.lock; pip's
cache allowed; the venv is made --without-pip and this interpreter's pip installs into it),
then packaging/check_installed_wheel.py runs from another directory with `python -I`, so
nothing of the checkout is on sys.path: the op library's TF libraries, `import pkm_serve,
keras`, the README tour, .keras round trips (custom optimizers, a mixed_bfloat16
PKM reloaded under float32), `pkm-serve export --tflite` of a composite model and `pkm-serve
serve` answering REST and gRPC Predict. Took 2-4 min here, most of it pip installing
TensorFlow from the cache."""
import os
import resource
import subprocess
import sys
import time

import pytest

from tests.built_wheels import built_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tf_wheel():
    return built_wheel("pkm_serve-*.whl", "TF", "wheel-tf")


def _children_cpu():
    """User + system CPU seconds of the waited-for subprocesses so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _clean_env():
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("TF_CPP")}


@pytest.mark.slow
def test_fresh_venv_with_the_installed_tf_wheel_runs_the_users_journey(tmp_path):
    wheel = _tf_wheel()
    venv = tmp_path / "venv"
    started, cpu_started = time.monotonic(), _children_cpu()
    # --without-pip: ensurepip's own install of pip into the venv (~5 s of CPU) is no part of the
    # check; this interpreter's pip installs into the venv (--python runs pip under the venv's
    # interpreter, so the resolution, the unpacking and the scheme are the venv's).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    with open(venv / "pyvenv.cfg") as f:
        assert "include-system-site-packages = false" in f.read()
    # --no-compile: no bytecode for TF's thousands of modules up front (Python compiles what the
    # journey imports); the install itself is the same.
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--disable-pip-version-check", "--no-compile",
         "-c", os.path.join(ROOT, "requirements.lock"), f"{wheel}[serving,tflite]"],
        capture_output=True, text=True, env=_clean_env(), timeout=900)
    assert pip.returncode == 0, pip.stderr[-4000:]
    installed, cpu_installed = time.monotonic(), _children_cpu()
    work = tmp_path / "elsewhere"  # not the checkout: -I keeps its cwd off sys.path anyway
    work.mkdir()
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-I", os.path.join(ROOT, "packaging",
                                                          "check_installed_wheel.py")],
        capture_output=True, text=True, cwd=str(work), env=_clean_env(), timeout=900)
    done, cpu_done = time.monotonic(), _children_cpu()
    print(f"venv + pip install {installed - started:.0f} s (cpu {cpu_installed - cpu_started:.1f} s), "
          f"journey {done - installed:.0f} s (cpu {cpu_done - cpu_installed:.1f} s)")
    assert check.returncode == 0, (check.returncode, check.stdout[-4000:], check.stderr[-6000:])
    steps = [line for line in check.stdout.splitlines() if line.startswith("[wheel-check]")]
    assert len(steps) == 6 and steps[-1].startswith("[wheel-check] PASSED"), check.stdout
