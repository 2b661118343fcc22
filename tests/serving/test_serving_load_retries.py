"""TF Serving's load retries (--max_num_load_retries, --load_retry_interval_micros:
LoaderHarness through util/retrier.cc), its start-up wait for a model without any
version yet, and its start-up error, which counts servables (models), not versions."""
import logging
import os
import shutil
import threading
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import get_model_status_pb2, model_pb2, predict_pb2, prediction_service_pb2_grpc
from tensorflow_serving.config import model_server_config_pb2

import half_plus_two as hpt
from serving_helpers import ServerProcess, version_states, wait_until
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.loader import Loader
from pkm_serve.serving import manager as manager_module
from pkm_serve.serving.manager import ModelManager

State = get_model_status_pb2.ModelVersionStatus.State


class FlakyLoader(Loader):
    """Fails its first `failures[version]` loads (counted across loaders of that version)."""

    def __init__(self, version, attempts, failures):
        self.version, self._attempts, self._failures = version, attempts, failures

    def load(self):
        self._attempts[self.version] = self._attempts.get(self.version, 0) + 1
        if self._attempts[self.version] <= self._failures.get(self.version, 0):
            raise ServingError(grpc.StatusCode.NOT_FOUND, f"try {self._attempts[self.version]} of {self.version}")

    def servable(self):
        return self

    def unload(self):
        pass


class Flaky:
    def __init__(self, base, versions, failures):
        self.base, self.attempts, self.failures = base, {}, dict(failures)
        for v in versions:
            os.makedirs(base / str(v))

    def factory(self, name, version, path):
        return FlakyLoader(version, self.attempts, self.failures)


def _config(base, policy_all=False):
    cfg = model_server_config_pb2.ModelServerConfig()
    c = cfg.model_config_list.config.add(name="m", base_path=str(base), model_platform="tensorflow")
    if policy_all:
        c.model_version_policy.all.SetInParent()
    return cfg


def _manager(flaky, retries, interval=0.0, poll_seconds=0, policy_all=False):
    return ModelManager(_config(flaky.base, policy_all), poll_seconds=poll_seconds, loader_factory=flaky.factory,
                        max_num_load_retries=retries, load_retry_interval_seconds=interval)


def test_a_load_that_fails_is_retried_and_then_serves(tmp_path, caplog):
    flaky = Flaky(tmp_path / "m", [1], {1: 2})
    manager = _manager(flaky, retries=2)
    with caplog.at_level(logging.INFO, logger="pkm_serve.serving"):
        manager.start()
    assert flaky.attempts == {1: 3} and version_states(manager) == {1: State.AVAILABLE}
    assert "Loading servable: {name: m version: 1} failed: try 2 of 1" in caplog.text
    assert "Retrying of Loading servable: {name: m version: 1} retry: 2" in caplog.text
    manager.stop()


def test_retries_stop_after_max_num_load_retries(tmp_path, caplog):
    """1 + max_num_load_retries tries, load_retry_interval apart; then the start fails."""
    flaky = Flaky(tmp_path / "m", [1], {1: 10})
    manager = _manager(flaky, retries=2, interval=0.2)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="pkm_serve.serving"), \
            pytest.raises(ServingError, match=r"NOT_FOUND: try 3 of 1\}, \}$"):
        manager.start()
    assert flaky.attempts == {1: 3}
    assert time.monotonic() - t0 >= 0.4
    assert "Retrying of Loading servable: {name: m version: 1} exhausted max_num_retries: 2" in caplog.text


def _serving_1_with_a_failing_2_added(tmp_path):
    """A manager serving version 1, then a version 2 that fails 100 tries, retried every 0.05 s."""
    flaky = Flaky(tmp_path / "m", [1], {})
    manager = _manager(flaky, retries=0, poll_seconds=-1)
    manager.start()
    manager.poll_once()
    flaky.failures[2] = 100
    manager._max_num_load_retries, manager._load_retry_interval_seconds = 100, 0.05
    os.makedirs(flaky.base / "2")
    return flaky, manager


def test_a_retry_is_cancelled_when_the_version_directory_goes(tmp_path):
    """TF Serving cancels the retries of a version that is no longer aspired."""
    flaky, manager = _serving_1_with_a_failing_2_added(tmp_path)
    threading.Timer(0.3, shutil.rmtree, [flaky.base / "2"]).start()
    manager.poll_once()                       # returns: the retries stop when 2 is gone
    assert 2 <= flaky.attempts[2] < 100
    assert version_states(manager) == {1: State.AVAILABLE, 2: State.END}


def test_a_retry_is_cancelled_when_a_newer_version_takes_its_place(tmp_path):
    """A fix pushed as version 3 while version 2's load is being retried: under the default
    `latest` policy 2 is no longer aspired, so TF Serving cancels its retries and 3 loads in
    the same poll (it waited out every retry before: 5 minutes with the default flags)."""
    flaky, manager = _serving_1_with_a_failing_2_added(tmp_path)
    threading.Timer(0.3, os.makedirs, [flaky.base / "3"]).start()
    started = time.monotonic()
    manager.poll_once()                       # 2's retries stop once 3 is there; 3 loads
    assert 2 <= flaky.attempts[2] < 100 and time.monotonic() - started < 30
    assert version_states(manager)[3] == State.AVAILABLE


def test_a_start_whose_broken_version_is_superseded_during_its_retries_serves_the_new_one(tmp_path):
    """Start-up awaits Latest(M), as TF Serving's initial load: version 2 keeps failing and a fix
    arrives as version 3 during 2's retries; 2's retries end, 3 loads in the same poll and the
    server starts (it failed with 2's error while 3 sat on disk)."""
    flaky = Flaky(tmp_path / "m", [2], {2: 100})
    manager = _manager(flaky, retries=100, interval=0.05, poll_seconds=0.05)
    threading.Timer(0.3, os.makedirs, [flaky.base / "3"]).start()
    manager.start()
    assert 2 <= flaky.attempts[2] < 100 and flaky.attempts[3] == 1
    assert version_states(manager)[3] == State.AVAILABLE
    manager.stop()


def _start_in_a_thread(manager):
    """(the thread running manager.start(), the list its ServingError lands in)."""
    errors = []

    def start():
        try:
            manager.start()
        except ServingError as e:
            errors.append(e)
    starter = threading.Thread(target=start)
    starter.start()
    return starter, errors


def test_stop_cancels_a_retry_wait(tmp_path):
    flaky = Flaky(tmp_path / "m", [1], {1: 10})
    manager = _manager(flaky, retries=5, interval=600.0)
    starter, errors = _start_in_a_thread(manager)
    wait_until(lambda: flaky.attempts.get(1) == 1)
    manager.stop()
    starter.join(10)
    assert not starter.is_alive() and flaky.attempts == {1: 1}
    assert len(errors) == 1 and "1 servable(s) did not become available" in errors[0].message


def test_a_retry_interval_past_what_a_wait_takes_still_waits(tmp_path):
    """--load_retry_interval_micros=9223372036854775807 (int64 max: "never retry soon") made
    the retry wait raise OverflowError, which ended the load with that error instead."""
    flaky = Flaky(tmp_path / "m", [1], {1: 10})
    manager = _manager(flaky, retries=5, interval=(2 ** 63 - 1) / 1e6)
    starter, errors = _start_in_a_thread(manager)
    wait_until(lambda: flaky.attempts.get(1) == 1)
    time.sleep(0.2)
    assert starter.is_alive()           # waiting for the retry, not failed
    manager.stop()
    starter.join(10)
    assert len(errors) == 1 and errors[0].message.endswith("due to error: NOT_FOUND: try 1 of 1}, }")


def test_start_error_counts_servables_not_versions(tmp_path):
    """load_servables_fast.cc awaits Latest(m) per model: two failed versions of one model
    are "1 servable(s)", named by one entry (the newest), in upstream's braces."""
    flaky = Flaky(tmp_path / "m", [1, 2], {1: 1, 2: 1})
    with pytest.raises(ServingError) as err:
        _manager(flaky, retries=0, policy_all=True).start()
    assert err.value.message == ("1 servable(s) did not become available: "
                                 "{{{name: m version: 2} due to error: NOT_FOUND: try 1 of 2}, }")


def test_start_waits_for_a_model_without_versions(tmp_path, caplog):
    """As tensorflow_model_server: "No versions of servable m found under base path ..." and
    the initial load waits (polling) until a version appears, here and for a missing base path."""
    flaky = Flaky(tmp_path / "m", [], {})
    manager = _manager(flaky, retries=0, poll_seconds=0.05)
    starter = threading.Thread(target=manager.start)
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        starter.start()
        time.sleep(0.3)                       # no base path yet
        os.makedirs(flaky.base)
        time.sleep(0.3)                       # a base path without versions
        assert starter.is_alive() and flaky.attempts == {}
        os.makedirs(flaky.base / "4")
        starter.join(10)
    assert not starter.is_alive() and version_states(manager) == {4: State.AVAILABLE}
    assert f"Could not find base path {flaky.base} for servable m" in caplog.text
    assert f"No versions of servable m found under base path {flaky.base}." in caplog.text
    assert "waiting for a version of m to load" in caplog.text
    manager.stop()


def test_a_long_start_up_wait_says_so_again(tmp_path, caplog, monkeypatch):
    """Ports stay closed while the start waits (a base path naming a version directory itself
    waits forever): the warning comes again every WAITING_WARNING_SECONDS, not only once."""
    monkeypatch.setattr(manager_module, "WAITING_WARNING_SECONDS", 0.2)
    flaky = Flaky(tmp_path / "m", [], {})
    os.makedirs(flaky.base)
    manager = _manager(flaky, retries=0, poll_seconds=0.05)
    starter = threading.Thread(target=manager.start)
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        starter.start()
        time.sleep(1.0)
        os.makedirs(flaky.base / "1")
        starter.join(10)
    assert not starter.is_alive() and version_states(manager) == {1: State.AVAILABLE}
    assert caplog.text.count("waiting for a version of m to load") >= 3
    manager.stop()


@pytest.mark.parametrize("make_base", [True, False])
def test_polling_once_without_a_version_is_an_error_not_a_hang(tmp_path, make_base):
    """TF Serving with --file_system_poll_wait_seconds=0 would wait forever."""
    if make_base:
        (tmp_path / "m").mkdir()
    manager = ModelManager(_config(tmp_path / "m"), poll_seconds=0, loader_factory=None)
    with pytest.raises(ServingError, match="no version to load of m, and --file_system_poll_wait_seconds=0"):
        manager.start()


def _predict_half_plus_two(target, x):
    with grpc.insecure_channel(target) as ch:
        req = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name="m"))
        req.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[x]], np.float32)))
        return prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=30)


def test_server_retries_a_version_still_being_written_and_waits_for_an_empty_base_path(tmp_path):
    """A user copies version 1 in place (not atomically) while the server starts: the
    first load fails on the half-written files, a retry loads them. A second server on a
    base path still empty waits, ports closed, until a version appears."""
    base = tmp_path / "m"
    (base / "1").mkdir(parents=True)
    (base / "1" / "saved_model.pb").write_bytes(b"half written")
    server = ServerProcess(tmp_path, "--model_name=m", f"--model_base_path={base}", "--load_pkm_ops=false",
                           "--load_retry_interval_micros=1500000", "--max_num_load_retries=20",
                           "--file_system_poll_wait_seconds=0.2", rest=False, wait_ready=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    waiting = ServerProcess(tmp_path, "--model_name=m", f"--model_base_path={empty}", "--load_pkm_ops=false",
                            "--file_system_poll_wait_seconds=0.2", rest=False, name="waiting", wait_ready=False)
    try:
        server.wait_for_log("Loading servable: {name: m version: 1} failed: ")
        good = hpt.write_tf1(str(tmp_path / "good"))          # the copy finishes, in place
        os.rename(os.path.join(good, "variables"), base / "1" / "variables")
        os.replace(os.path.join(good, "saved_model.pb"), base / "1" / "saved_model.pb")
        server.wait_for_log("pkm-serve: ready", timeout=60)
        assert list(_predict_half_plus_two(server.target, 4.0).outputs["y"].float_val) == [4.0]
        waiting.wait_for_log("No versions of servable m found under base path", timeout=60)
        assert "listening" not in waiting.log()
        hpt.write_versioned(str(empty), 3, hpt.write_tf1)
        waiting.wait_for_log("pkm-serve: ready", timeout=60)
        assert list(_predict_half_plus_two(waiting.target, 4.0).outputs["y"].float_val) == [4.0]
    finally:
        assert server.terminate() == 0, server.log()[-3000:]
        assert waiting.terminate() == 0, waiting.log()[-3000:]
