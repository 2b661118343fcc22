"""Availability-preserving version transitions under a gRPC load.

Version 2 is dropped into the model directory while clients keep calling
Predict: serving must switch to version 2 with zero failed requests. Then a
corrupt version 3 appears: version 2 must keep serving, and GetModelStatus must
report version 3's failure. Each phase lasts until the server reports the transition
and ANSWERS_PER_PHASE answers came after it (not a fixed time: the load is CPU).
"""
import os
import shutil
import threading
import time

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import (get_model_status_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)

from serving_helpers import ServerProcess

CLIENTS = 4
ANSWERS_PER_PHASE = 40       # answers before version 2, after it took over, after version 3 failed
State = get_model_status_pb2.ModelVersionStatus.State


def _copy_version_atomically(src, base, version):
    tmp = os.path.join(base, f".incoming-{version}")
    shutil.copytree(src, tmp)
    os.rename(tmp, os.path.join(base, str(version)))


def _version_states(target):
    with grpc.insecure_channel(target) as ch:
        return model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "pkm"}), timeout=10)


def _wait_for_states(target, want, seconds=30):
    """Until GetModelStatus reports (at least) the {version: state} of `want`, or `seconds` pass."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if {s.version: s.state for s in _version_states(target).model_version_status}.items() >= want.items():
            return
        time.sleep(0.05)


class _Load:
    """CLIENTS threads calling Predict without a version; each answer is checked against the
    version that says it answered, and logged as (time received, version)."""

    def __init__(self, target, request, expected):
        self.log, self.failures = [], []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._target, self._request, self._expected = target, request, expected
        self._threads = [threading.Thread(target=self._client) for _ in range(CLIENTS)]

    def _client(self):
        import tensorflow as tf
        with grpc.insecure_channel(self._target) as ch:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
            while not self._stop.is_set():
                try:
                    resp = stub.Predict(self._request, timeout=10)
                    v = resp.model_spec.version.value
                    out = tf.make_ndarray(resp.outputs["output"])
                    if not np.allclose(out, self._expected[v], rtol=1e-6, atol=1e-7):
                        raise AssertionError(f"version {v} answered with wrong values")
                    with self._lock:
                        self.log.append((time.monotonic(), v))
                except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
                    with self._lock:
                        self.failures.append(repr(e))

    def start(self):
        for t in self._threads:
            t.start()

    def stop(self):
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:   # started
                t.join(30)

    def answers_after(self, t, count=ANSWERS_PER_PHASE, seconds=30):
        """Waits until `count` answers came in after `t` (or a request failed)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.failures:
            with self._lock:
                if sum(at > t for at, _ in self.log) >= count:
                    return
            time.sleep(0.02)


@pytest.mark.slow
def test_version_2_takes_over_under_load_and_corrupt_version_3_is_reported(tmp_path, saved_models, tf_with_ops):
    tf = tf_with_ops
    base = tmp_path / "pkm"
    base.mkdir()
    _copy_version_atomically(saved_models[1], str(base), 1)
    server = ServerProcess(tmp_path, "--model_name=pkm", f"--model_base_path={base}",
                           "--file_system_poll_wait_seconds=0.1", "--max_num_load_retries=0", rest=False)
    queries = np.random.default_rng(5).standard_normal((3, 32)).astype(np.float32)
    expected = {v: tf.saved_model.load(saved_models[v]).signatures["serving_default"](query=queries)["output"].numpy()
                for v in (1, 2)}
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "pkm"
    request.inputs["query"].CopyFrom(tf.make_tensor_proto(queries))
    load = _Load(server.target, request, expected)
    try:
        load.start()
        load.answers_after(0.0)                         # version 1 serving under load
        dropped_v2 = time.monotonic()
        _copy_version_atomically(saved_models[2], str(base), 2)
        _wait_for_states(server.target, {1: State.END, 2: State.AVAILABLE}, 8)   # within 8 s (below)
        load.answers_after(time.monotonic() + 1.0)      # past the 1 s in-flight allowance
        (base / ".incoming-3").mkdir()
        (base / ".incoming-3" / "saved_model.pb").write_bytes(b"this is not a SavedModel")
        os.rename(base / ".incoming-3", base / "3")
        dropped_v3 = time.monotonic()
        _wait_for_states(server.target, {3: State.END})  # its load was tried and failed
        v3_failed = time.monotonic()
        load.answers_after(v3_failed)
        load.stop()
        status = _version_states(server.target)
    finally:
        load.stop()
        rc = server.terminate()
    assert rc == 0, server.log()[-3000:]
    log = load.log

    assert not load.failures, f"{len(load.failures)} failed requests, first: {load.failures[:3]}"
    assert len(log) > 100, f"only {len(log)} requests"
    before = [v for t, v in log if t < dropped_v2]
    assert before and set(before) == {1}
    first_v2 = min((t for t, v in log if v == 2), default=None)
    assert first_v2 is not None, f"version 2 never answered:\n{server.log()[-3000:]}"
    assert first_v2 - dropped_v2 < 8, "version 2 took too long to be served"
    # Once version 2 served, version 1 never answered again (it was unloaded after 2 was ready)
    # -- allow requests already in flight at the switch.
    assert all(v == 2 for t, v in log if t > first_v2 + 1.0)
    after_v3 = [v for t, v in log if t > min(v3_failed, dropped_v3 + 3)]   # from its failure on
    assert len(after_v3) >= ANSWERS_PER_PHASE and set(after_v3) == {2}, \
        "version 2 must keep serving after the corrupt version 3"

    states = {s.version: s for s in status.model_version_status}
    assert states[2].state == State.AVAILABLE
    assert states[3].state == State.END
    assert states[3].status.error_code != 0
    assert "cannot read SavedModel" in states[3].status.error_message
    assert states[1].state == State.END and states[1].status.error_code == 0
    assert "version 3 failed to load" in server.log()
