"""Soak: 10 version swaps of a model with a 64 MiB table under 8 concurrent gRPC clients,
batching on and off.

Each version's table is filled with its version number, so an answer tells by value
which version computed it, and must agree with the version in its model_spec. After
each swap GetModelStatus must report the new version AVAILABLE and the old one END;
from then on no request may be answered by an old version. No request may fail. The
server's RSS after the last swap must be within 2 tables of its RSS after the first:
an unloaded version releases its variables (once, each swap leaked a table).
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

ROWS, DIM = 16384, 1024                  # float32: 64 MiB
TABLE_BYTES = ROWS * DIM * 4
SWAPS = 10
CLIENTS = 8
BAG = 4                                   # indices per request row; output = version * BAG
ANSWERS_PER_SWAP = 20                     # requests answered against each new version alone
State = get_model_status_pb2.ModelVersionStatus.State


def _write_table_model(base, version):
    """base/<version>: output = embedding_bag(table filled with `version`, indices) (fused op)."""
    import tensorflow as tf
    from pkm_serve import ops

    class TableModel(tf.Module):
        def __init__(self):
            super().__init__()
            self.table = tf.Variable(tf.fill([ROWS, DIM], float(version)))

    m = TableModel()
    fn = tf.function(lambda indices: {"output": ops.embedding_bag(m.table, indices, combiner="sum")},
                     input_signature=[tf.TensorSpec([None, None], tf.int64, name="indices")])
    tmp = os.path.join(base, f".tmp-{version}")
    tf.saved_model.save(m, tmp, signatures={"serving_default": fn.get_concrete_function()})
    os.rename(tmp, os.path.join(base, str(version)))


def _rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _states(stub):
    resp = stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "table"}),
                               timeout=10)
    return {s.version: s.state for s in resp.model_version_status}


class _Clients:
    """CLIENTS threads calling Predict without a version; every answer is checked and logged."""

    def __init__(self, target):
        self.answers = []        # (send time, version)
        self.failures = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._target = target
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(CLIENTS)]

    def _loop(self, i):
        import tensorflow as tf
        rows = 1 + i % 3
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "table"
        idx = np.random.default_rng(i).integers(0, ROWS, (rows, BAG))
        req.inputs["indices"].CopyFrom(tf.make_tensor_proto(idx))
        with grpc.insecure_channel(self._target) as ch:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    resp = stub.Predict(req, timeout=30)
                    v = resp.model_spec.version.value
                    out = np.array(resp.outputs["output"].float_val).reshape(rows, DIM)
                    if not np.all(out == v * BAG):
                        raise AssertionError(f"answer labelled version {v} holds {out[0, 0]} "
                                             f"(version {out[0, 0] / BAG:g} computed it)")
                    with self._lock:
                        self.answers.append((sent, v))
                except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
                    with self._lock:
                        self.failures.append(repr(e)[:300])

    def wait_for_answers_sent_after(self, t, count, seconds=60):
        """Until `count` answers to requests sent after `t` are in (or a request failed)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.failures:
            with self._lock:
                if sum(sent > t for sent, _ in self.answers[-4 * count:]) >= count:
                    return
            time.sleep(0.02)

    def start(self):
        for t in self._threads:
            t.start()

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture(scope="module")
def versions(tmp_path_factory, tf_with_ops):
    """Versions 1 to SWAPS + 1, written once for both tests: each test links them into its base
    path (saving 64 MiB tables costs more than the server's load of them)."""
    root = tmp_path_factory.mktemp("soak")
    for version in range(1, SWAPS + 2):
        _write_table_model(str(root), version)
    return root


def _link_version_atomically(versions, base, version):
    """versions/<version> hard-linked into base/<version> through a temp name and a rename (the
    server only reads the files; removing base/<version> later leaves the written one)."""
    tmp = base / f".incoming-{version}"
    shutil.copytree(versions / str(version), tmp, copy_function=os.link)
    os.rename(tmp, base / str(version))


@pytest.mark.slow
@pytest.mark.parametrize("batching", [False, True], ids=["batching_off", "batching_on"])
def test_ten_swaps_under_load(tmp_path, versions, batching):
    base = tmp_path / "table"
    base.mkdir()
    _link_version_atomically(versions, base, 1)
    flags = ["--model_name=table", f"--model_base_path={base}", "--file_system_poll_wait_seconds=0.05"]
    if batching:
        (tmp_path / "batching.config").write_text(
            "max_batch_size { value: 32 } batch_timeout_micros { value: 1000 } num_batch_threads { value: 2 }")
        flags += ["--enable_batching", f"--batching_parameters_file={tmp_path / 'batching.config'}"]
    server = ServerProcess(tmp_path, *flags, rest=False)
    clients = _Clients(server.target)
    swapped_at = {}     # new version -> time its predecessor was seen END
    rss = []
    try:
        with grpc.insecure_channel(server.target) as ch:
            status = model_service_pb2_grpc.ModelServiceStub(ch)
            clients.start()
            for new in range(2, SWAPS + 2):
                _link_version_atomically(versions, base, new)
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    states = _states(status)
                    if states.get(new) == State.AVAILABLE and states.get(new - 1) == State.END:
                        break
                    time.sleep(0.05)
                else:
                    raise AssertionError(f"swap to {new} not done in 60 s: {states}\n{server.log()[-3000:]}")
                swapped_at[new] = time.monotonic()
                shutil.rmtree(base / str(new - 1))       # as a deployment cleans up
                clients.wait_for_answers_sent_after(swapped_at[new], ANSWERS_PER_SWAP)
                rss.append(_rss_bytes(server.proc.pid))
            clients.stop()
    finally:
        clients.stop()
        rc = server.terminate()
    assert rc == 0, server.log()[-3000:]
    assert not clients.failures, f"{len(clients.failures)} failed requests, first: {clients.failures[:3]}"
    assert len(clients.answers) > 20 * SWAPS, f"only {len(clients.answers)} answers"
    for new, t in swapped_at.items():
        stale = [v for sent, v in clients.answers if sent > t and v < new]
        assert not stale, f"after version {new - 1} was END, versions {sorted(set(stale))} answered"
        after = sum(sent > t for sent, _ in clients.answers)
        assert after >= ANSWERS_PER_SWAP, f"only {after} answers to requests sent after version {new} took over"
    print(f"RSS after each swap (MiB): {[round(r / 2**20) for r in rss]}; {len(clients.answers)} answers")
    growth = rss[-1] - rss[0]
    assert growth < 2 * TABLE_BYTES, (f"RSS grew {growth / 2**20:.0f} MiB over {SWAPS - 1} swaps "
                                      f"(limit {2 * TABLE_BYTES / 2**20:.0f} MiB): "
                                      f"{[round(r / 2**20) for r in rss]} MiB")
