"""A TF Serving batching_parameters file with enable_large_batch_splitting, served, driven
by real gRPC and REST clients: requests up to max_batch_size rows (most larger than
max_execution_batch_size, so split) each get the answer of the SavedModel run alone
in-process, and no executed batch is larger than max_execution_batch_size."""
import json
import re
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import start_batching_server

MAX_BATCH, MAX_EXECUTION = 8, 4
METRICS_PATH = "/monitoring/prometheus/metrics"


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("batch_splitting")
    # allowed_batch_sizes ends at max_batch_size, as tensorflow_model_server requires
    # (bundle_factory_util.cc); runs of 3 rows are padded to 4.
    (tmp / "monitoring.config").write_text(f'prometheus_config {{ enable: true path: "{METRICS_PATH}" }}')
    srv = start_batching_server(
        tmp, saved_models,
        f"max_batch_size {{ value: {MAX_BATCH} }} batch_timeout_micros {{ value: 20000 }}\n"
        f"enable_large_batch_splitting {{ value: true }} max_execution_batch_size {{ value: {MAX_EXECUTION} }}\n"
        "num_batch_threads { value: 2 } max_enqueued_batches { value: 100 }\n"
        f"allowed_batch_sizes: 2 allowed_batch_sizes: 4 allowed_batch_sizes: {MAX_BATCH}\n",
        f"--monitoring_config_file={tmp / 'monitoring.config'}")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def reference(saved_models, tf_with_ops):
    """The served (latest) version loaded in-process: each request run alone."""
    return tf_with_ops.saved_model.load(saved_models[2]).signatures


def _requests(rng):
    out = []
    for rows in [MAX_BATCH, 5, 7, 1, 6, 3, MAX_BATCH, 2]:
        out.append(("serving_default", {"query": rng.standard_normal((rows, 32)).astype(np.float32)}))
    for rows in [MAX_BATCH, 5, 2]:
        ids = rng.integers(0, 64 * 64, (rows, 4)).astype(np.int64)
        ids[-1, -1] = -1
        out.append(("lookup", {"indices": ids, "weights": rng.random((rows, 4)).astype(np.float32)}))
    return out


def _call(server, stub, tf, signature, inputs, rest):
    if rest:   # columnar "inputs"
        body = json.dumps({"signature_name": signature,
                           "inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
        with urllib.request.urlopen(server.rest_url + "/v1/models/pkm:predict", body, timeout=60) as r:
            outputs = json.loads(r.read())["outputs"]
        return {k: np.asarray(v) for k, v in (outputs if isinstance(outputs, dict)
                                              else {"output": outputs}).items()}
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.model_spec.signature_name = signature
    for k, v in inputs.items():
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return {k: tf.make_ndarray(v) for k, v in stub.Predict(req, timeout=60).outputs.items()}


def _batch_size_histogram(server):
    with urllib.request.urlopen(server.rest_url + METRICS_PATH, timeout=30) as r:
        text = r.read().decode()
    name = ":tensorflow:serving:batching_session:processed_batch_size"
    buckets = {float(le): float(v) for le, v in
               re.findall(re.escape(name) + r'_bucket\{le="([^"]+)"\} (\S+)', text)}
    return buckets


def test_split_requests_get_the_answer_of_the_model_run_alone(server, reference, tf_with_ops):
    tf = tf_with_ops
    requests = _requests(np.random.default_rng(21))
    answers, errors = [None] * len(requests), []
    with grpc.insecure_channel(server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)

        def call(i):
            try:
                answers[i] = _call(server, stub, tf, *requests[i], rest=i % 2 == 1)
            except Exception as e:  # noqa: BLE001 - reported below with its request
                errors.append((i, e))
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert not errors, errors
    for (signature, inputs), got in zip(requests, answers):
        want = reference[signature](**{k: tf.constant(v) for k, v in inputs.items()})
        assert set(got) == set(want)
        for k in want:
            assert got[k].shape == tuple(want[k].shape), (signature, k)
            np.testing.assert_allclose(got[k], want[k].numpy(), rtol=1e-5, atol=1e-6)
    buckets = _batch_size_histogram(server)
    # Every executed batch had at most MAX_EXECUTION rows, though requests had up to MAX_BATCH.
    assert buckets[float("inf")] > 0
    assert buckets[float(MAX_EXECUTION)] == buckets[float("inf")], buckets


def test_request_over_max_batch_size_is_refused(server, tf_with_ops):
    with grpc.insecure_channel(server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            _call(server, stub, tf_with_ops, "serving_default",
                  {"query": np.zeros((MAX_BATCH + 1, 32), np.float32)}, rest=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"Task size {MAX_BATCH + 1} is larger than maximum input batch size {MAX_BATCH}"
