"""libpkm_tflite.so cross-built for aarch64, run in aarch64 TFLite interpreters
(tflite_runtime 2.14, ai-edge-litert 2.3) under qemu-user, compared with the
x86 outputs of the same .tflite files (tests/aarch64/fixtures, written on x86
by make_fixtures.py).

The aarch64 tests need the environment `make test-aarch64` prepares (the arm64
root and wheels under .cache/aarch64, build/aarch64/libpkm_tflite.so; or
$PKM_AARCH64_CACHE and $PKM_AARCH64_LIB); without it they are skipped. The
fixture checks at the top run everywhere: they keep the stored x86 outputs
honest (numpy float64 reference) and current (the x86 build reproduces them).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(HERE, "fixtures")
sys.path.insert(0, HERE)

from run_on_device import run_case  # noqa: E402
from tests.reference import embedding_bag  # noqa: E402

with open(os.path.join(FIXTURES, "manifest.json")) as _f:
    MANIFEST = json.load(_f)
CASES = {c["name"]: c for c in MANIFEST["cases"]}
ARRAYS = dict(np.load(os.path.join(FIXTURES, "cases.npz")))
TABLE = ARRAYS["table"]
INTERPRETERS = ("tflite_runtime", "litert")
OUTPUT_CASES = sorted(n for n, c in CASES.items() if c["error"] is None)
ERROR_CASES = sorted(n for n, c in CASES.items() if c["error"] is not None)
REGENERATE = "regenerate with `.venv/bin/python tests/aarch64/make_fixtures.py` if the change is intended"

def _prepared(path, *stamps):
    return path if all(os.path.exists(os.path.join(path, s)) for s in stamps) else None


# What `make test-aarch64` (or `make test`, through TEST_DEPS) prepares; the
# variables override the default places.
A64_CACHE = os.environ.get("PKM_AARCH64_CACHE") or _prepared(
    os.path.join(ROOT, ".cache", "aarch64"), "root/.unpacked", "site-tflite_runtime/.installed",
    "site-litert/.installed")
_DEFAULT_LIB = os.path.join(ROOT, "build", "aarch64", "libpkm_tflite.so")
A64_LIB = os.environ.get("PKM_AARCH64_LIB") or (_DEFAULT_LIB if os.path.isfile(_DEFAULT_LIB) else None)
# The oldest core qemu models: ARMv8.0-A with NEON, no dot product, fp16
# arithmetic or SVE. The library must run there; the root's /proc/cpuinfo says
# the same (tests/aarch64/cpuinfo-cortex-a53), for XNNPACK's CPU detection.
A64_CPU = "cortex-a53"
needs_aarch64 = pytest.mark.skipif(
    not (A64_CACHE and A64_LIB),
    reason="aarch64 environment not set up: run `make test-aarch64`")


def inputs_of(name):
    return [ARRAYS[f"{name}/input_{i}"] for i in range(CASES[name]["n_inputs"])]


def x86_outputs(name):
    return [ARRAYS[f"{name}/x86_output_{i}"] for i in range(CASES[name]["n_outputs"])]


def dequantised_table():
    """The int8 model's table as the kernel must read it: float32(scale * q),
    q = round(x / scale), scale = max|row| / 127 (pkm_serve.tflite's scheme)."""
    max_abs = np.abs(TABLE).max(axis=1)
    scales = (max_abs / 127.0).astype(np.float32)
    q = np.clip(np.rint(TABLE / scales[:, None]), -127, 127).astype(np.float32)
    return scales[:, None] * q


def assert_same_as_x86(name, got, expected):
    compare = CASES[name]["compare"]
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape)
    if compare == "fp32":
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6, err_msg=name)
    elif compare == "fp16":
        # Within one fp16 ulp of x86 (the float32 accumulations may round apart).
        ulp = np.spacing(np.abs(expected)).astype(np.float32)
        assert np.all(np.abs(got.astype(np.float32) - expected.astype(np.float32)) <= ulp), name
    else:
        assert compare == "exact", compare
        np.testing.assert_array_equal(got, expected, err_msg=name)


# ---- the fixtures themselves (x86; run by `make test` too) ------------------------

@pytest.mark.parametrize("name", OUTPUT_CASES)
def test_stored_x86_outputs_match_numpy_float64(name):
    case = CASES[name]
    inputs = inputs_of(name)
    idx = inputs[0].astype(np.int64)
    w = inputs[1].astype(np.float32) if len(inputs) > 1 else None
    (out,) = x86_outputs(name)
    if name.startswith("op_int8"):
        table = dequantised_table()
    elif name.startswith("op_fp16"):
        table = TABLE.astype(np.float16).astype(np.float32)
    else:
        table = TABLE
    combiner = next((c for c in ("mean", "sqrtn") if c in name), "sum")
    expect = embedding_bag(table, idx, w, combiner)
    if case["compare"] == "exact":
        # One index of weight 1 per bag: the output is exactly the dequantised row.
        assert (np.sum(idx >= 0, axis=1) == 1).all() and (w == 1).all()
        np.testing.assert_array_equal(out, table[idx[:, 0]])
    elif case["compare"] == "fp16":
        np.testing.assert_allclose(out.astype(np.float32), expect, rtol=2e-3, atol=2e-3)
    else:
        np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_x86_build_reproduces_stored_outputs(name):
    """The fixtures describe the current kernel: x86 LiteRT with this build."""
    pytest.importorskip("ai_edge_litert")
    case = CASES[name]
    result = run_case(FIXTURES, case, ARRAYS, "litert")
    if case["error"] is not None:
        assert case["error"] in result.get("error", ""), (result, REGENERATE)
        return
    assert "error" not in result, result
    for got, expected in zip(result["outputs"], x86_outputs(name)):
        assert_same_as_x86(name, got, expected)


# ---- the aarch64 library ------------------------------------------------------------

def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} missing: `make test-aarch64` installs binutils-aarch64-linux-gnu and file")
    return path


@needs_aarch64
def test_library_is_an_aarch64_elf_linking_only_libc_and_libstdcxx():
    with open(A64_LIB, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and header[4] == 2 and header[5] == 1  # 64-bit, little-endian
    assert int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    described = subprocess.run([_tool("file"), "-L", A64_LIB], capture_output=True, text=True,
                               check=True).stdout
    assert "ARM aarch64" in described, described
    dynamic = subprocess.run([_tool("aarch64-linux-gnu-readelf"), "-W", "-d", "--dyn-syms", A64_LIB],
                             capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)
    assert needed and set(needed) <= {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6",
                                      "ld-linux-aarch64.so.1"}, needed
    for symbol in ("tflite_plugin_create_delegate", "tflite_plugin_destroy_delegate",
                   "PkmEmbeddingBagRegistration"):
        assert re.search(rf"FUNC\s+GLOBAL\s+DEFAULT\s+\d+\s+{symbol}\b", dynamic), symbol


@needs_aarch64
def test_library_needs_at_most_glibc_2_34_and_gcc12_libstdcxx():
    """The device floor docs/AARCH64.md states (Debian 12, Ubuntu 22.04)."""
    symbols = subprocess.run([_tool("aarch64-linux-gnu-objdump"), "-T", A64_LIB],
                             capture_output=True, text=True, check=True).stdout

    def newest(prefix):
        found = re.findall(rf"\b{prefix}_([0-9.]+)\b", symbols)
        return max(tuple(int(x) for x in v.split(".")) for v in found)

    assert newest("GLIBC") <= (2, 34), newest("GLIBC")
    assert newest("GLIBCXX") <= (3, 4, 30), newest("GLIBCXX")


def _disassembly(function):
    out = subprocess.run([_tool("aarch64-linux-gnu-objdump"), "-d", "-C", "--no-show-raw-insn",
                          A64_LIB], capture_output=True, text=True, check=True).stdout
    bodies = re.split(r"\n(?=[0-9a-f]+ <)", out)
    return out, "\n".join(b for b in bodies if b.split("\n", 1)[0].find(f"<{function}") >= 0)


@needs_aarch64
def test_row_loops_are_neon_vectorised_and_need_no_extension():
    everything, group = _disassembly("pkm::vec::AxpyGroup(")
    # The 8-row kernels (inlined into the AxpyGroup dispatch): 4-lane fused
    # multiply-adds and fp16 -> fp32 widening (FCVTL); int8 rows have their own
    # 8-row kernel (forward_int8.cc), which widens int8 -> int16 (SXTL).
    assert len(re.findall(r"\bfmla\s+v\d+\.4s", group)) >= 24, group[:2000]
    assert re.search(r"\bfcvtl2?\s+v\d+\.4s, v\d+\.[48]h", group)
    _, int8_loops = _disassembly("pkm::internal::(anonymous namespace)::AccumulateGroupNeon(")
    assert re.search(r"\b[su]xtl2?\s+v\d+\.8h, v\d+\.(8|16)b", int8_loops), int8_loops[:2000]
    _, one_row = _disassembly("pkm::vec::AxpyF32(")
    assert re.search(r"\bfmla\s+v\d+\.4s", one_row), one_row
    # Baseline ARMv8-A only: no SVE (z/p registers) nor dot-product instructions.
    assert not re.search(r"\b[zp]\d+\.[bhsd]\b", everything)
    assert not re.search(r"\t[su]dot\s", everything)


@pytest.fixture(scope="module", params=INTERPRETERS)
def device_run(request, tmp_path_factory):
    """Every fixture case in one aarch64 python process per interpreter."""
    interpreter = request.param
    root = os.path.join(A64_CACHE, "root")
    site = os.path.join(A64_CACHE, f"site-{interpreter}")
    out = tmp_path_factory.mktemp(f"aarch64-{interpreter}") / "results.npz"
    env = dict(os.environ, QEMU_CPU=A64_CPU, PYTHONPATH=f"{os.path.abspath(site)}:{ROOT}",
               PKM_TFLITE_DELEGATE=os.path.abspath(A64_LIB), PYTHONDONTWRITEBYTECODE="1")
    cmd = [os.environ.get("PKM_AARCH64_QEMU", "qemu-aarch64-static"), "-L", root,
           os.path.join(root, "usr", "bin", "python3.11"), os.path.join(HERE, "run_on_device.py"),
           FIXTURES, interpreter, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"rc {proc.returncode}; last case started: " + proc.stderr[-3000:]
    results = np.load(out)
    meta = json.loads(str(results["meta"]))
    return interpreter, meta, {k: results[k] for k in results.files if k != "meta"}


@needs_aarch64
def test_runs_in_an_aarch64_interpreter_with_the_aarch64_library(device_run):
    interpreter, meta, _ = device_run
    assert meta["machine"] == "aarch64"
    site = os.path.abspath(os.path.join(A64_CACHE, f"site-{interpreter}"))
    assert meta["interpreter_file"].startswith(site), meta["interpreter_file"]
    assert meta["delegate"] == os.path.abspath(A64_LIB)
    assert os.path.abspath(A64_LIB) in meta["mapped"], meta["mapped"]
    assert not [m for m in meta["mapped"] if m.startswith(os.path.join(ROOT, "pkm_serve", "lib"))]
    ran = [n for n, c in CASES.items() if interpreter in c["interpreters"]]
    assert sorted(meta["cases"]) == sorted(ran)


@needs_aarch64
@pytest.mark.parametrize("name", OUTPUT_CASES)
def test_aarch64_outputs_equal_x86(device_run, name):
    interpreter, meta, outputs = device_run
    info = meta["cases"][name]
    assert info["error"] is None, info["error"]
    expected = x86_outputs(name)
    got = [outputs[f"{name}/output_{i}"] for i in range(len(expected))]
    for g, e in zip(got, expected):
        assert_same_as_x86(name, g, e)
    # The custom op and the fused chain run as our delegate's node alone; the
    # stock model without our delegate keeps its GATHER.
    if CASES[name]["use_delegate"]:
        assert info["ops_in_plan"] == ["DELEGATE"], info["ops_in_plan"]
    else:
        assert "GATHER" in info["ops_in_plan"] and "DELEGATE" not in info["ops_in_plan"]


@needs_aarch64
@pytest.mark.parametrize("name", ERROR_CASES)
def test_aarch64_errors_name_the_problem_like_x86(device_run, name):
    interpreter, meta, _ = device_run
    case = CASES[name]
    if interpreter not in case["interpreters"]:
        pytest.skip(f"{interpreter} is not run on this model: see make_fixtures.py")
    error = meta["cases"][name]["error"]
    assert error is not None and case["error"] in error, error
    # Our library's messages are the same text on both machines (run_tflite gives them one a
    # line; the fixtures' x86 text has them as the runtime glued them: split alike). Each is
    # within one message there (a file's refusal is prefixed with its path, which differs).
    from pkm_serve.tflite import runtime_messages
    ours = [m for m in runtime_messages(case["x86_error"]) if not m.startswith("Node number")]
    theirs = runtime_messages(error)
    assert ours and all(any(m in t for t in theirs) for m in ours), (ours, error)


# ---- the aarch64 device wheel (dist/pkm_serve_device-*aarch64.whl) -------------------

@pytest.fixture(scope="module")
def wheel_run(tmp_path_factory):
    """The fixtures through the installed aarch64 device wheel: pip (here) installs it for
    the aarch64 platform into a directory that is then the only pkm_serve the emulated
    tflite_runtime process sees (no checkout on its path, no $PKM_TFLITE_DELEGATE)."""
    from tests.built_wheels import built_wheel
    wheel = built_wheel("pkm_serve_device-*aarch64.whl", "aarch64 device", "wheel-device-aarch64")
    target = tmp_path_factory.mktemp("aarch64-wheel") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "--no-index", "--only-binary=:all:", "--platform",
                    "manylinux_2_35_aarch64", "--python-version", "3.11", "--implementation", "cp",
                    "--target", str(target), wheel], check=True)
    root = os.path.join(A64_CACHE, "root")
    site = os.path.abspath(os.path.join(A64_CACHE, "site-tflite_runtime"))
    out = tmp_path_factory.mktemp("aarch64-wheel-run") / "results.npz"
    env = {k: v for k, v in os.environ.items() if k not in ("PKM_TFLITE_DELEGATE", "PYTHONPATH")}
    env.update(QEMU_CPU=A64_CPU, PYTHONPATH=f"{site}:{target}", PYTHONDONTWRITEBYTECODE="1")
    cmd = [os.environ.get("PKM_AARCH64_QEMU", "qemu-aarch64-static"), "-L", root,
           os.path.join(root, "usr", "bin", "python3.11"), os.path.join(HERE, "run_on_device.py"),
           FIXTURES, "tflite_runtime", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"rc {proc.returncode}; last case started: " + proc.stderr[-3000:]
    results = np.load(out)
    meta = json.loads(str(results["meta"]))
    return str(target), meta, {k: results[k] for k in results.files if k != "meta"}


@needs_aarch64
def test_aarch64_device_wheel_runs_the_fixtures_like_x86(wheel_run):
    target, meta, outputs = wheel_run
    assert meta["machine"] == "aarch64"
    # The delegate the wheel installed, not the build tree's or the checkout's.
    assert meta["delegate"] == os.path.join(target, "pkm_serve", "lib", "libpkm_tflite.so")
    assert meta["delegate"] in meta["mapped"], meta["mapped"]
    ran = [n for n in OUTPUT_CASES if "tflite_runtime" in CASES[n]["interpreters"]]
    assert ran
    for name in ran:
        assert meta["cases"][name]["error"] is None, (name, meta["cases"][name]["error"])
        expected = x86_outputs(name)
        for i, e in enumerate(expected):
            assert_same_as_x86(name, outputs[f"{name}/output_{i}"], e)
