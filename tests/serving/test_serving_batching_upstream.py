"""Batching against TF Serving's batching session, driven by real gRPC and REST clients:
every answer of a concurrent mix (rows 1..max_batch_size, two signatures, bags of several
lengths, padded to allowed_batch_sizes) equals the model run alone in-process, and a
request larger than max_batch_size is refused with upstream's words."""
import json
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import start_batching_server

MAX_BATCH = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("batching_upstream")
    srv = start_batching_server(
        tmp, saved_models,
        f"max_batch_size {{ value: {MAX_BATCH} }} batch_timeout_micros {{ value: 20000 }}\n"
        "num_batch_threads { value: 2 } allowed_batch_sizes: 2 allowed_batch_sizes: 4\n"
        "max_enqueued_batches { value: 100 }\n")   # the burst below must not be refused
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def reference(saved_models, tf_with_ops):
    """The served (latest) version, loaded in-process: each request run alone."""
    return tf_with_ops.saved_model.load(saved_models[2]).signatures


def _request(tf, signature, inputs):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.model_spec.signature_name = signature
    for k, v in inputs.items():
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return req


def _mixed_requests(rng):
    """(signature, inputs) of every size a batch may take, some bags padded with -1."""
    out = []
    for rows in [1, 2, 3, 4] * 4:
        out.append(("serving_default", {"query": rng.standard_normal((rows, 32)).astype(np.float32)}))
    for rows, k in [(1, 3), (2, 3), (3, 3), (1, 5), (2, 5), (4, 5)] * 2:
        ids = rng.integers(0, 64 * 64, (rows, k)).astype(np.int64)
        ids[0, -1] = -1
        out.append(("lookup", {"indices": ids, "weights": rng.random((rows, k)).astype(np.float32)}))
    return out


def test_each_batched_answer_equals_the_request_run_alone(server, reference, tf_with_ops):
    tf = tf_with_ops
    requests = _mixed_requests(np.random.default_rng(11))
    answers = [None] * len(requests)
    with grpc.insecure_channel(server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)

        def call(i):
            signature, inputs = requests[i]
            if i % 3 == 2:   # every third over REST (columnar "inputs")
                body = json.dumps({"signature_name": signature,
                                   "inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
                with urllib.request.urlopen(server.rest_url + "/v1/models/pkm:predict", body, timeout=60) as r:
                    outputs = json.loads(r.read())["outputs"]
                answers[i] = {k: np.asarray(v) for k, v in (outputs if isinstance(outputs, dict)
                                                              else {"output": outputs}).items()}
            else:
                resp = stub.Predict(_request(tf, signature, inputs), timeout=60)
                answers[i] = {k: tf.make_ndarray(v) for k, v in resp.outputs.items()}

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    for (signature, inputs), got in zip(requests, answers):
        want = reference[signature](**{k: tf.constant(v) for k, v in inputs.items()})
        assert got is not None and set(got) == set(want)
        for k in want:
            assert got[k].shape == tuple(want[k].shape), (signature, k)
            np.testing.assert_allclose(got[k], want[k].numpy(), rtol=1e-5, atol=1e-6)


def test_request_larger_than_max_batch_size_is_refused(server, tf_with_ops):
    """shared_batch_scheduler.h: "Task size N is larger than maximum input batch size M"
    (INVALID_ARGUMENT, HTTP 400). It used to run alone, past the bound max_batch_size sets."""
    query = np.zeros((MAX_BATCH + 1, 32), np.float32)
    with grpc.insecure_channel(server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(_request(tf_with_ops, "serving_default", {"query": query}), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"Task size {MAX_BATCH + 1} is larger than maximum input batch size {MAX_BATCH}"
        stub.Predict(_request(tf_with_ops, "serving_default", {"query": query[:MAX_BATCH]}), timeout=30)
    body = json.dumps({"inputs": {"query": query.tolist()}}).encode()
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(server.rest_url + "/v1/models/pkm:predict", body, timeout=30)
    assert http.value.code == 400
    assert "Task size 5 is larger than maximum input batch size 4" in json.loads(http.value.read())["error"]


def test_output_filters_of_batch_mates_stay_their_own(server, reference, tf_with_ops):
    """Requests merged into one run with different output_filters: each answer holds exactly
    the outputs its request named (all of them without a filter), with its own rows."""
    tf = tf_with_ops
    rng = np.random.default_rng(12)
    filters = [("slots",), ("output",), (), ("output", "slots")] * 2
    queries = [rng.standard_normal((1 + i % 2, 32)).astype(np.float32) for i in range(len(filters))]
    answers = [None] * len(filters)
    with grpc.insecure_channel(server.target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)

        def call(i):
            req = _request(tf, "serving_default", {"query": queries[i]})
            req.output_filter.extend(filters[i])
            answers[i] = stub.Predict(req, timeout=60)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(filters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    for names, query, resp in zip(filters, queries, answers):
        want = reference["serving_default"](query=tf.constant(query))
        assert set(resp.outputs) == set(names or want)
        for k in resp.outputs:
            np.testing.assert_allclose(tf.make_ndarray(resp.outputs[k]), want[k].numpy(), rtol=1e-5, atol=1e-6)
