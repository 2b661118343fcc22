"""`make wheel`'s targets are the wheel files: an empty (or deleted) dist/ gets every wheel
(TF, device, Keras) written again, and a wheel missing from dist/ is rebuilt while the ones
present are left alone. Runs make on a scratch DIST so the checkout's dist/ is untouched."""
import os
import subprocess
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _make(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "-C", ROOT, "--no-print-directory", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def _wheel_paths(dist):
    out = subprocess.run(["python3", os.path.join(ROOT, "packaging", "build_wheels.py"), "names",
                          "--dist", str(dist)], capture_output=True, text=True, check=True)
    return out.stdout.split()[:2]  # the TF and the x86-64 device wheel


@pytest.mark.slow
def test_make_wheel_writes_every_wheel_missing_from_dist(tmp_path):
    dist = tmp_path / "dist"  # does not exist: as after `rm -rf dist`
    tf_wheel, device_wheel = _wheel_paths(dist)
    keras_wheel = os.path.join(dist, "pkm_serve_keras-0.1.0-py3-none-manylinux_2_35_x86_64.whl")
    assert os.path.basename(tf_wheel).startswith("pkm_serve-0.1.0-cp")
    built = _make("wheel", f"DIST={dist}")
    assert built.returncode == 0, built.stderr[-3000:]
    assert sorted(os.listdir(dist)) == sorted(map(os.path.basename, (tf_wheel, device_wheel, keras_wheel)))
    for wheel in (tf_wheel, device_wheel, keras_wheel):
        assert zipfile.ZipFile(wheel).testzip() is None
    # Up to date now: nothing to rebuild.
    assert _make("-q", "wheel", f"DIST={dist}").returncode == 0
    # One wheel deleted: only its build runs.
    os.remove(device_wheel)
    plan = _make("-n", "wheel", f"DIST={dist}")
    builds = [line for line in plan.stdout.splitlines() if "build_wheels.py" in line]
    assert builds == [f".venv/bin/python packaging/build_wheels.py device --dist {dist}"], plan.stdout
