"""HandleReloadConfigRequest that adds a model with no version yet: ServerCore::ReloadConfig
waits (WaitUntilModelsAvailable) until the new model's version loads or fails. Here, driven
by a real gRPC client against the gRPC front end over fake loaders: the RPC answers once a
version appears, DEADLINE_EXCEEDED at the client's deadline (config applied), and an error
at once when the file system is not polled again."""
import threading
import time

import grpc
import pytest
from tensorflow_serving.apis import get_model_status_pb2, model_management_pb2, model_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import free_port, version_states
from test_serving_manager_fakes import Fakes
from pkm_serve.serving.grpc_frontend import GrpcFrontend
from pkm_serve.serving.manager import ModelManager
from pkm_serve.serving.service import InferenceService

State = get_model_status_pb2.ModelVersionStatus.State


class _Served:
    """Model m (version 1) served over gRPC; n's base path exists but holds no version."""

    def __init__(self, tmp_path, poll_seconds):
        self.m, self.n = Fakes(tmp_path / "m"), Fakes(tmp_path / "n")
        self.m.add_version(1)
        self.n.base.mkdir()
        self.manager = ModelManager(self.config("m"), poll_seconds=poll_seconds, loader_factory=self.factory)
        self.manager.start()
        self.frontend = GrpcFrontend(InferenceService(self.manager), None, address="127.0.0.1",
                                     port=free_port(), max_threads=4, max_message_bytes=1 << 20)
        self.frontend.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.frontend.port}")
        self.stub = model_service_pb2_grpc.ModelServiceStub(self.channel)

    def factory(self, name, version, path):
        return (self.m if name == "m" else self.n).factory("m", version, path)

    def config(self, *names):
        cfg = model_server_config_pb2.ModelServerConfig()
        for name in names:
            cfg.model_config_list.config.add(name=name, base_path=str(getattr(self, name).base),
                                             model_platform="tensorflow")
        return cfg

    def reload(self, *names, timeout):
        return self.stub.HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=self.config(*names)), timeout=timeout)

    def close(self):
        self.channel.close()
        self.manager.stop_waiting()
        self.frontend.stop(0, 10)
        self.manager.stop(10)


@pytest.fixture
def served(tmp_path):
    s = _Served(tmp_path, poll_seconds=0.05)
    yield s
    s.close()


def test_reload_adding_a_model_without_versions_answers_once_one_loads(served):
    """It answered OK at once, before the model could serve (a client then sent requests
    to a model that was not there)."""
    def add_version_later():
        time.sleep(0.5)
        served.n.add_version(3)
    writer = threading.Thread(target=add_version_later)
    writer.start()
    t0 = time.monotonic()
    resp = served.reload("m", "n", timeout=20)
    waited = time.monotonic() - t0
    writer.join()
    assert resp.status.error_code == 0
    assert waited >= 0.5, f"answered after {waited:.2f}s, before version 3 existed"
    assert version_states(served.manager, "n") == {3: State.AVAILABLE}


def test_reload_wait_ends_at_the_client_deadline_with_the_config_applied(served):
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        served.reload("m", "n", timeout=0.6)
    assert time.monotonic() - t0 < 5
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    served.n.add_version(2)   # applied: a later poll loads it, no second reload needed
    served.manager.poll_once()
    assert version_states(served.manager, "n") == {2: State.AVAILABLE}
    assert version_states(served.manager, "m") == {1: State.AVAILABLE}


def test_reload_with_a_single_poll_names_the_model_it_cannot_wait_for(tmp_path):
    served = _Served(tmp_path, poll_seconds=0)
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.reload("m", "n", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert f"no version to load of n (base path {served.n.base})" in err.value.details()
    finally:
        served.close()


def test_shutdown_ends_a_waiting_reload(served):
    caught = []

    def reload():
        try:
            served.reload("m", "n", timeout=30)
        except grpc.RpcError as e:
            caught.append(e.code())
    caller = threading.Thread(target=reload)
    caller.start()
    time.sleep(0.3)
    served.manager.stop_waiting()
    caller.join(10)
    assert caught == [grpc.StatusCode.UNAVAILABLE]
