"""Batching (results split back correctly, batches really form), deadlines, and
SIGTERM draining in-flight requests before exit."""
import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import ServerProcess, start_batching_server

BATCH_TIMEOUT_S = 1.5   # long on purpose: a lone request waits this long for company
MAX_BATCH = 8


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("batching")
    (tmp / "monitoring.config").write_text("prometheus_config { enable: true }")
    srv = start_batching_server(
        tmp, saved_models,
        f"max_batch_size {{ value: {MAX_BATCH} }}\n"
        f"batch_timeout_micros {{ value: {int(BATCH_TIMEOUT_S * 1e6)} }}\n"
        "num_batch_threads { value: 1 }\nmax_enqueued_batches { value: 4 }\n",
        "--model_config_file_poll_wait_seconds=0", f"--monitoring_config_file={tmp / 'monitoring.config'}",
        "--drain_seconds=20")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def latest_model(saved_models, tf_with_ops):
    """The signature the servers serve (version 2, the latest), loaded once: the reference."""
    return tf_with_ops.saved_model.load(saved_models[2]).signatures["serving_default"]


def _predict_request(tf, queries):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.inputs["query"].CopyFrom(tf.make_tensor_proto(queries))
    return req


def test_concurrent_requests_are_batched_and_split_back(batching_server, latest_model, tf_with_ops):
    tf = tf_with_ops
    model = latest_model
    rng = np.random.default_rng(3)
    # 8 requests of 1 row fill one batch of 8 exactly (no waiting for the timeout).
    queries = [rng.standard_normal((1, 32)).astype(np.float32) for _ in range(MAX_BATCH)]
    results = [None] * len(queries)
    with grpc.insecure_channel(batching_server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)

        def call(i):
            results[i] = stub.Predict(_predict_request(tf, queries[i]), timeout=30)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(queries))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    for q, r in zip(queries, results):
        np.testing.assert_allclose(tf.make_ndarray(r.outputs["output"]), model(query=q)["output"].numpy(),
                                   rtol=1e-6, atol=1e-7)
    assert elapsed < BATCH_TIMEOUT_S, "a full batch must run without waiting for the timeout"
    with urllib.request.urlopen(batching_server.rest_url + "/monitoring/prometheus/metrics", timeout=30) as r:
        text = r.read().decode()
    # All 8 rows went through as one batch: the batch-size histogram saw an 8 (le="8" bucket
    # count exceeds le="4").
    def bucket(le):
        line = next(l for l in text.splitlines()
                    if l.startswith(':tensorflow:serving:batching_session:processed_batch_size_bucket{le="%s"' % le))
        return float(line.rsplit(" ", 1)[1])
    assert bucket("8.0") - bucket("4.0") >= 1


def test_deadline_is_honoured_while_waiting_for_a_batch(batching_server, tf_with_ops):
    with grpc.insecure_channel(batching_server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(_predict_request(tf_with_ops, np.zeros((1, 32), np.float32)), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("sigterms", [1, 2])
def test_sigterm_drains_in_flight_requests(tmp_path, saved_models, latest_model, tf_with_ops, sigterms):
    """With sigterms=2 a second SIGTERM follows the first at once (an orchestrator's
    repeat, or one sent to the process group as well as the process): it used to exit
    at once with status 1, cutting the request waiting in the batch queue."""
    tf = tf_with_ops
    batching = tmp_path / "batching.config"
    batching.write_text(f"max_batch_size {{ value: 64 }} batch_timeout_micros {{ value: {int(BATCH_TIMEOUT_S * 1e6)} }}")
    base = saved_models[1].rsplit("/", 1)[0]
    srv = ServerProcess(tmp_path, "--model_name=pkm", f"--model_base_path={base}",
                        "--file_system_poll_wait_seconds=0", "--enable_batching",
                        f"--batching_parameters_file={batching}", rest=False, name="drain")
    query = np.ones((2, 32), np.float32)
    want = latest_model(query=query)["output"].numpy()
    outcome = {}
    with grpc.insecure_channel(srv.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
        stub.Predict(_predict_request(tf, query), timeout=30)   # channel connected, model warm

        def call():
            try:
                outcome["response"] = stub.Predict(_predict_request(tf, query), timeout=30)
            except grpc.RpcError as e:
                outcome["error"] = e

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.4)                  # the request now sits in the batch queue (1.5 s timeout)
        for _ in range(sigterms):
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        t.join(30)
        rc = srv.proc.wait(30)
    srv.terminate()
    assert "error" not in outcome, outcome.get("error")
    np.testing.assert_allclose(tf.make_ndarray(outcome["response"].outputs["output"]), want, rtol=1e-6, atol=1e-7)
    assert rc == 0, srv.log()[-3000:]
    assert "pkm-serve: shutting down" in srv.log()
    assert ("the drain goes on" in srv.log()) == (sigterms == 2), srv.log()[-3000:]


def test_sigterm_exits_cleanly_when_nobody_reads_stdout(tmp_path, saved_models):
    """A parent that pipes the server's stdout and goes away must not turn SIGTERM into a crash."""
    import os
    import subprocess
    import sys
    from serving_helpers import REPO, free_port
    base = saved_models[1].rsplit("/", 1)[0]
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen([sys.executable, "-m", "pkm_serve.serving", f"--port={free_port()}",
                             f"--model_base_path={base}", "--file_system_poll_wait_seconds=0",
                             "--log_level=WARNING"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while "pkm-serve: ready" not in proc.stdout.readline():
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        proc.stdout.close()                         # the reader is gone
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
