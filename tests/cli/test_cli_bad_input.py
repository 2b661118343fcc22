"""`pkm-serve serve` flag values that the server would misuse are usage errors (exit 2,
one line naming the flag), answered before TensorFlow is imported."""
import json
import subprocess
import sys
import textwrap

import pytest

from pkm_serve.serving import config

BASE = ["--model_base_path=/m"]


@pytest.mark.parametrize("argv, needle", [
    # gRPC bound a port past 65535 modulo 65536: --port 70000 listened on 4464, -5 on 65531.
    (["--port=70000"], "--port must be 0-65535"),
    (["--port=-5"], "--port must be 0-65535"),
    (["--rest_api_port=65536"], "--rest_api_port must be 0-65535"),
    # Loaded every model, then failed to bind the second front end.
    (["--port=8600", "--rest_api_port=8600"], "--port and --rest_api_port are both 8600"),
    # gRPC's "value too large to convert to int" at start-up.
    (["--max_request_bytes=5000000000"], "--max_request_bytes must be 1 to 2147483647"),
    # A ThreadPoolExecutor's "max_workers must be greater than 0" at start-up.
    (["--grpc_max_threads=0"], "--grpc_max_threads must be >= 1"),
    (["--rest_api_port=8501", "--rest_api_num_threads=0"], "--rest_api_num_threads must be >= 1"),
    # Every REST request answered DEADLINE_EXCEEDED.
    (["--rest_api_port=8501", "--rest_api_timeout_in_ms=-5"], "--rest_api_timeout_in_ms must be >= 0"),
    # NaN >= 0 is false: the models were never polled, the server "ready" with none.
    (["--file_system_poll_wait_seconds=nan"], "--file_system_poll_wait_seconds must be a finite"),
    (["--drain_seconds=nan"], "--drain_seconds must be a finite"),
    (["--drain_seconds=-1"], "--drain_seconds must be >= 0"),
    # TF Serving's uint32 option: -1 wrapped to 4294967295 tries.
    (["--max_num_load_retries=-1"], "--max_num_load_retries must be >= 0"),
    # Silently INFO ("bogus"), or a ValueError from logging ("basic_format").
    (["--log_level=bogus"], "--log_level 'bogus' is not a logging level"),
    (["--log_level=basic_format"], "is not a logging level"),
    # A prefix stood for the flag (tensorflow_model_server takes no abbreviations).
    (["--enable_batch"], "unrecognized arguments: --enable_batch"),
    (["--rest_api_po=8501"], "unrecognized arguments: --rest_api_po=8501"),
])
def test_misused_flag_values_are_usage_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        config.parse_args(BASE + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--use_tflite_model=true"], "use --prefer_tflite_model"),
    (["--platform_config_file", "/p.pbtxt"], "`pkm-serve serve --help` lists the flags served"),
    # upstream flags that were "unrecognized arguments", as a typo
    (["--tensorflow_session_config_file=/s.pbtxt"], "`pkm-serve serve --help` lists the flags served"),
    (["--mixed_precision=bfloat16"], "`pkm-serve serve --help` lists the flags served"),
])
def test_tensorflow_model_server_flags_not_implemented_are_named_as_such(capsys, argv, needle):
    """Was "unrecognized arguments: ...", as for a typo: a tensorflow_model_server command
    line now hears which of its flags pkm-serve serve lacks, and what to do instead."""
    with pytest.raises(SystemExit) as e:
        config.parse_args(BASE + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    flag = argv[0].split("=")[0]
    assert f"error: {flag} is a tensorflow_model_server flag that pkm-serve serve does not implement" in err, err
    assert needle in err, err


def test_good_values_still_parse():
    a = config.parse_args(BASE + ["--port=0", "--rest_api_port=65535", "--drain_seconds=0",
                                  "--log_level=warning", "--file_system_poll_wait_seconds=-1"])
    assert (a.port, a.rest_api_port, a.drain_seconds, a.log_level) == (0, 65535, 0.0, "warning")


def test_value_errors_are_answered_before_tensorflow_is_imported():
    script = textwrap.dedent("""
        import json, sys
        from pkm_serve import cli
        try:
            code = cli.main(["serve", "--model_base_path=/m", "--port=70000"])
        except SystemExit as e:
            code = e.code
        print(json.dumps({"code": code, "tf": "tensorflow" in sys.modules}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 2, "tf": False}, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "pkm-serve serve: error: --port must be 0-65535 (0 = disabled), got 70000"


def test_tflite_given_a_directory_says_so(tmp_path, capsys):
    # Was "DIR: no such file" for a path that exists (a SavedModel or version directory).
    from pkm_serve import tflite_cli
    assert tflite_cli.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == \
        f"pkm-serve tflite: error: {tmp_path}: is a directory, not a .tflite file"


@pytest.mark.parametrize("argv, needle", [
    (["--batch=0"], "argument --batch: must be >= 1, got 0"),
    (["--repeats=-1"], "argument --repeats: must be >= 1, got -1"),
    (["--memory-batch=0"], "argument --memory-batch: must be >= 1, got 0"),
    (["--batch=x"], "argument --batch: invalid int value: 'x'"),
])
def test_demo_counts_below_one_are_usage_errors(capsys, argv, needle):
    # --batch 0 failed after the whole export with "HTTP Error 400: Bad Request",
    # --repeats -1 with "no median for empty data".
    from pkm_serve import demo
    with pytest.raises(SystemExit) as e:
        demo.build_parser().parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_demo_workdir_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    # Was "[Errno 17] File exists" after importing TensorFlow.
    from pkm_serve import demo
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        demo.build_parser().parse_args([f"--workdir={tmp_path / 'f'}"])
    assert e.value.code == 2 and "exists and is not a directory" in capsys.readouterr().err


def test_demo_workdir_of_an_earlier_demo_is_a_usage_error(tmp_path, capsys):
    # The export refused models/pkm/1 after the model was built: "pick another --version".
    from pkm_serve import demo
    (tmp_path / "models" / "pkm" / "1").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        demo.build_parser().parse_args([f"--workdir={tmp_path}"])
    assert e.value.code == 2 and "holds an earlier demo's models/pkm/1" in capsys.readouterr().err
