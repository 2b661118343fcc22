"""`pkm-serve`: help texts, TF-free `--help`, one-line errors (traceback only
with --verbose). The console script is run as a user runs it."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKM_SERVE = os.path.join(os.path.dirname(sys.executable), "pkm-serve")


def run(*args, cwd=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP")}
    return subprocess.run([PKM_SERVE, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def stderr_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.strip()]


def test_top_level_help_lists_commands_and_verbose():
    proc = run("--help")
    assert proc.returncode == 0
    for name in ("demo", "export", "serve", "tflite", "--verbose"):
        assert name in proc.stdout
    assert run().returncode == 2
    unknown = run("exprot")
    assert unknown.returncode == 2 and "unknown command 'exprot'" in unknown.stderr


def test_version_prints_the_package_version_without_tensorflow():
    # `pkm-serve --version` was "unknown command" (tensorflow_model_server has --version).
    from pkm_serve import __version__

    proc = run("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"pkm-serve {__version__}"), proc.stderr
    assert "--version" in run("--help").stdout
    code, imported_tf, _ = main_in_a_fresh_process(["--version"])
    assert imported_tf is False


def test_tflite_help_is_its_own_with_option_help():
    proc = run("tflite", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: pkm-serve tflite ")
    for option, words in (("--interpreter", "runtime"), ("--num-threads", "threads"),
                          ("--fuse-composites", "GATHER")):
        line = next(line for line in proc.stdout.splitlines() if line.strip().startswith(option))
        rest = proc.stdout[proc.stdout.index(line):]
        assert words in rest.split("\n  -")[0], (option, rest[:200])
    assert "python -m" not in proc.stdout


def main_in_a_fresh_process(argv):
    """cli.main(argv) in a new interpreter: (its exit code, whether it imported TF, the process)."""
    script = textwrap.dedent(f"""
        import json, sys
        from pkm_serve import cli
        try:
            cli.main({argv!r})
            code = None
        except SystemExit as e:
            code = e.code
        print(json.dumps({{"code": code, "tf": "tensorflow" in sys.modules}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["code"], result["tf"], proc


@pytest.mark.parametrize("command", ["demo", "export", "serve", "tflite"])
def test_help_of_every_command_does_not_import_tensorflow(command):
    code, imported_tf, proc = main_in_a_fresh_process([command, "--help"])
    assert (code, imported_tf) == (0, False)
    assert f"usage: pkm-serve {command}" in proc.stdout


@pytest.mark.parametrize("command", ["demo", "export", "serve"])
def test_usage_errors_do_not_import_tensorflow(command):
    # serve and demo parsed their flags only after importing TF (3 s for a typo).
    positional = ["src", "dst"] if command == "export" else []
    code, imported_tf, proc = main_in_a_fresh_process([command, *positional, "--no-such-flag"])
    assert (code, imported_tf) == (2, False)
    assert "unrecognized arguments: --no-such-flag" in proc.stderr


def test_verbose_shows_the_traceback_of_export_and_serve_errors(tmp_path, monkeypatch):
    # Both print their own one-line errors; --verbose showed no more than that. Export's
    # traceback is its error leaving cli.main (the interpreter prints it, exit status 1: the
    # console script's process is in test_export_error_is_one_line_without_tensorflow_start_up_lines),
    # checked in-process; serve prints its own, from its own process (it installs signal handlers).
    import tensorflow  # noqa: F401 - imported as the console script's process imports it

    from pkm_serve import cli
    from pkm_serve.export.errors import ExportError
    monkeypatch.setattr(cli, "_verbose", False)     # restored after: main sets it for this process
    with pytest.raises(ExportError, match="no_such_model"):
        cli.main(["--verbose", "export", str(tmp_path / "no_such_model"), str(tmp_path / "out")])
    bad = tmp_path / "bad.config"
    bad.write_text('model_config_list { config { name: "x" ')
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = run("serve", "--port=0", f"--rest_api_port={port}", f"--model_config_file={bad}", "--verbose",
                timeout=60)
    assert serve.returncode == 2 and "Traceback (most recent call last)" in serve.stderr
    assert stderr_lines(serve)[-1].startswith("pkm-serve serve: error: Error parsing text-format")


def test_export_help_prints_no_tensorflow_log_lines():
    proc = run("export", "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: pkm-serve export ")
    assert proc.stderr == ""


def test_tflite_missing_model_is_one_line(tmp_path):
    proc = run("tflite", "missing.tflite", cwd=str(tmp_path))
    assert proc.returncode == 1
    assert stderr_lines(proc) == ["pkm-serve tflite: error: missing.tflite: no such file"]
    assert proc.stdout == ""


def test_tflite_invalid_model_is_one_line_and_verbose_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(b"this is not a flatbuffer" * 4)
    proc = run("tflite", str(bad))
    lines = stderr_lines(proc)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("pkm-serve tflite: error: ") and "--verbose" in lines[0]
    for args in (("--verbose", "tflite", str(bad)), ("tflite", str(bad), "--verbose")):
        verbose = run(*args)
        assert verbose.returncode != 0 and "Traceback (most recent call last)" in verbose.stderr


def test_tflite_usage_error_names_the_option(tmp_path):
    model = tmp_path / "m.tflite"
    model.write_bytes(b"x")
    proc = run("tflite", str(model), "--num-threads", "0")
    assert proc.returncode == 2
    assert stderr_lines(proc)[-1] == "pkm-serve tflite: error: --num-threads must be in [1, 256], got 0"
    proc = run("tflite", str(model), "--num-threads", "1000")  # the delegate's limit (its reason was lost)
    assert proc.returncode == 2
    assert stderr_lines(proc)[-1] == "pkm-serve tflite: error: --num-threads must be in [1, 256], got 1000"


@pytest.fixture(scope="module")
def export_of_a_missing_model(tmp_path_factory):
    """`pkm-serve export` of a model that does not exist: the console script's process."""
    tmp = tmp_path_factory.mktemp("missing_model")
    return run("export", str(tmp / "no_such_model"), str(tmp / "out"))


def test_export_error_is_one_line_without_tensorflow_start_up_lines(export_of_a_missing_model):
    proc = export_of_a_missing_model
    assert proc.returncode == 1
    errors = [line for line in stderr_lines(proc) if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("pkm-serve export: error: "), proc.stderr
    assert "no_such_model" in errors[0] and stderr_lines(proc)[-1] == errors[0]
    for noise in ("Traceback", "I0000", "absl::InitializeLog", "cuda"):
        assert noise not in proc.stderr, proc.stderr


def test_a_successful_import_removes_its_log(export_of_a_missing_model):
    # With the crash cases in test_cli_progress.py; here it shares their process with the test above.
    proc = export_of_a_missing_model
    assert proc.returncode == 1, proc.stderr
    log = re.search(r"go to (\S+\.log)", proc.stderr).group(1)
    assert not os.path.exists(log)


def test_serve_error_is_one_line(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run("serve", "--port=0", f"--rest_api_port={port}",
               f"--model_config_file={tmp_path / 'missing.config'}", timeout=60)
    assert proc.returncode != 0
    lines = stderr_lines(proc)
    # The steps before it (see test_cli_progress.py), then the one error line.
    assert [line.split(" (")[0] for line in lines[:-1]] == [
        "pkm-serve serve: importing TensorFlow",
        f"pkm-serve serve: loading the op library from {os.path.join(ROOT, 'pkm_serve', 'lib')}",
    ], proc.stderr
    assert lines[-1].startswith("pkm-serve serve: error: ") and "missing.config" in lines[-1]


def test_one_line_of_library_errors():
    from pkm_serve import cli
    assert "pkm_serve[serving]" in cli.one_line(ModuleNotFoundError("x", name="grpc"))
    assert "TF wheel" in cli.one_line(ModuleNotFoundError("x", name="tensorflow.python"))
    assert cli.one_line(ValueError("first\n  graph traceback\n")) == "first"
    assert cli.one_line(KeyError("sig")) == "KeyError: 'sig'"
    assert cli.one_line(RuntimeError("")) == "RuntimeError"


def test_a_successful_export_prints_no_device_probing_lines(tmp_path):
    # TF probes CUDA at the first device query, after the held-back import: on a machine without
    # a GPU an "E0000 ... cuda_platform.cc ... failed call to cuInit" line came out mid-export.
    import tensorflow as tf

    class Bag(tf.Module):
        def __init__(self):
            self.table = tf.Variable(tf.random.normal([20, 4]))

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32)])
        def __call__(self, ids):
            return {"out": tf.reduce_sum(tf.gather(self.table, ids), axis=1)}

    bag = Bag()
    tf.saved_model.save(bag, str(tmp_path / "src"), signatures=bag.__call__)
    proc = run("export", str(tmp_path / "src"), str(tmp_path / "out"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1 fused" in proc.stdout, proc.stdout
    for noise in ("cuInit", "cuda_platform", "E0000", "I0000"):
        assert noise not in proc.stderr, proc.stderr
