"""--enable_per_model_batching_parameters (TF Serving's bundle_factory_util.cc): a version
is batched with the BatchingParameters of batching_params.pbtxt in its own directory, a
version without one is not batched, and --batching_parameters_file gives only the batch
threads. Answers are checked against the SavedModel run alone in-process."""
import json
import shutil
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import ServerProcess

from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.loader import per_model_batch_options

GLOBAL_MAX, OWN_MAX = 4, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("per_model_batching")
    for model in ("own", "none"):
        shutil.copytree(saved_models[2], tmp / model / "1")
    (tmp / "own" / "1" / "batching_params.pbtxt").write_text(
        f"max_batch_size {{ value: {OWN_MAX} }} enable_large_batch_splitting {{ value: true }}\n"
        "max_execution_batch_size { value: 5 } batch_timeout_micros { value: 1000 }\n")
    (tmp / "batching.config").write_text(f"max_batch_size {{ value: {GLOBAL_MAX} }} num_batch_threads {{ value: 2 }}")
    (tmp / "models.config").write_text("model_config_list { " + " ".join(
        f'config {{ name: "{m}" base_path: "{tmp / m}" model_platform: "tensorflow" }}'
        for m in ("own", "none")) + " }")
    srv = ServerProcess(tmp, f"--model_config_file={tmp / 'models.config'}",
                        "--file_system_poll_wait_seconds=0", "--enable_batching",
                        f"--batching_parameters_file={tmp / 'batching.config'}",
                        "--enable_per_model_batching_parameters")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def reference(saved_models, tf_with_ops):
    return tf_with_ops.saved_model.load(saved_models[2]).signatures["serving_default"]


def _grpc_predict(server, tf, model, query):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.inputs["query"].CopyFrom(tf.make_tensor_proto(query))
    with grpc.insecure_channel(server.target) as ch:
        resp = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=60)
    return {k: tf.make_ndarray(v) for k, v in resp.outputs.items()}


def _rest_predict(server, model, query):
    body = json.dumps({"inputs": {"query": query.tolist()}}).encode()
    with urllib.request.urlopen(f"{server.rest_url}/v1/models/{model}:predict", body, timeout=60) as r:
        return {k: np.asarray(v) for k, v in json.loads(r.read())["outputs"].items()}


def _assert_same(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["own", "none"])
def test_each_version_batches_by_its_own_file_or_not_at_all(server, reference, tf_with_ops, model):
    """Both take 12 rows, past the global max_batch_size (4): "own" through its own
    max_batch_size (16, split into runs of 5), "none" because it is not batched."""
    query = np.random.default_rng(5).standard_normal((12, 32)).astype(np.float32)
    want = reference(query=tf_with_ops.constant(query))
    _assert_same(_grpc_predict(server, tf_with_ops, model, query), want)
    _assert_same(_rest_predict(server, model, query), want)


def test_own_max_batch_size_bounds_a_request(server, tf_with_ops):
    query = np.zeros((OWN_MAX + 1, 32), np.float32)
    with pytest.raises(grpc.RpcError) as err:
        _grpc_predict(server, tf_with_ops, "own", query)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"Task size {OWN_MAX + 1} is larger than maximum input batch size {OWN_MAX}"
    with pytest.raises(urllib.error.HTTPError) as http:
        _rest_predict(server, "own", query)
    assert http.value.code == 400


@pytest.mark.parametrize("text, needle", [
    ("max_batch_size { value: 8 } no_such_field: 1", 'has no field named "no_such_field"'),
    ("max_batch_size { value: 8 } allowed_batch_sizes: 4",
     "Last entry in allowed_batch_sizes must match max_batch_size; last entry was 4; expected 8"),
])
def test_a_bad_file_fails_the_load_naming_it(tmp_path, text, needle):
    (tmp_path / "batching_params.pbtxt").write_text(text)
    with pytest.raises(ServingError) as err:
        per_model_batch_options(str(tmp_path))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "batching_params.pbtxt" in err.value.message and needle in err.value.message


def test_no_file_means_not_batched(tmp_path):
    assert per_model_batch_options(str(tmp_path)) is None
