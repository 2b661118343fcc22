"""A version that fails its initial load fails the server's start, as in TF Serving:
ServerCore waits for every configured model's initial load and tensorflow_model_server
exits with "Failed to start server. Error: Unknown: 1 servable(s) did not become
available: {{{name: M version: V} due to error: ...}, }" (server_core_test.cc,
load_servables_fast.cc). A version failing at a later poll only ends that version."""
import grpc
import pytest
from tensorflow_serving.apis import get_model_status_pb2, model_pb2
from tensorflow_serving.config import model_server_config_pb2

import half_plus_two as hpt
from serving_helpers import ServerProcess, version_states
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.manager import ModelManager
from test_serving_manager_fakes import Fakes

State = get_model_status_pb2.ModelVersionStatus.State


def _config(models, policy_all=False):
    cfg = model_server_config_pb2.ModelServerConfig()
    for name, base in models.items():
        c = cfg.model_config_list.config.add(name=name, base_path=str(base), model_platform="tensorflow")
        if policy_all:
            c.model_version_policy.all.SetInParent()
    return cfg


def _fakes(tmp_path, name, versions, failing):
    fakes = Fakes(tmp_path / name)
    for v in versions:
        fakes.add_version(v)
    for v in failing:
        fakes.failures[v] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"bad graph {v}")
    return fakes


def _start(cfg, factory):
    manager = ModelManager(cfg, poll_seconds=0, loader_factory=factory)   # 0: one poll, at start
    manager.start()
    return manager


def test_only_version_failing_fails_the_start(tmp_path):
    fakes = _fakes(tmp_path, "m", [3], failing=[3])
    with pytest.raises(ServingError) as err:
        _start(_config({"m": fakes.base}), fakes.factory)
    assert err.value.code == grpc.StatusCode.UNKNOWN
    assert err.value.message == ("1 servable(s) did not become available: "
                                 "{{{name: m version: 3} due to error: INVALID_ARGUMENT: bad graph 3}, }")


@pytest.mark.parametrize("policy_all", [False, True])
def test_newest_version_failing_fails_the_start_although_an_older_one_loads(tmp_path, policy_all):
    """TF Serving waits for Latest(m): the newest version failing is a failed start, whether
    the policy aspires it alone (latest) or with the others (all); no silent fallback."""
    fakes = _fakes(tmp_path, "m", [1, 2], failing=[2])
    with pytest.raises(ServingError, match=r"^UNKNOWN: 1 servable\(s\) .*\{\{\{name: m version: 2\} due to error: INVALID_ARGUMENT: bad graph 2\}, \}$"):
        _start(_config({"m": fakes.base}, policy_all=policy_all), fakes.factory)
    if policy_all:   # version 1 loaded too, and is freed before the error
        assert fakes.events[-1] == ("unload", 1)


def test_one_failing_model_of_several_fails_the_start_and_frees_the_others(tmp_path):
    good = _fakes(tmp_path, "m", [1], failing=[])
    bad = _fakes(tmp_path, "n", [4], failing=[4])

    def factory(name, version, path):
        return (good if name == "m" else bad).factory("m", version, path)
    with pytest.raises(ServingError) as err:
        _start(_config({"m": good.base, "n": bad.base}), factory)
    assert err.value.message == ("1 servable(s) did not become available: "
                                 "{{{name: n version: 4} due to error: INVALID_ARGUMENT: bad graph 4}, }")
    assert good.events == [("load-start", 1), ("loaded", 1), ("unload", 1)]


def test_a_version_failing_after_the_start_keeps_the_older_one_serving(tmp_path):
    fakes = _fakes(tmp_path, "m", [1], failing=[2])
    manager = _start(_config({"m": fakes.base}), fakes.factory)
    fakes.add_version(2)
    manager.poll_once()                            # raises nothing: only version 2 ends
    assert version_states(manager) == {2: State.END, 1: State.AVAILABLE}
    with manager.serving(model_pb2.ModelSpec(name="m")) as servable:
        assert servable.version == 1


def _serve_in_process(flags, monkeypatch, capsys):
    """(exit status, stdout + stderr) of the main() that `pkm-serve serve` runs and exits with,
    run in-process: signal handlers and the logging set-up stay the test process's."""
    import logging

    from pkm_serve import cli
    from pkm_serve.serving import server
    monkeypatch.setattr(server._Wakeups, "install", lambda self, signals: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    monkeypatch.setattr(cli, "_verbose", False)
    from serving_helpers import free_port
    rc = server.main([*flags, f"--port={free_port()}", f"--rest_api_port={free_port()}"])
    out, err = capsys.readouterr()
    return rc, out + err


@pytest.mark.parametrize("use_config_file", [False, True])
def test_server_with_a_model_that_fails_to_load_exits_without_opening_ports(tmp_path, use_config_file,
                                                                           monkeypatch, capsys):
    """tensorflow_model_server never opens its ports when an initial load fails: exit status
    non-zero, one line naming the model, the version and the reason on stderr. With a config
    file the server runs as its own process; the --model_name case runs its main() in-process
    (what differs is the flags' route to the same start)."""
    bad = tmp_path / "bad"
    (bad / "7").mkdir(parents=True)
    (bad / "7" / "saved_model.pb").write_bytes(b"this is not a SavedModel")
    if use_config_file:
        good = tmp_path / "good"
        hpt.write_versioned(str(good), 1, hpt.write_tf1)
        config = tmp_path / "models.config"
        config.write_text(f'model_config_list {{ config {{ name: "good" base_path: "{good}" '
                          f'model_platform: "tensorflow" }} config {{ name: "bad" base_path: "{bad}" '
                          f'model_platform: "tensorflow" }} }}\n')
        flags = [f"--model_config_file={config}"]
    else:
        flags = ["--model_name=bad", f"--model_base_path={bad}"]
    flags += ["--load_pkm_ops=false", "--max_num_load_retries=0"]
    if use_config_file:
        server = ServerProcess(tmp_path, *flags, wait_ready=False)
        try:
            rc = server.proc.wait(120)
        finally:
            server.terminate()
        log = server.log()
    else:
        rc, log = _serve_in_process(flags, monkeypatch, capsys)
    assert rc == 2, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("pkm-serve serve: error:")]
    assert len(errors) == 1, log[-3000:]
    assert errors[0].startswith("pkm-serve serve: error: UNKNOWN: 1 servable(s) did not become available: "
                                "{{{name: bad version: 7} due to error: INVALID_ARGUMENT: cannot read SavedModel at ")
    assert "listening" not in log and "pkm-serve: ready" not in log
    assert "name: good" not in errors[0]



def test_reload_adding_a_model_that_fails_to_load_says_so(tmp_path):
    """ServerCore::ReloadConfig waits for the models the config adds: one that does not
    load is an UNKNOWN "Some models did not become available" for the caller (the gRPC
    HandleReloadConfigRequest's status); the config stays applied, labels unchanged."""
    good = _fakes(tmp_path, "m", [1, 2], failing=[])
    bad = _fakes(tmp_path, "n", [4], failing=[4])

    def factory(name, version, path):
        return (good if name == "m" else bad).factory("m", version, path)
    manager = _start(_config({"m": good.base}, policy_all=True), factory)
    new = _config({"m": good.base, "n": bad.base}, policy_all=True)
    new.model_config_list.config[0].version_labels["stable"] = 1
    with pytest.raises(ServingError) as err:
        manager.apply_config(new)
    assert err.value.code == grpc.StatusCode.UNKNOWN
    assert err.value.message == ("Some models did not become available: "
                                 "{{{name: n version: 4} due to error: INVALID_ARGUMENT: bad graph 4}, }")
    assert version_states(manager, "n") == {4: State.END}          # applied: n is configured
    with pytest.raises(ServingError, match="Unrecognized servable version label: stable"):
        with manager.serving(model_pb2.ModelSpec(name="m", version_label="stable")):
            pass
    bad.failures[2] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, "bad graph 2")
    bad.add_version(2)
    manager.apply_config(new)       # n is no longer new: its failing version 2 is only reported
    assert version_states(manager, "n") == {4: State.END, 2: State.END}


def _accepts(port):
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_grpc_port_accepts_no_connection_until_the_models_are_loaded(tmp_path):
    """As tensorflow_model_server, which builds its gRPC server after ServerCore::Create: a
    TCP probe must not see the port open while models load (gRPC listened from the moment
    the front end was built), nor after a failed start; a taken port still fails first."""
    import socket
    from serving_helpers import free_port
    from pkm_serve.serving import config
    from pkm_serve.serving.server import Server, StartupError
    (tmp_path / "bad" / "1").mkdir(parents=True)
    (tmp_path / "bad" / "1" / "saved_model.pb").write_bytes(b"this is not a SavedModel")
    port = free_port()
    argv = [f"--model_base_path={tmp_path / 'bad'}", f"--port={port}", "--load_pkm_ops=false",
            "--file_system_poll_wait_seconds=0", "--max_num_load_retries=0"]
    server = Server(config.parse_args(argv))
    assert not _accepts(port)
    with pytest.raises(ServingError, match=r"1 servable\(s\) did not become available"):
        server.start()
    assert not _accepts(port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(StartupError, match=f"cannot bind gRPC to 127.0.0.1:{port}"):
            Server(config.parse_args(argv))
    with pytest.raises(StartupError, match="UNIX socket /nonexistent/dir/s.sock: its directory does not exist"):
        Server(config.parse_args(argv + ["--grpc_socket_path=/nonexistent/dir/s.sock"]))


def test_config_file_adding_a_failing_model_is_logged_as_applied(tmp_path, caplog):
    """The polled config file is applied even when a model it adds fails to load (as
    ServerCore::ReloadConfig): the log said "ignoring model config"."""
    import logging
    good = _fakes(tmp_path, "m", [1], failing=[])
    bad = _fakes(tmp_path, "n", [4], failing=[4])

    def factory(name, version, path):
        return (good if name == "m" else bad).factory("m", version, path)
    config_file = tmp_path / "models.config"
    config_file.write_text(str(_config({"m": good.base})))
    manager = ModelManager(_config({"m": good.base}), poll_seconds=0, loader_factory=factory,
                           config_file=str(config_file), config_poll_seconds=3600)
    manager.start()
    try:
        config_file.write_text(str(_config({"m": good.base, "n": bad.base})))
        with caplog.at_level(logging.ERROR, logger="pkm_serve.serving"):
            manager._maybe_reload_config_file()
        assert f"applied model config {config_file}, but UNKNOWN: Some models did not become available: " \
               "{{{name: n version: 4} due to error: INVALID_ARGUMENT: bad graph 4}, }" in caplog.text
        config_file.write_text("not a config")
        with caplog.at_level(logging.ERROR, logger="pkm_serve.serving"):
            manager._maybe_reload_config_file()
        assert f"ignoring model config {config_file}:" in caplog.text
    finally:
        manager.stop()


def test_a_taken_rest_port_fails_the_start_before_any_load(tmp_path):
    """The REST port, as the gRPC one: taken, the start fails before the models load (it
    failed only after every initial load, minutes for a large model)."""
    import socket
    from serving_helpers import free_port
    from pkm_serve.serving import config
    from pkm_serve.serving.server import Server, StartupError
    hpt.write_versioned(str(tmp_path / "m"), 1, hpt.write_tf1)
    port = free_port()
    argv = [f"--model_base_path={tmp_path / 'm'}", "--port=0", f"--rest_api_port={port}", "--load_pkm_ops=false"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert _accepts(port)   # the reference: the port is in use
        with pytest.raises(StartupError, match=f"cannot bind REST to 127.0.0.1:{port}"):
            Server(config.parse_args(argv))


def test_a_port_shared_through_so_reuseport_stays_bindable():
    """--grpc_channel_arguments=grpc.so_reuseport=1 lets several servers listen on one port
    (gRPC binds it beside another SO_REUSEPORT listener); the early probe refused it."""
    import socket
    from unittest import mock
    from pkm_serve.serving.grpc_frontend import GrpcFrontend
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        kwargs = dict(address="127.0.0.1", port=port, max_threads=2, max_message_bytes=1 << 20)
        with pytest.raises(OSError, match=f"cannot bind gRPC to 127.0.0.1:{port}"):   # not shared: refused
            GrpcFrontend(mock.MagicMock(), mock.MagicMock(), **kwargs)
        shared = GrpcFrontend(mock.MagicMock(), mock.MagicMock(), channel_arguments=(("grpc.so_reuseport", 1),),
                              **kwargs)
        try:
            shared.start()
            assert shared.port == port
        finally:
            shared.server.stop(None)
