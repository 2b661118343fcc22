"""kernels/sources.bzl is the one list of native sources and flags: the Makefile,
the root BUILD and serving/tf_serving/BUILD.pkm_ops must all read it, every
source on disk must be in it, and the reference implementation must stay out
of the production libraries."""
import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from serving_cc_helpers import REPO

sys.path.insert(0, os.path.join(REPO, "kernels"))
from bzl_to_make import read_lists  # noqa: E402

SOURCES = os.path.join(REPO, "kernels", "sources.bzl")
LISTS = read_lists(SOURCES)
NATIVE_DIRS = ["kernels/core", "kernels/tf", "kernels/cuda", "kernels/capi", "tflite_delegate"]


def _make_value(var):
    """A variable as the Makefile (fragments included) resolves it."""
    proc = subprocess.run(["make", "--no-print-directory", "-s", "-C", REPO, f"print-{var}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_every_native_source_on_disk_is_in_exactly_one_list():
    on_disk = set()
    for d in NATIVE_DIRS:
        for ext in ("cc", "cu", "h", "cuh"):
            on_disk.update(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, d, f"*.{ext}")))
    listed = [p for name, values in LISTS.items() if name.endswith(("_SRCS", "_HDRS")) for p in values]
    unlisted = sorted(on_disk - set(listed))
    assert not unlisted, f"add these to a list in kernels/sources.bzl: {unlisted}"
    missing = sorted(set(listed) - on_disk)
    assert not missing, f"kernels/sources.bzl lists files that do not exist: {missing}"
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"in more than one list: {twice}"


def test_reference_is_only_in_the_test_lists():
    reference = LISTS["PKM_CORE_REFERENCE_SRCS"]
    assert reference == ["kernels/core/reference.cc"]
    for name in ("PKM_CORE_SRCS", "PKM_TF_SRCS", "PKM_TF_GPU_SRCS", "PKM_TFLITE_SRCS", "PKM_CUDA_SRCS"):
        assert not set(reference) & set(LISTS[name]), name


@pytest.mark.parametrize("make_var, lists", [
    ("CORE_SRCS", ["PKM_CORE_SRCS"]),
    ("TF_OP_SRCS", ["PKM_TF_SRCS"]),
    ("TFLITE_SRCS", ["PKM_TFLITE_SRCS"]),
    ("CUDA_SRCS", ["PKM_CUDA_SRCS"]),
    ("CORE_CXXFLAGS", ["PKM_CXXSTD", "PKM_CORE_COPTS"]),
    ("TFLITE_CXXFLAGS", ["PKM_CXXSTD", "PKM_CORE_COPTS"]),
])
def test_makefile_reads_the_lists(make_var, lists):
    want = [v for name in lists for v in LISTS[name]]
    got = _make_value(make_var)
    assert [v for v in got if v in want] == want, (make_var, got)
    assert not [v for v in got if v.endswith((".cc", ".cu")) and v not in want]


def test_makefile_compiles_the_tf_adapters_with_the_listed_flags():
    dry = subprocess.run(["make", "--no-print-directory", "-C", REPO, "-B", "-n", "build/tf/embedding_bag_ops.o"],
                         capture_output=True, text=True, timeout=60).stdout
    line = next(li for li in dry.splitlines() if "embedding_bag_ops.cc" in li)
    for flag in LISTS["PKM_CXXSTD"] + LISTS["PKM_TF_COPTS"]:
        assert flag in line.split(), (flag, line)


def _loaded_names(build_file):
    """Names a BUILD file loads from kernels/sources.bzl, and the file's text."""
    with open(build_file) as f:
        text = f.read()
    loads = [n for n in ast.parse(text).body
             if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "load"]
    names = set()
    for call in loads:
        if call.value.args[0].value == ":kernels/sources.bzl":
            names.update(a.value for a in call.value.args[1:])
    return names, text


@pytest.mark.parametrize("build_file, must_use", [
    ("BUILD", {"PKM_CORE_SRCS", "PKM_CORE_REFERENCE_SRCS", "PKM_TF_SRCS", "PKM_TFLITE_SRCS", "PKM_TF_COPTS",
               "PKM_CORE_COPTS"}),
    ("serving/tf_serving/BUILD.pkm_ops", {"PKM_CORE_SRCS", "PKM_TF_SRCS", "PKM_TF_GPU_SRCS", "PKM_CUDA_SRCS",
                                          "PKM_TF_COPTS", "PKM_CORE_COPTS"}),
])
def test_bazel_files_load_the_lists_and_name_no_source_themselves(build_file, must_use):
    names, text = _loaded_names(os.path.join(REPO, build_file))
    assert must_use <= names, must_use - names
    assert names <= set(LISTS), names - set(LISTS)
    code = "\n".join(li.split("#")[0] for li in text.splitlines())
    assert not re.search(r'"(kernels|tflite_delegate)/[^"]*\.(cc|cu|h|cuh)"', code), "a source named outside the list"
    assert "glob(" not in code
    body = re.sub(r"\bload\([^)]*\)", "", code)
    for name in names:
        assert re.search(rf"\b{name}\b", body), f"{name} loaded but unused"


def test_tf_serving_build_has_no_reference_and_stages_the_list(tmp_path):
    _, text = _loaded_names(os.path.join(REPO, "serving/tf_serving/BUILD.pkm_ops"))
    assert "REFERENCE" not in text
    servers = tmp_path / "tensorflow_serving" / "model_servers"
    servers.mkdir(parents=True)
    (servers / "BUILD").write_text("SUPPORTED_TENSORFLOW_OPS = []\n")
    subprocess.run([os.path.join(REPO, "serving/tf_serving/stage_into_tf_serving.sh"), REPO, str(tmp_path)],
                   check=True, capture_output=True)
    ops = tmp_path / "tensorflow_serving" / "custom_ops" / "pkm"
    assert (ops / "kernels" / "sources.bzl").read_text() == open(SOURCES).read()
    names, _ = _loaded_names(str(ops / "BUILD"))
    staged = [p for n in names if n.endswith(("_SRCS", "_HDRS")) for p in LISTS[n]]
    assert staged and all((ops / p).exists() for p in staged), [p for p in staged if not (ops / p).exists()]


def test_production_libraries_hold_no_reference_code():
    """The reference's functions are in the core test only (symbol tables of the built files)."""
    def defined(path):
        out = subprocess.run(["nm", "-C", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        return "pkm::ReferenceForward" in out
    libs = [os.path.join(REPO, "pkm_serve", "lib", n) for n in ("_pkm_ops.so", "libpkm_tflite.so")]
    libs.append(os.path.join(REPO, "build", "serving_cc", "pkm_saved_model_run"))
    for lib in libs:
        if not os.path.exists(lib):
            pytest.fail(f"{lib} not built: run `make build serving-cc-program`")
        assert not defined(lib), f"{lib} contains the reference implementation"
    core_test = os.path.join(REPO, "build", "core_test")
    if os.path.exists(core_test):
        assert defined(core_test)
