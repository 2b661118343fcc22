"""The TF wheel `make wheel-tf` wrote (dist/pkm_serve-*.whl): what it holds,
what it declares, how auditwheel sees it. Installing it in a fresh venv and
running the README's habits is `make wheel-check` (about 4 minutes, most of it
pip installing TensorFlow)."""
import glob
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import version

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel():
    wheels = glob.glob(os.path.join(ROOT, "dist", "pkm_serve-*.whl"))
    if len(wheels) != 1:
        pytest.fail(f"expected one TF wheel in dist/, found {wheels}: run `make wheel-tf`")
    return wheels[0]


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_holds_the_package_and_both_native_libraries(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("pkm_serve/lib/_pkm_ops.so", "pkm_serve/lib/libpkm_tflite.so",
                     "pkm_serve/ops.py", "pkm_serve/cli.py", "pkm_serve/layers/__init__.py",
                     "pkm_serve/export/exporter.py", "pkm_serve/serving/server.py"):
        assert required in names, required
    tracked = subprocess.run(["git", "ls-files", "pkm_serve"], capture_output=True, text=True,
                             cwd=ROOT, check=True).stdout.split()
    assert set(tracked) <= names, sorted(set(tracked) - names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_declares_the_tensorflow_it_was_built_against_and_the_extras(wheel):
    meta = _metadata(wheel)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    assert f"tensorflow=={version('tensorflow')}" in requires
    assert any(r.startswith("numpy") for r in requires)
    extras = {line.split(":", 1)[1].strip() for line in meta.splitlines()
              if line.startswith("Provides-Extra:")}
    assert {"serving", "tflite"} <= extras
    assert any(r.startswith("tensorflow-serving-api") and 'extra == "serving"' in r
               for r in requires)
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(next(n for n in z.namelist()
                                   if n.endswith("entry_points.txt"))).decode()
    assert "pkm-serve = pkm_serve.cli:main" in entry_points


def test_is_platform_tagged_and_only_tensorflow_is_external(wheel):
    name = os.path.basename(wheel)
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{py}-{py}-manylinux_" in name and name.endswith("_x86_64.whl"), name
    report = json.loads(subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", wheel], capture_output=True,
        text=True, check=True).stdout)
    assert set(report["external_libs"]) == {"libtensorflow_framework.so.2"}, report
