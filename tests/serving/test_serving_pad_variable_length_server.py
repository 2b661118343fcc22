"""pad_variable_length_inputs served, driven by a gRPC and a REST client at once: two
lookup requests with bags of different lengths run as one batch, each padded (before the
merge) to the longest with its own first id and first weight, as TF Serving's
batching_util.cc AddPadding does; outputs are split along dimension 0 only. The reference
is the SavedModel run in-process on each request padded by numpy."""
import json
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import start_batching_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("pad_variable_length")
    # Two one-row requests fill a batch; the long timeout makes the first wait for the second.
    srv = start_batching_server(
        tmp, saved_models,
        "max_batch_size { value: 2 } batch_timeout_micros { value: 20000000 } "
        "num_batch_threads { value: 1 } pad_variable_length_inputs: true\n")
    yield srv
    srv.terminate()


def _grpc_lookup(server, tf, inputs):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.model_spec.signature_name = "lookup"
    for k, v in inputs.items():
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    with grpc.insecure_channel(server.target) as ch:
        resp = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=60)
    return tf.make_ndarray(resp.outputs["output"])


def _rest_lookup(server, inputs):
    body = json.dumps({"signature_name": "lookup", "inputs": {k: v.tolist() for k, v in inputs.items()}}).encode()
    with urllib.request.urlopen(server.rest_url + "/v1/models/pkm:predict", body, timeout=60) as r:
        return np.asarray(json.loads(r.read())["outputs"])


def _padded(value, length):
    return np.pad(value, [(0, 0), (0, length - value.shape[1])], constant_values=value.flat[0])


def test_bags_of_different_lengths_are_padded_with_their_first_element(server, saved_models, tf_with_ops):
    tf = tf_with_ops
    rng = np.random.default_rng(9)
    short = {"indices": rng.integers(0, 64 * 64, (1, 3)).astype(np.int64),
             "weights": rng.random((1, 3)).astype(np.float32)}
    long = {"indices": rng.integers(0, 64 * 64, (1, 6)).astype(np.int64),
            "weights": rng.random((1, 6)).astype(np.float32)}
    answers = {}
    threads = [threading.Thread(target=lambda: answers.update(short=_grpc_lookup(server, tf, short))),
               threading.Thread(target=lambda: answers.update(long=_rest_lookup(server, long)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    lookup = tf.saved_model.load(saved_models[2]).signatures["lookup"]

    def reference(inputs):
        return lookup(**{k: tf.constant(_padded(v, 6)) for k, v in inputs.items()})["output"].numpy()
    np.testing.assert_allclose(answers["short"], reference(short), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(answers["long"], reference(long), rtol=1e-5, atol=1e-6)
    # The padding changed the short bag's answer (its first id counted four more times).
    alone = lookup(**{k: tf.constant(v) for k, v in short.items()})["output"].numpy()
    assert not np.allclose(answers["short"], alone)
