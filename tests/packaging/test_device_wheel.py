"""The TF-free device wheel (dist/pkm_serve_device-*.whl, `make wheel-device`)
installed with pip into fresh venvs that have only a TFLite runtime and numpy
(tflite-runtime 2.14 with numpy < 2; LiteRT): TensorFlow is not importable
there, the installed package (not the checkout) runs a .tflite through its
delegate, and the outputs match a numpy float64 reference. About 10 s per
runtime, most of it pip (the venv is made --without-pip; this interpreter's pip installs
into it)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _locked(*names):
    """The pins requirements.lock gives ``names``."""
    with open(os.path.join(ROOT, "requirements.lock")) as f:
        pins = [line.strip() for line in f if line.split("==")[0].strip().lower() in names]
    assert len(pins) == len(names), pins
    return pins


# runtime -> its pip requirements; the module name run_tflite's `interpreter` takes
RUNTIMES = {
    "tflite_runtime": ["-r", os.path.join(ROOT, "requirements-tflite-runtime.txt")],
    "litert": _locked("ai-edge-litert", "numpy"),
}

from pkm_serve import tflite  # noqa: E402  (builds the model: needs a flatbuffer schema)
from tests import reference  # noqa: E402
from tests.built_wheels import built_wheel  # noqa: E402

N, D, K, B = 257, 16, 5, 9


def _device_wheel():
    return built_wheel("pkm_serve_device-*x86_64.whl", "device", "wheel-device")


def _isolated_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PKM_"))}
    return env


@pytest.fixture(scope="module", params=sorted(RUNTIMES))
def device_venv(request, tmp_path_factory):
    venv = tmp_path_factory.mktemp("device") / "venv"
    # --without-pip: ensurepip's install of pip into the venv (~5 s of CPU) is no part of the
    # check; this interpreter's pip installs into the venv (--python: under the venv's interpreter).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
           "--disable-pip-version-check"]
    subprocess.run(pip + RUNTIMES[request.param] + [_device_wheel()], check=True,
                   env=_isolated_env(), cwd=str(venv))
    return venv, request.param


DEVICE_SCRIPT = textwrap.dedent("""
    import importlib.util, json, os, subprocess, sys
    import numpy as np
    assert importlib.util.find_spec("tensorflow") is None, "tensorflow is importable"
    import pkm_serve
    from pkm_serve import tflite
    work, runtime = sys.argv[1], sys.argv[2]
    interpreter = tflite.interpreter_module(runtime)
    idx, w = np.load(os.path.join(work, "idx.npy")), np.load(os.path.join(work, "w.npy"))
    results = {"package": pkm_serve.__file__, "delegate": tflite.delegate_path(),
               "tensorflow_loaded": "tensorflow" in sys.modules}
    for name in ("sum", "mean"):
        model = os.path.join(work, name + ".tflite")
        out = tflite.run_tflite(model, [idx, w], interpreter=runtime, num_threads=2)
        np.save(os.path.join(work, name + "_helper.npy"), out[0])
        # The stock interpreter API with the delegate path, as the README shows.
        interp = interpreter.Interpreter(model_path=model, experimental_delegates=[
            interpreter.load_delegate(tflite.delegate_path(), {"num_threads": "1"})])
        ins = interp.get_input_details()
        interp.resize_tensor_input(ins[0]["index"], idx.shape)
        interp.resize_tensor_input(ins[1]["index"], w.shape)
        interp.allocate_tensors()
        interp.set_tensor(ins[0]["index"], idx)
        interp.set_tensor(ins[1]["index"], w)
        interp.invoke()
        np.save(os.path.join(work, name + "_stock.npy"),
                interp.get_tensor(interp.get_output_details()[0]["index"]))
    q, scales = tflite.quantize_rows_int8(np.load(os.path.join(work, "table.npy")))
    np.save(os.path.join(work, "q.npy"), q)
    np.save(os.path.join(work, "scales.npy"), scales)
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pkm-serve-tflite"),
                          os.path.join(work, "sum.tflite")], capture_output=True, text=True)
    results["cli_rc"], results["cli_out"] = cli.returncode, cli.stdout + cli.stderr
    with open(os.path.join(work, "corrupt.tflite"), "wb") as f:
        f.write(b"not a flatbuffer" * 8)
    bad = subprocess.run([os.path.join(os.path.dirname(sys.executable), "pkm-serve-tflite"),
                          os.path.join(work, "corrupt.tflite")], capture_output=True, text=True)
    results["bad_rc"], results["bad_err"] = bad.returncode, bad.stderr
    print(json.dumps(results))
""")


@pytest.mark.slow
def test_device_wheel_runs_tflite_without_tensorflow(device_venv, tmp_path):
    import json
    device_venv, runtime = device_venv
    rng = np.random.default_rng(3)
    table = rng.standard_normal((N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=(B, K)).astype(np.int32)  # -1 = padding
    idx[0] = -1  # an empty bag
    w = rng.uniform(0.1, 2.0, size=(B, K)).astype(np.float32)
    np.save(tmp_path / "table.npy", table)
    np.save(tmp_path / "idx.npy", idx)
    np.save(tmp_path / "w.npy", w)
    for combiner in ("sum", "mean"):
        (tmp_path / f"{combiner}.tflite").write_bytes(
            tflite.build_embedding_bag_model(table, K, combiner=combiner))
    proc = subprocess.run([str(device_venv / "bin" / "python"), "-I", "-c", DEVICE_SCRIPT,
                           str(tmp_path), runtime], capture_output=True, text=True,
                          cwd=str(tmp_path),
                          env=_isolated_env())
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # The installed package, not the checkout, and no TensorFlow anywhere.
    assert results["package"].startswith(str(device_venv)), results["package"]
    assert results["delegate"].startswith(str(device_venv)), results["delegate"]
    assert not results["tensorflow_loaded"]
    for combiner in ("sum", "mean"):
        want = reference.embedding_bag(table, idx, w, combiner)
        for how in ("helper", "stock"):
            got = np.load(tmp_path / f"{combiner}_{how}.npy")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{combiner} via {how}")
    q, scales = np.load(tmp_path / "q.npy"), np.load(tmp_path / "scales.npy")
    np.testing.assert_allclose(q * scales[:, None], table, atol=scales.max() / 2 + 1e-7)
    assert results["cli_rc"] == 0, results["cli_out"]
    assert "claimed by node" in results["cli_out"], results["cli_out"]
    # A file that is no model: one line, no traceback (it was a traceback).
    assert results["bad_rc"] == 1 and "Traceback" not in results["bad_err"], results["bad_err"]
    assert results["bad_err"].strip().splitlines()[-1].startswith("pkm-serve tflite: error: "), results["bad_err"]


def test_device_wheel_holds_only_the_device_part():
    import zipfile
    names = set(zipfile.ZipFile(_device_wheel()).namelist())
    package = {n for n in names if n.startswith("pkm_serve/") and not n.endswith("/")}
    assert package == {"pkm_serve/__init__.py", "pkm_serve/tflite.py", "pkm_serve/tflite_cli.py", "pkm_serve/tflite_model.py",
                       "pkm_serve/tflite_metadata.py", "pkm_serve/tflite_report.py",
                       "pkm_serve/lib/libpkm_tflite.so"}, package
    metadata = zipfile.ZipFile(_device_wheel()).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")
                and "extra ==" not in line]
    assert requires == ["Requires-Dist: numpy>=1.23"], requires
