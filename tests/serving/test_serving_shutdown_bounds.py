"""SIGTERM stops the server within a bound, whatever the model is doing: a request stuck in
the model, a version whose load never ends, a signal the kernel hands to a thread other than
the main one. The stuck parts come from a model whose output waits on a queue nobody fills
(a FIFOQueue dequeue blocks, without using CPU, until its session is closed)."""
import ctypes
import json
import os
import platform
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import ServerProcess

GRACE_S = 1.0          # --drain_seconds in these tests
# What the server may take beyond the grace (server.STOP_MARGIN_SECONDS is 5 s), with room
# for a loaded 2-core machine; the old code never exited at all in these cases.
EXIT_BOUND_S = GRACE_S + 12.0


@pytest.fixture(scope="module")
def blocking_model(tmp_path_factory, tf_with_ops):
    """Version 1 of a TF1 SavedModel: y = x + (a dequeue from a queue that stays empty)."""
    tf = tf_with_ops
    base = tmp_path_factory.mktemp("blocking")
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        never_filled = tf.queue.FIFOQueue(1, tf.float32, shapes=[[]], name="never_filled")
        y = x + never_filled.dequeue()
        sig = tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        with tf.compat.v1.Session() as sess:
            builder = tf.compat.v1.saved_model.Builder(str(base / "1"))
            builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map={"serving_default": sig})
            builder.save()
    # A warmup record (TF Serving runs nothing at load without one): with it the load never ends.
    from tensorflow_serving.apis import prediction_log_pb2
    req = predict_pb2.PredictRequest()
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones(1, np.float32)))
    (base / "1" / "assets.extra").mkdir()
    with tf.io.TFRecordWriter(str(base / "1" / "assets.extra" / "tf_serving_warmup_requests")) as w:
        w.write(prediction_log_pb2.PredictionLog(
            predict_log=prediction_log_pb2.PredictLog(request=req)).SerializeToString())
    return base


def _serve(tmp_path, base, *flags, **kwargs):
    return ServerProcess(tmp_path, "--model_name=stuck", f"--model_base_path={base}",
                         "--file_system_poll_wait_seconds=0", f"--drain_seconds={GRACE_S}", *flags, **kwargs)


def _exit_within(srv, seconds):
    """(returncode, seconds taken) of the signalled server; kills it if it outlives `seconds`."""
    t0 = time.monotonic()
    try:
        rc = srv.proc.wait(seconds)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: reported by the assert below
        rc = None
    elapsed = time.monotonic() - t0
    srv.terminate(timeout=1)
    assert rc is not None, f"no exit {seconds:.0f}s after SIGTERM:\n{srv.log()[-3000:]}"
    return rc, elapsed


def test_sigterm_with_requests_stuck_in_the_model_exits_after_the_grace(tmp_path, blocking_model, tf_with_ops):
    srv = _serve(tmp_path, blocking_model, "--enable_model_warmup=false")
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "stuck"
    req.inputs["x"].CopyFrom(tf_with_ops.make_tensor_proto(np.ones(2, np.float32)))
    rest_outcome = {}

    def rest_call():
        body = json.dumps({"instances": [1.0, 2.0]}).encode()
        try:
            urllib.request.urlopen(f"{srv.rest_url}/v1/models/stuck:predict", body, timeout=120).read()
            rest_outcome["answer"] = "a response"
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            rest_outcome["answer"] = e

    with grpc.insecure_channel(srv.target) as ch:
        stuck = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict.future(req, timeout=120)
        rest = threading.Thread(target=rest_call)
        rest.start()
        time.sleep(1.0)                         # both requests are now blocked in the model
        assert not stuck.done() and rest.is_alive(), "the model was meant to block"
        srv.proc.send_signal(signal.SIGTERM)
        rc, elapsed = _exit_within(srv, EXIT_BOUND_S)
        # The stuck requests end with an error when the server goes, not after their 120 s.
        assert stuck.exception(timeout=10) is not None
        rest.join(10)
        assert not rest.is_alive() and isinstance(rest_outcome.get("answer"), Exception)
    assert rc == 0, srv.log()[-3000:]
    assert elapsed < EXIT_BOUND_S
    assert "model stuck: version 1 unloaded" in srv.log()


def test_sigterm_while_a_version_is_still_loading_exits_at_once(tmp_path, blocking_model):
    # Warmup replays the version's warmup record: with this model the load never ends.
    srv = _serve(tmp_path, blocking_model, rest=False, wait_ready=False)
    srv.wait_for_log("model stuck: loading version 1")
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    rc, elapsed = _exit_within(srv, EXIT_BOUND_S)
    assert rc == 0, srv.log()[-3000:]
    assert elapsed < 5.0
    log = srv.log()
    assert "pkm-serve: ready" not in log and "pkm-serve: shutting down" in log


def _thread_that_takes_sigterm(pid):
    """A thread of `pid`, not the main one, that does not block SIGTERM."""
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            blocked = int(next(l for l in f if l.startswith("SigBlk:")).split()[1], 16)
        if not blocked & (1 << (signal.SIGTERM - 1)):
            return tid
    pytest.skip("every thread of the server blocks SIGTERM")


def test_sigterm_delivered_to_another_thread_still_stops_the_server(tmp_path, blocking_model):
    """POSIX lets the kernel deliver a process's signal to any thread that does not block it;
    CPython then runs the handler only when the main thread next runs Python code."""
    srv = _serve(tmp_path, blocking_model, "--enable_model_warmup=false", rest=False)
    tid = _thread_that_takes_sigterm(srv.proc.pid)
    sys_tgkill = {"x86_64": 234, "aarch64": 131}.get(platform.machine())   # tgkill(2): one thread
    if sys_tgkill is None:
        pytest.skip(f"tgkill's syscall number on {platform.machine()} is not listed here")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(sys_tgkill, srv.proc.pid, tid, signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
    rc, elapsed = _exit_within(srv, EXIT_BOUND_S)
    assert rc == 0, srv.log()[-3000:]
    assert "pkm-serve: shutting down" in srv.log()


# ---------------------------------------------------------------- in-process, no TF server
class _FakeServer:
    """What server._stop_within_bound uses of a Server: args.drain_seconds, stop(), stop_step."""

    def __init__(self, stop):
        self.args = type("Args", (), {"drain_seconds": 0.0})()
        self.stop_step = "the part under test"
        self._stop = stop

    def stop(self):
        return self._stop()


@pytest.fixture
def short_bound(monkeypatch):
    from pkm_serve.serving import server
    monkeypatch.setattr(server, "STOP_MARGIN_SECONDS", 0.3)
    return server


def test_stop_status_is_0_only_when_every_part_stopped(short_bound):
    assert short_bound._stop_within_bound(_FakeServer(lambda: []), short_bound._Wakeups()) == 0
    assert short_bound._stop_within_bound(_FakeServer(lambda: ["the REST front end"]),
                                          short_bound._Wakeups()) == 1

    def fails():
        raise RuntimeError("boom")
    assert short_bound._stop_within_bound(_FakeServer(fails), short_bound._Wakeups()) == 1


def test_a_stop_that_never_returns_is_abandoned_at_the_bound(short_bound, caplog):
    never = threading.Event()
    t0 = time.monotonic()
    try:
        status = short_bound._stop_within_bound(_FakeServer(never.wait), short_bound._Wakeups())
    finally:
        never.set()
    assert status == 1
    assert time.monotonic() - t0 < 5.0           # bound 0.3 s, backstop 1 s after it
    assert "still stopping the part under test" in caplog.text


def test_a_second_sigint_ends_the_wait_at_once(short_bound, caplog):
    never = threading.Event()
    wakeups = short_bound._Wakeups()
    os.write(wakeups._write, bytes([signal.SIGINT]))   # what set_wakeup_fd writes for it
    t0 = time.monotonic()
    try:
        assert short_bound._stop_within_bound(_FakeServer(never.wait), wakeups) == 1
    finally:
        never.set()
    assert time.monotonic() - t0 < 1.0
    assert "second stop signal" in caplog.text


def test_a_second_sigterm_does_not_cut_the_drain(short_bound, caplog):
    """Two SIGTERMs in quick succession: the second used to end the wait at once (status 1,
    in-flight requests cut); the stop now runs to its end and the status is its own."""
    drained = threading.Event()

    def drain():
        time.sleep(0.5)
        drained.set()
        return []
    wakeups = short_bound._Wakeups()
    os.write(wakeups._write, bytes([signal.SIGTERM, signal.SIGTERM]))
    t0 = time.monotonic()
    assert short_bound._stop_within_bound(_FakeServer(drain), wakeups) == 0
    assert drained.is_set() and time.monotonic() - t0 >= 0.5
    assert caplog.text.count("the drain goes on") == 2
