"""The TF wheel `make wheel-tf` wrote (dist/pkm_serve-*.whl): what it holds,
what it declares, how auditwheel sees it, and that the build refuses a wheel
that carries a copy of TensorFlow's libraries. Installing it in a fresh venv and
running the README's habits is tests/packaging/test_installed_wheel.py."""
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version

import pytest

from tests.built_wheels import built_wheel, packaging_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel():
    return built_wheel("pkm_serve-*.whl", "TF", "wheel-tf")


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
    assert set(report["external_libs"]) == TF_LIBRARIES, report["external_libs"]


TF_LIBRARIES = {"libtensorflow_framework.so.2", "libtensorflow_cc.so.2"}


def _readelf_dynamic(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                         check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", out)
    return needed, runpath


def test_bundles_no_tensorflow_library_and_stays_small(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if ".libs/" in n or "libtensorflow" in n], names
    so_files = sorted(n for n in names if ".so" in n)
    assert so_files == ["pkm_serve/lib/_pkm_ops.so", "pkm_serve/lib/libpkm_tflite.so"], so_files
    assert os.path.getsize(wheel) < 20 * 2**20, os.path.getsize(wheel)


def test_op_library_finds_tensorflow_in_the_installed_tensorflow_package(wheel, tmp_path):
    op_lib = zipfile.ZipFile(wheel).extract("pkm_serve/lib/_pkm_ops.so", tmp_path)
    needed, runpath = _readelf_dynamic(op_lib)
    assert TF_LIBRARIES <= needed, needed
    # site-packages/pkm_serve/lib/ -> site-packages/tensorflow/
    assert runpath == ["$ORIGIN/../../tensorflow"], runpath
    # Laid out as pip installs it, next to this venv's tensorflow, the loader resolves TF's
    # libraries there (ldd loads nothing: it only reports the resolution).
    import tensorflow as tf
    site = tmp_path / "site-packages"
    shutil.copytree(tmp_path / "pkm_serve", site / "pkm_serve")
    os.symlink(tf.sysconfig.get_lib(), site / "tensorflow")
    ldd = subprocess.run(["ldd", str(site / "pkm_serve/lib/_pkm_ops.so")], capture_output=True,
                         text=True, check=True).stdout
    for lib in TF_LIBRARIES:
        line = next(x for x in ldd.splitlines() if x.strip().startswith(lib))
        assert f"pkm_serve/lib/../../tensorflow/{lib}" in line, ldd


def test_build_refuses_a_wheel_with_a_grafted_tensorflow_library(wheel, tmp_path):
    build_wheels = packaging_module("build_wheels")
    good_report = {"external_libs": dict.fromkeys(TF_LIBRARIES)}
    build_wheels._check_tf_wheel(wheel, TF_LIBRARIES, good_report)  # the real one passes
    # What `auditwheel repair --exclude libtensorflow_framework.so.2` alone made: the other TF
    # library copied in (a stand-in file here), and no longer external for `auditwheel show`.
    grafted = str(tmp_path / os.path.basename(wheel))
    shutil.copy(wheel, grafted)
    with zipfile.ZipFile(grafted, "a") as z:
        z.writestr("pkm_serve.libs/libtensorflow_cc-2889ecc9.so.2", b"\x7fELF")
    with pytest.raises(build_wheels.PackagingError, match="grafted libraries"):
        build_wheels._check_tf_wheel(grafted, TF_LIBRARIES, good_report)
    with pytest.raises(build_wheels.PackagingError,
                       match=r"auditwheel show finds \['libtensorflow_cc.so.2'\] inside"):
        build_wheels._check_tf_wheel(
            wheel, TF_LIBRARIES, {"external_libs": {"libtensorflow_framework.so.2": None}})
    with pytest.raises(build_wheels.PackagingError, match="besides TensorFlow's.*libfoo"):
        build_wheels._check_tf_wheel(
            wheel, TF_LIBRARIES, {"external_libs": {**good_report["external_libs"], "libfoo.so": None}})
