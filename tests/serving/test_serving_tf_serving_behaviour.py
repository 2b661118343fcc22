"""`pkm-serve serve` against what TF Serving itself asserts, case by case.

Written from TF Serving's documents, against half_plus_two-style models (y = 0.5x + 2;
half_plus_two.py): its end-to-end test
tensorflow_serving/model_servers/tensorflow_model_server_test.py (cited as "server_test"),
its REST API document g3doc/api_rest.md ("api_rest.md") and its REST handler test
tensorflow_serving/model_servers/http_rest_api_handler_test.cc ("handler_test"). Each test
names the case it mirrors. The server is started the way server_test's harness starts
tensorflow_model_server: a model config file, --grpc_socket_path and
--grpc_channel_arguments on every start.
"""
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)

from tensorflow.core.framework import types_pb2

import half_plus_two as hpt
from serving_helpers import ServerProcess

State = get_model_status_pb2.ModelVersionStatus.State
# A channel argument that is observable: requests over 1 MiB are refused by the server.
SMALL_RECEIVE_LIMIT = 1 << 20


def _config_text(models):
    return "model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" }}\n'
        for name, path in models.items()) + "}\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory, tf_with_ops):
    root = tmp_path_factory.mktemp("hpt")
    hpt.write_versioned(str(root / "tf1"), 1, hpt.write_tf1)
    hpt.write_versioned(str(root / "tf2"), 123, hpt.write_tf2)
    hpt.write_versioned(str(root / "late"), 1, hpt.write_tf2, scale=3.0)   # y = 3x + 2
    (root / "empty").mkdir()
    return root


@pytest.fixture(scope="module")
def server(models):
    config = models / "models.config"
    config.write_text(_config_text({"half_plus_two": models / "tf1", "half_plus_two_tf2": models / "tf2"}))
    sock_dir = tempfile.mkdtemp(prefix="pkm-sock-", dir="/tmp")   # sun_path holds 107 bytes
    socket_path = os.path.join(sock_dir, "grpc.sock")
    srv = ServerProcess(models, f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=1",
                        "--file_system_poll_wait_seconds=1", f"--grpc_socket_path={socket_path}",
                        f"--grpc_channel_arguments=grpc.max_receive_message_length={SMALL_RECEIVE_LIMIT},"
                        "grpc.http2.max_pings_without_data=0")
    srv.config_path, srv.socket_path = config, socket_path
    yield srv
    rc = srv.terminate()
    shutil.rmtree(sock_dir, ignore_errors=True)
    assert rc == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield prediction_service_pb2_grpc.PredictionServiceStub(ch)


def _predict(stub, model, x, shape, signature=""):
    import tensorflow as tf
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.model_spec.signature_name = signature
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(x, dtype=tf.float32, shape=shape))
    return stub.Predict(req, timeout=30)


def _example_input(input_proto, xs):
    for x in xs:
        input_proto.example_list.examples.add().features.feature["x"].float_list.value.append(x)


def _rest(server, path, body=None, method=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.rest_url + path, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ------------------------------------------------------------------ gRPC Predict
@pytest.mark.parametrize("model, version", [("half_plus_two", 1), ("half_plus_two_tf2", 123)])
def test_predict_answer_in_float_val(stub, model, version):
    """server_test VerifyPredictRequest (testPredict...): x = float_val [2.0] of shape [1],
    output_filter ['y']; the client reads result.outputs['y'].float_val (TF Serving fills
    the typed field, not tensor_content) and the model spec it was answered with."""
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.inputs["x"].dtype = types_pb2.DT_FLOAT
    req.inputs["x"].float_val.append(2.0)
    req.inputs["x"].tensor_shape.dim.add().size = 1
    req.output_filter.append("y")
    resp = stub.Predict(req, timeout=30)
    assert resp.outputs["y"].dtype == types_pb2.DT_FLOAT
    assert list(resp.outputs["y"].float_val) == [3.0]
    assert resp.outputs["y"].tensor_content == b""
    assert (resp.model_spec.name, resp.model_spec.version.value,
            resp.model_spec.signature_name) == (model, version, "serving_default")


@pytest.mark.parametrize("shape", [[1], [2, 3, 4], [2, 2]])
def test_predict_any_input_shape_the_graph_accepts(stub, shape):
    """server_test feeds x of shape [1] (and the doc [[1, 2], [3, 4]]) to signatures that
    declare x [-1, 1]: TF Serving does not check the declared shape, the graph decides."""
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    for model in ("half_plus_two", "half_plus_two_tf2"):
        resp = _predict(stub, model, x, shape)
        got = np.array(resp.outputs["y"].float_val, np.float64).reshape(
            [d.size for d in resp.outputs["y"].tensor_shape.dim])
        np.testing.assert_allclose(got, hpt.half_plus_two(x.astype(np.float64)), rtol=1e-7)


def test_predict_unknown_signature_is_failed_precondition(stub):
    """predict_util.cc (what server_test's bad-signature cases see): FAILED_PRECONDITION, in its
    words (REST's, 'Serving signature name: "nosuch" not found in signature def', were given)."""
    with pytest.raises(grpc.RpcError) as err:
        _predict(stub, "half_plus_two", [2.0], [1], signature="nosuch")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith('Serving signature key "nosuch" not found.')


def test_predict_over_unix_socket(server):
    """server_test testPredictUDS: the same Predict over --grpc_socket_path."""
    with grpc.insecure_channel(f"unix:{server.socket_path}") as ch:
        resp = _predict(prediction_service_pb2_grpc.PredictionServiceStub(ch), "half_plus_two", [2.0], [1])
    assert list(resp.outputs["y"].float_val) == [3.0]


def test_grpc_channel_arguments_reach_the_server(stub):
    """--grpc_channel_arguments (server_test passes it on every start) is applied: the
    receive limit it sets refuses a larger request."""
    with pytest.raises(grpc.RpcError) as err:
        _predict(stub, "half_plus_two", np.zeros(SMALL_RECEIVE_LIMIT // 4 + 16, np.float32),
                 [SMALL_RECEIVE_LIMIT // 4 + 16])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------------------------ Classify / Regress / MultiInference
@pytest.mark.parametrize("model", ["half_plus_two", "half_plus_two_tf2"])
def test_classify_and_regress_on_tf1_and_tf2_signatures(stub, model):
    """server_test testClassify / testRegress, for both flavours: the TF2 signatures have
    method_name .../predict, which TF Serving does not check by default."""
    creq = classification_pb2.ClassificationRequest()
    creq.model_spec.name, creq.model_spec.signature_name = model, "classify_x_to_y"
    _example_input(creq.input, [2.0, 4.0])
    cresp = stub.Classify(creq, timeout=30)
    assert [[c.score for c in cl.classes] for cl in cresp.result.classifications] == [[3.0], [4.0]]
    rreq = regression_pb2.RegressionRequest()
    rreq.model_spec.name, rreq.model_spec.signature_name = model, "regress_x_to_y"
    _example_input(rreq.input, [2.0, 4.0])
    rresp = stub.Regress(rreq, timeout=30)
    assert [r.value for r in rresp.result.regressions] == [3.0, 4.0]
    assert rresp.model_spec.signature_name == "regress_x_to_y"


def _multi_inference_request(model):
    req = inference_pb2.MultiInferenceRequest()
    for method, sig in (("tensorflow/serving/regress", "regress_x_to_y"),
                        ("tensorflow/serving/classify", "classify_x_to_y")):
        task = req.tasks.add(method_name=method)
        task.model_spec.name, task.model_spec.signature_name = model, sig
    _example_input(req.input, [2.0])
    return req


def test_multi_inference(stub):
    """server_test testMultiInference (on the TF1 half_plus_two): a regress and a classify
    task on one input, both signatures reading the same tf.Example tensor."""
    resp = stub.MultiInference(_multi_inference_request("half_plus_two"), timeout=30)
    assert resp.results[0].regression_result.regressions[0].value == 3.0
    assert resp.results[1].classification_result.classifications[0].classes[0].score == 3.0


def test_multi_inference_refuses_signatures_reading_different_tensors(stub):
    """multi_inference.cc feeds the examples to one tensor: signatures whose input TensorInfo
    names differ (tf.saved_model.save gives each signature its own placeholder, as in the
    TF2 half_plus_two) are refused: "Input tensor must be the same for all Signatures."."""
    with pytest.raises(grpc.RpcError) as err:
        stub.MultiInference(_multi_inference_request("half_plus_two_tf2"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("Input tensor must be the same for all Signatures.")


def test_multi_inference_refuses_a_signature_evaluated_twice(stub):
    """multi_inference.cc: 'Duplicate evaluation of signature: NAME' (it ran both)."""
    req = inference_pb2.MultiInferenceRequest()
    for _ in range(2):
        task = req.tasks.add(method_name="tensorflow/serving/regress")
        task.model_spec.name, task.model_spec.signature_name = "half_plus_two", "regress_x_to_y"
    _example_input(req.input, [2.0])
    with pytest.raises(grpc.RpcError) as err:
        stub.MultiInference(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Duplicate evaluation of signature: regress_x_to_y" in err.value.details()


# ------------------------------------------------------------------ ModelService
def test_get_model_status_carries_ok_status(server):
    """server_test testGetModelStatus: version, AVAILABLE, status error_code OK and an
    empty message."""
    with grpc.insecure_channel(server.target) as ch:
        resp = model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "half_plus_two"}), timeout=30)
    (s,) = resp.model_version_status
    assert (s.version, s.state, s.status.error_code, s.status.error_message) == (1, State.AVAILABLE, 0, "")


def test_get_model_metadata(stub):
    """server_test testGetModelMetadata: the signature_def map of the version. A TF2 model's
    map holds every SignatureDef, __saved_model_init_op included, as TF Serving's testdata
    saved_model_half_plus_two_tf2_2_versions_metadata.json shows."""
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = "half_plus_two_tf2"
    resp = stub.GetModelMetadata(req, timeout=30)
    sig_map = get_model_metadata_pb2.SignatureDefMap()
    resp.metadata["signature_def"].Unpack(sig_map)
    assert sorted(sig_map.signature_def) == ["__saved_model_init_op", "classify_x_to_y", "regress_x_to_y",
                                             "serving_default"]
    assert resp.model_spec.version.value == 123


def test_rest_tf2_metadata_lists_the_init_op_signature(server):
    """servables/tensorflow/testdata/saved_model_half_plus_two_tf2_2_versions_metadata.json
    (http_rest_api_handler_test GetModelMetadata): the __saved_model_init_op entry exactly."""
    status, body = _rest(server, "/v1/models/half_plus_two_tf2/metadata")
    assert status == 200, body
    init = body["metadata"]["signature_def"]["signature_def"]["__saved_model_init_op"]
    assert (init["inputs"], init["method_name"]) == ({}, "")
    assert init["outputs"] == {"__saved_model_init_op": {
        "dtype": "DT_INVALID", "tensor_shape": {"dim": [], "unknown_rank": True}, "name": "NoOp"}}


@pytest.mark.parametrize("method", ["Classify", "Regress"])
def test_classify_and_regress_on_a_bad_signature_are_invalid_argument(stub, method):
    """servables/tensorflow/classifier.cc (and regressor.cc) GetClassificationSignatureDef:
    a signature name the model lacks is InvalidArgument "No signature was found with the
    name: ..." (Predict's predict_util.cc answers FAILED_PRECONDITION instead)."""
    req = (classification_pb2.ClassificationRequest() if method == "Classify"
           else regression_pb2.RegressionRequest())
    req.model_spec.name, req.model_spec.signature_name = "half_plus_two", "nosuch"
    _example_input(req.input, [2.0])
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, method)(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("No signature was found with the name: nosuch")


@pytest.mark.parametrize("body", [{"signature_name": 100},
                                  {"signature_name": ["x"], "instances": "not a list", "bogus": 1}])
def test_rest_signature_name_type_is_checked_first(server, body):
    """handler_test PredictRequestErrors "Incorrect signature_name type": {"signature_name":
    100} (no instances/inputs at all) is InvalidArgument "'signature_name' key must be a
    string value." -- the type is checked before any other field."""
    status, resp = _rest(server, "/v1/models/half_plus_two:predict", body)
    assert status == 400
    assert "'signature_name' key must be a string value." in resp["error"]


def test_bad_model_config_error_text(tmp_path):
    """server_test testBadModelConfig: the server fails to start and its stderr holds
    "Error parsing text-format tensorflow.serving.ModelServerConfig"."""
    import subprocess
    import sys
    from serving_helpers import REPO
    bad = tmp_path / "bad_model_config.txt"
    bad.write_text("improperly formatted file\n")
    proc = subprocess.run([sys.executable, "-m", "pkm_serve.serving", f"--model_config_file={bad}",
                           "--port=0", "--rest_api_port=1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2
    assert "Error parsing text-format tensorflow.serving.ModelServerConfig" in proc.stderr


# ------------------------------------------------------------------ REST (api_rest.md)
def test_rest_model_status_json(server):
    """api_rest.md "Model status API": the exact response body."""
    status, body = _rest(server, "/v1/models/half_plus_two")
    assert status == 200
    assert body == {"model_version_status": [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}


def test_rest_metadata_prints_default_fields(server):
    """api_rest.md "Model Metadata API": TF Serving prints default-valued fields
    (model_spec.signature_name, tensor dim names, unknown_rank)."""
    status, body = _rest(server, "/v1/models/half_plus_two_tf2/versions/123/metadata")
    assert status == 200, body
    assert body["model_spec"] == {"name": "half_plus_two_tf2", "signature_name": "", "version": "123"}
    x = body["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["x"]
    assert x["dtype"] == "DT_FLOAT"
    assert x["tensor_shape"] == {"dim": [{"size": "-1", "name": ""}, {"size": "1", "name": ""}],
                                 "unknown_rank": False}


def test_rest_predict_row_and_columnar(server):
    """api_rest.md "Predict API" / server_test testPredictRest: instances [1, 2, 5] of
    half_plus_two answer predictions [2.5, 3.0, 4.5]; the columnar form answers outputs."""
    status, body = _rest(server, "/v1/models/half_plus_two:predict", {"instances": [1.0, 2.0, 5.0]})
    assert (status, body) == (200, {"predictions": [2.5, 3.0, 4.5]})
    status, body = _rest(server, "/v1/models/half_plus_two_tf2:predict", {"inputs": {"x": [[1.0], [2.0]]}})
    assert (status, body) == (200, {"outputs": [[2.5], [3.0]]})


def test_rest_classify_and_regress_answer_results(server):
    """api_rest.md "Classify and Regress API": the response key is "results"."""
    body = {"signature_name": "classify_x_to_y", "examples": [{"x": 1.0}, {"x": 2.0}]}
    assert _rest(server, "/v1/models/half_plus_two_tf2:classify", body) == \
        (200, {"results": [[["", 2.5]], [["", 3.0]]]})
    body = {"signature_name": "regress_x_to_y", "examples": [{"x": 1.0}, {"x": 2.0}]}
    assert _rest(server, "/v1/models/half_plus_two:regress", body) == (200, {"results": [2.5, 3.0]})


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/models/half_plus_two/versions/HELLO:predict"),             # handler_test: bad version
    ("POST", "/v1/models/half_plus_two/versions/1/labels/stable:predict"),   # handler_test: version and label
    ("POST", "/v1/models/half_plus_two:explode"),                            # handler_test: unknown verb
])
def test_rest_malformed_urls_are_400(server, method, path):
    """handler_test (MalformedUrls): every malformed /v1/ URL is InvalidArgument -> 400."""
    status, body = _rest(server, path, {} if method == "POST" else None, method=method)
    assert status == 400, body
    assert body["error"].startswith(f"Malformed request: {method} {path}")


def test_rest_b64_for_a_numeric_input_says_so(server):
    """api_rest.md "Encoding binary values": b64 is for string inputs; a numeric input given
    one gets json_tensor.cc's type error, naming the object and the type expected."""
    status, body = _rest(server, "/v1/models/half_plus_two_tf2:predict", {"instances": [{"b64": "AAAAAA=="}]})
    assert status == 400
    assert 'JSON Value: {"b64":"AAAAAA=="} Type: Object is not of expected type: float' in body["error"]


# ------------------------------------------------------------------ config reload at any moment
def _status(server, name):
    with grpc.insecure_channel(server.target) as ch:
        return model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": name}), timeout=10)


def _wait_for(predicate, seconds=30):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _has_version_available(server, name):
    try:
        return any(s.state == State.AVAILABLE for s in _status(server, name).model_version_status)
    except grpc.RpcError:
        return False


def _not_served(stub, name):
    """Predict is NOT_FOUND (its status, as TF Serving's, then reports the versions END)."""
    try:
        _predict(stub, name, [2.0], [1, 1])
        return False
    except grpc.RpcError as e:
        return e.code() == grpc.StatusCode.NOT_FOUND


def test_config_file_change_at_any_moment_is_applied(server, models, stub):
    """server_test's model-config-reload cases: TF Serving re-reads the config file on every
    poll. This module's first test ran right after start-up; here the file changes twice
    within one poll period and then again: the last content is what gets served."""
    both = {"half_plus_two": models / "tf1", "half_plus_two_tf2": models / "tf2"}
    server.config_path.write_text(_config_text({**both, "late": models / "empty"}))
    server.config_path.write_text(_config_text({**both, "late": models / "late"}))   # same second
    assert _wait_for(lambda: _has_version_available(server, "late")), server.log()[-3000:]
    assert list(_predict(stub, "late", [2.0], [1, 1]).outputs["y"].float_val) == [8.0]
    server.config_path.write_text(_config_text(both))
    assert _wait_for(lambda: _not_served(stub, "late")), server.log()[-3000:]
    ended = [(1, get_model_status_pb2.ModelVersionStatus.END)]   # once the unload is done
    assert _wait_for(lambda: [(v.version, v.state) for v in _status(server, "late").model_version_status] == ended)
    assert list(_predict(stub, "half_plus_two", [2.0], [1]).outputs["y"].float_val) == [3.0]


@pytest.fixture(scope="module")
def early_server(models, tmp_path_factory):
    """A second server (gRPC only, --enable_serialization_as_tensor_content) whose config file is
    rewritten right after start-up, before its first poll (2 s): model "late" is added."""
    tmp = tmp_path_factory.mktemp("early")
    config = tmp / "models.config"
    config.write_text(_config_text({"half_plus_two": models / "tf1"}))
    srv = ServerProcess(tmp, f"--model_config_file={config}", "--model_config_file_poll_wait_seconds=2",
                        "--file_system_poll_wait_seconds=0", "--enable_serialization_as_tensor_content",
                        rest=False, name="early")
    try:
        config.write_text(_config_text({"half_plus_two": models / "tf1", "late": models / "late"}))
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log()[-3000:]


def test_config_written_before_the_first_poll_is_applied(early_server):
    """A change written between start-up and the first poll (the window in which the file
    was once never re-read) is applied."""
    assert _wait_for(lambda: _has_version_available(early_server, "late"), 20), early_server.log()[-3000:]


def test_tensor_content_flag(early_server):
    """--enable_serialization_as_tensor_content answers in tensor_content. (A base path
    without numeric versions: test_serving_load_retries.py, the start waits for one.)"""
    with grpc.insecure_channel(early_server.target) as ch:
        resp = _predict(prediction_service_pb2_grpc.PredictionServiceStub(ch), "half_plus_two",
                        [2.0, 4.0], [2])
    assert list(resp.outputs["y"].float_val) == []
    np.testing.assert_array_equal(np.frombuffer(resp.outputs["y"].tensor_content, "<f4"), [3.0, 4.0])
