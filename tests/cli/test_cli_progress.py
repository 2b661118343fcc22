"""A `pkm-serve` command that dies in native code still tells the user what it was doing:
each step that hands control to TensorFlow is announced on stderr first ("importing
TensorFlow", "loading the op library from ..."), TensorFlow's held-back start-up output is
left in a named log file, and the Python stack is printed (faulthandler). The crashes are
real SIGABRTs: an op library whose constructor aborts, and a stand-in `tensorflow` package
whose import aborts (what the wheel with a second copy of TF's runtime did)."""
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKM_SERVE = os.path.join(os.path.dirname(sys.executable), "pkm-serve")

ABORTING_LIBRARY = r"""
#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void AbortOnLoad() {
  std::fprintf(stderr, "op library constructor: aborting\n");
  std::abort();
}
"""


def run(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP")}
    env.update(env_extra or {})
    return subprocess.run([PKM_SERVE, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture(scope="module")
def aborting_library(tmp_path_factory):
    d = tmp_path_factory.mktemp("aborting_library")
    (d / "abort.cc").write_text(ABORTING_LIBRARY)
    subprocess.run(["g++", "-shared", "-fPIC", str(d / "abort.cc"), "-o", str(d / "abort.so")],
                   check=True)
    return str(d / "abort.so")


@pytest.mark.parametrize("command", ["export", "serve"])
def test_an_abort_while_loading_the_op_library_names_the_step(aborting_library, tmp_path,
                                                               command):
    args = {"export": ["export", str(tmp_path), str(tmp_path / "out")],
            "serve": ["serve", "--port=0", "--rest_api_port=1", "--model_name=m",
                      f"--model_base_path={tmp_path}"]}[command]
    proc = run(*args, env_extra={"PKM_SERVE_OPS_LIB": aborting_library})
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith(f"pkm-serve {command}: ")]
    assert [lines[i].split(" (")[0] for i in steps] == [
        f"pkm-serve {command}: importing TensorFlow",
        f"pkm-serve {command}: loading the op library from {aborting_library}"], proc.stderr
    after = "\n".join(lines[steps[-1] + 1:])
    assert "op library constructor: aborting" in after, proc.stderr
    assert "Fatal Python error: Aborted" in after and "load_library" in after, proc.stderr


def _stand_in_tensorflow(folder, source):
    """A package `tensorflow` in `folder` whose import runs `source`."""
    package = folder / "tensorflow"
    package.mkdir()
    (package / "__init__.py").write_text(source)


def test_an_abort_inside_the_tensorflow_import_leaves_its_output_in_the_named_log(tmp_path):
    _stand_in_tensorflow(tmp_path, "import os, sys\nsys.stderr.write('stand-in TensorFlow: aborting\\n')\n"
                                   "sys.stderr.flush()\nos.abort()\n")
    proc = run("export", str(tmp_path), str(tmp_path / "out"),
               env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr[-3000:])
    first = proc.stderr.splitlines()[0]
    match = re.fullmatch(r"pkm-serve export: importing TensorFlow \(its start-up messages go "
                         r"to (\S+\.log), removed once the import succeeds\)", first)
    assert match, proc.stderr
    log = match.group(1)
    try:
        with open(log) as f:
            assert "stand-in TensorFlow: aborting" in f.read()
    finally:
        os.unlink(log)
    assert "stand-in TensorFlow" not in proc.stderr  # held back, as TF's start-up lines are
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr
    assert "loading the op library" not in proc.stderr


# A successful import removes its log: test_cli.py::test_a_successful_import_removes_its_log
# (it reads the process of test_cli.py's export of a missing model).


def test_ctrl_c_during_the_tensorflow_import_says_interrupted_without_its_start_up_lines(tmp_path):
    # The held-back lines were replayed on any exception, Ctrl-C included: a screen of TF
    # start-up notices above "interrupted".
    _stand_in_tensorflow(tmp_path, "import sys\nsys.stderr.write('stand-in TensorFlow: start-up notice\\n')\n"
                                   "raise KeyboardInterrupt\n")
    path = os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    proc = run("export", str(tmp_path), str(tmp_path / "out"), env_extra={"PYTHONPATH": path})
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("pkm-serve export: importing TensorFlow") and \
        lines[1:] == ["pkm-serve export: interrupted"], proc.stderr
