"""Round 36 parity checks against tensorflow_model_server, on one server with real clients
(requests for REST, the tensorflow-serving-api gRPC stubs):
- a REST URL is matched with its query string, as TF Serving's handler matches
  EvHTTPRequest::uri_path (tensorflow_serving/util/net_http/server/internal/evhttp_request.cc
  builds it as path_and_query; model_servers/http_rest_api_util.cc's patterns must match it
  whole): "?x=1" after a verb or "/metadata" makes the URL malformed, after a model name it is
  part of the name (the query was dropped here, so such URLs were served);
- REST predict on a signature without inputs is refused, as json_tensor.cc's
  FillPredictRequestFromJson refuses it ("Failed to get input map for signature: S"; it was
  run here), before the body's keys are looked at;
- REST predict, classify and regress bodies are checked in json_tensor.cc's order and words
  (missing or both "instances"/"inputs", an empty or non-list "instances", a plain list for
  several inputs, a missing named input, "examples" missing, empty or not a list, an example
  that is not an object; the words were this server's own);
- Classify and Regress check the signature as classifier.cc's PreProcessClassification and
  regressor.cc's PreProcessRegression do: the one input must be keyed "inputs", a
  classification signature has one or two outputs, a regression one exactly one (another key
  and more outputs were accepted here);
- an absolute-form request target (http://host/v1/...) is read by its path and query, as
  evhttp_uri_parse reads it (it was a 404)."""
import grpc
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import (classification_pb2, predict_pb2, prediction_service_pb2_grpc,
                                     regression_pb2)

from serving_helpers import ServerProcess, save_graph


def _save_model(path):
    """serving_default: x [n, 2] -> y = 2x; "noin": no inputs -> c = [1, 2]; classify and
    regress signatures over serialized tf.Examples (feature x, two floats) with other input
    keys or more outputs than TF Serving takes."""
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        serialized = v1.placeholder(tf.string, [None], name="tf_example")
        parsed = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32)})["x"]
        scores = tf.nn.softmax(parsed)
        classes = tf.tile(tf.constant([["a", "b"]]), [tf.shape(parsed)[0], 1])
        info = v1.saved_model.build_tensor_info
        ex = {"inputs": info(serialized)}

        def sig(inputs, outputs, method):
            return v1.saved_model.build_signature_def(inputs, {k: info(v) for k, v in outputs.items()},
                                                      f"tensorflow/serving/{method}")
        save_graph(path, {
            "serving_default": sig({"x": info(x)}, {"y": 2.0 * x}, "predict"),
            "noin": sig({}, {"c": tf.constant([1.0, 2.0])}, "predict"),
            "cls": sig(ex, {"classes": classes, "scores": scores}, "classify"),
            "cls_scores_and_other": sig(ex, {"scores": scores, "other": parsed}, "classify"),
            "cls_other_input_key": sig({"examples": info(serialized)}, {"scores": scores}, "classify"),
            "cls_three_outputs": sig(ex, {"classes": classes, "scores": scores, "other": parsed}, "classify"),
            "reg_other_input_key": sig({"examples": info(serialized)}, {"outputs": parsed[:, 0]}, "regress"),
            "reg_two_outputs": sig(ex, {"outputs": parsed[:, 0], "other": parsed}, "regress")})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity36")
    _save_model(str(tmp / "m" / "1"))
    srv = ServerProcess(tmp, "--model_name=m", f"--model_base_path={tmp / 'm'}", "--file_system_poll_wait_seconds=0")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield prediction_service_pb2_grpc.PredictionServiceStub(ch)


def _error(response):
    return response.status_code, response.json()["error"]


def test_a_query_string_is_matched_as_part_of_the_url(server):
    url = server.rest_url + "/v1/models/m"
    assert requests.get(url, timeout=30).status_code == 200
    # After the name: part of the name, a model that does not exist.
    assert _error(requests.get(url, params={"x": 1}, timeout=30)) == (
        404, "Could not find any versions of model m?x=1")
    for r in (requests.get(url + "/metadata", params={"x": 1}, timeout=30),
              requests.get(url + "/versions/1", params={"x": 1}, timeout=30),
              requests.post(url + ":predict", params={"foo": ""}, json={"instances": [[1.0, 2.0]]}, timeout=30)):
        code, message = _error(r)
        assert code == 400 and message.startswith(f"Malformed request: {r.request.method} /v1/models/m"), message
        assert "?x=1" in message or "?foo=" in message, message
    ok = requests.post(url + ":predict", json={"instances": [[1.0, 2.0]]}, timeout=30)
    assert ok.status_code == 200 and ok.json() == {"predictions": [[2.0, 4.0]]}


@pytest.mark.parametrize("body", [{"signature_name": "noin", "inputs": {}},
                                  {"signature_name": "noin", "instances": [{}]},
                                  {"signature_name": "noin"}])
def test_rest_predict_refuses_a_signature_without_inputs(server, stub, body):
    code, message = _error(requests.post(server.rest_url + "/v1/models/m:predict", json=body, timeout=30))
    assert code == 400 and message.startswith("Failed to get input map for signature: noin"), message
    # gRPC Predict runs it (predict_util.cc has no such check): zero inputs sent, zero expected.
    req = predict_pb2.PredictRequest()
    req.model_spec.name, req.model_spec.signature_name = "m", "noin"
    import tensorflow as tf
    np.testing.assert_array_equal(tf.make_ndarray(stub.Predict(req, timeout=30).outputs["c"]), [1.0, 2.0])


@pytest.mark.parametrize("body, message", [
    ({}, "Missing 'inputs' or 'instances' key"),
    ({"signature_name": "serving_default"}, "Missing 'inputs' or 'instances' key"),
    ({"instances": [[1.0, 2.0]], "inputs": [[1.0, 2.0]]},
     "Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist "),
    ({"instances": {"x": [1.0, 2.0]}}, "Excepting 'instances' to be an list/array"),
    ({"instances": []}, "No values in 'instances' array"),
    ({"instances": [{"x": [1.0, 2.0]}, [1.0, 2.0]]}, "Expecting object but got list at item 1 of input list"),
    ({"instances": [[1.0, 2.0], {"x": [1.0, 2.0]}]},
     "Expecting value/list but got object at item 1 of input list"),
    ({"instances": [{"x": [1.0, 2.0], "z": 1}]}, "Failed to process element: 0 key: z of 'instances' list. "
                                                 "Error: INVALID_ARGUMENT: JSON object: does not have named input: z"),
    ({"inputs": {"z": [[1.0, 2.0]]}}, "Missing named input: x in 'inputs' object."),
])
def test_predict_body_faults_in_json_tensor_words(server, body, message):
    code, got = _error(requests.post(server.rest_url + "/v1/models/m:predict", json=body, timeout=30))
    assert code == 400 and message in got, got


def test_a_body_that_is_not_an_object(server):
    code, got = _error(requests.post(server.rest_url + "/v1/models/m:predict", data=b"[1, 2]", timeout=30))
    assert (code, got) == (400, "JSON Value: [1,2] Is not object")


@pytest.mark.parametrize("verb", ["classify", "regress"])
@pytest.mark.parametrize("body, message", [
    ({}, "When method is classify, key 'examples' is expected and was not found"),
    ({"examples": {"x": [1.0, 2.0]}}, "Expecting 'examples' value to be an list/array"),
    ({"examples": []}, "'examples' value is an empty array"),
    ({"examples": ["x"]}, "Example must be JSON object but got JSON String"),
    ({"examples": [{"x": [1.0, 2.0]}], "context": [1]}, "Example must be JSON object but got JSON Array"),
    ({"examples": [{"x": [[1.0, 2.0]]}]}, "Feature: x has element with unexpected JSON type: Array"),
    ({"examples": [{"x": None}]}, "Feature: x has element with unexpected JSON type: Null"),
])
def test_example_body_faults_in_json_tensor_words(server, verb, body, message):
    signature = {"classify": "cls", "regress": "reg_two_outputs"}[verb]
    code, got = _error(requests.post(server.rest_url + f"/v1/models/m:{verb}",
                                     json={"signature_name": signature, **body}, timeout=30))
    assert code == 400 and message in got, got


def _examples(request, signature):
    import tensorflow as tf
    request.model_spec.name, request.model_spec.signature_name = "m", signature
    request.input.example_list.examples.add().CopyFrom(tf.train.Example(features=tf.train.Features(
        feature={"x": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0, 2.0]))})))
    return request


@pytest.mark.parametrize("call, signature, message", [
    ("Classify", "cls_other_input_key", "No classification inputs found in SignatureDef: inputs {"),
    ("Classify", "cls_three_outputs", "Expected one or two output Tensors, found 3"),
    ("Regress", "reg_other_input_key", "No regression inputs found in SignatureDef: inputs {"),
    ("Regress", "reg_two_outputs", "Expected one output Tensor."),
])
def test_example_signatures_are_checked_as_tf_serving_checks_them(server, stub, call, signature, message):
    request = _examples(classification_pb2.ClassificationRequest() if call == "Classify"
                        else regression_pb2.RegressionRequest(), signature)
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, call)(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(message), \
        err.value.details()
    code, got = _error(requests.post(server.rest_url + f"/v1/models/m:{call.lower()}", timeout=30,
                                     json={"signature_name": signature, "examples": [{"x": [1.0, 2.0]}]}))
    assert code == 400 and got.startswith(message), got


def test_a_classify_signature_with_scores_and_one_more_output_is_served(server, stub):
    """Two outputs of which one is "scores": PreProcessClassification takes it, reading scores only."""
    resp = stub.Classify(_examples(classification_pb2.ClassificationRequest(), "cls_scores_and_other"), timeout=30)
    want = np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum()
    got = [(c.label, c.score) for c in resp.result.classifications[0].classes]
    assert [label for label, _ in got] == ["", ""]
    np.testing.assert_allclose([score for _, score in got], want, rtol=1e-6)


def test_a_base64_first_instance_for_several_inputs_is_a_400():
    """json_tensor.cc lets a {"b64": ...} first instance past its plain-list check and reads it
    as the first input; here the check holds (it was a 500 ValueError once that check took
    json_tensor.cc's words)."""
    import tensorflow as tf

    from pkm_serve.serving.errors import ServingError
    from pkm_serve.serving.rest_requests import rows_to_inputs
    specs = {name: tf.TensorSpec([None], tf.string) for name in ("a", "b")}
    with pytest.raises(ServingError, match="instances is a plain list, but expecting list of objects"):
        rows_to_inputs([{"b64": "AA=="}], specs)


@pytest.mark.parametrize("path, code, message", [
    ("/v1/models/nope:predict", 404, "Servable not found for request: Latest(nope)"),
    ("/v1/models/nope/versions/3:predict", 404, "Servable not found for request: Specific(nope, 3)"),
    ("/v1/models/nope/labels/stable:predict", 400, "Unrecognized servable version label: stable")])
def test_a_model_not_configured_is_answered_as_server_core_answers(server, stub, path, code, message):
    """ServerCore::GetServableHandle (server_core.cc): a label is looked up in the model's
    labels first (GetModelVersionForLabel: INVALID_ARGUMENT, also for an unknown model), then
    the manager's NOT_FOUND names the request as Latest(M) / Specific(M, V). Both were a
    NOT_FOUND "model 'nope' is not served" here."""
    got_code, got = _error(requests.post(server.rest_url + path, json={"instances": [[1.0, 2.0]]}, timeout=30))
    assert got_code == code and got.startswith(message), got
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "nope"
    if "/versions/" in path:
        req.model_spec.version.value = 3
    elif "/labels/" in path:
        req.model_spec.version_label = "stable"
    import tensorflow as tf
    req.inputs["x"].CopyFrom(tf.make_tensor_proto([[1.0, 2.0]]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    want = grpc.StatusCode.INVALID_ARGUMENT if code == 400 else grpc.StatusCode.NOT_FOUND
    assert err.value.code() == want and err.value.details().startswith(message), err.value.details()


def test_an_empty_body_is_an_empty_document(server):
    code, got = _error(requests.post(server.rest_url + "/v1/models/m:predict", data=b"", timeout=30))
    assert (code, got) == (400, "JSON Parse error: The document is empty")   # json_tensor.cc's ParseJson


def test_every_grpc_code_maps_to_tf_servings_http_status():
    """http_server.cc's ToHTTPStatusCode, code by code (ABORTED was a 500 here, upstream 409)."""
    from pkm_serve.serving.errors import http_status
    upstream = {"OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
                "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429,
                "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501,
                "INTERNAL": 500, "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401}
    assert {code.name: http_status(code) for code in grpc.StatusCode} == upstream


@pytest.mark.parametrize("body, message", [
    ({"instances": [[1, 2], [3]]},
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting tensor size: 2 but got: 1"),
    ({"instances": [[[1, 2]], [[3], [4]]]},
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting shape [1,2] but got: [2,1]"),
    ({"instances": [{"x": [1, 2]}, {"x": [3]}]}, "Failed to process element: 1 key: x of 'instances' list. "
                                                 "Error: INVALID_ARGUMENT: Expecting tensor size: 2 but got: 1"),
    ({"instances": [[1, [2]]]}, "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: "
                                "Encountered list at unexpected level: 1 expected < 1"),
    ({"inputs": [[1, 2], [3]]}, "Encountered list at unexpected size: 1 at level: 1 expected size: 2"),
    ({"inputs": {"x": [[1, 2], 3]}}, "JSON Value: 3 found at incorrect level: 2 in the JSON DOM. Expected at level: 2"),
    ({"inputs": [1, [2, 3]]}, "Encountered list at unexpected level: 1 expected < 1"),
])
def test_ragged_values_are_refused_in_json_tensor_words(server, body, message):
    """json_tensor.cc's FillTensorProto (dense fill of the first elements' shape) and
    AddInstanceItem (each instance of the first one's size and shape); this server said
    "input 'x' is ragged: all rows must have the same shape" for all of them."""
    code, got = _error(requests.post(server.rest_url + "/v1/models/m:predict", json=body, timeout=30))
    assert code == 400 and got.startswith(message), got


def test_a_signature_name_not_a_string_shows_the_document(server):
    """json_tensor.cc's FormatSignatureError prints the document (it printed the name alone)."""
    code, got = _error(requests.post(server.rest_url + "/v1/models/m:predict", timeout=30,
                                     json={"signature_name": 5, "instances": [[1.0, 2.0]]}))
    assert (code, got) == (400, 'JSON Value: {"signature_name":5,"instances":[[1.0,2.0]]} not formatted '
                                "correctly. 'signature_name' key must be a string value.")


def test_a_removed_model_reports_its_versions_ended(tmp_path):
    """TF Serving's GetModelStatus reads ServableStateMonitor::GetVersionStates, which keeps a
    version's last state after its model leaves the config (servable_state_monitor.cc: states_
    is only added to): the status is END with OK, not NOT_FOUND (as it was here)."""
    from tensorflow_serving.apis import model_pb2
    from tensorflow_serving.config import model_server_config_pb2
    from test_serving_manager_fakes import Fakes
    from serving_helpers import polled_manager
    fakes = Fakes(tmp_path / "m")
    fakes.add_version(1)
    manager = polled_manager(fakes.base, loader_factory=fakes.factory)
    try:
        spec = model_pb2.ModelSpec(name="m")
        [live] = manager.status(spec)
        assert (live.version, live.state) == (1, live.State.AVAILABLE)
        none = model_server_config_pb2.ModelServerConfig()
        none.model_config_list.SetInParent()
        manager.apply_config(none)
        [ended] = manager.status(spec)
        assert (ended.version, ended.state, ended.status.error_code) == (1, ended.State.END, 0)
        with pytest.raises(Exception) as err:
            manager.status(model_pb2.ModelSpec(name="never_configured"))
        assert "Could not find any versions of model never_configured" in str(err.value)
    finally:
        manager.stop()


def test_a_body_that_is_not_the_gzip_it_claims_is_a_400(server):
    """TF Serving's evhttp request gunzips a Content-Encoding: gzip body
    (evhttp_request.cc ReadRequestGzipBytes); one that does not decode left no body there (a
    400). Here it was a 500 "internal error: RequestPayloadError"; a real gzip body is read."""
    import gzip
    url = server.rest_url + "/v1/models/m:predict"
    code, got = _error(requests.post(url, data=b"not gzip", headers={"Content-Encoding": "gzip"}, timeout=30))
    assert code == 400 and got.startswith("cannot read the request body:") and "gzip" in got, got
    ok = requests.post(url, data=gzip.compress(b'{"instances": [[1.0, 2.0]]}'), timeout=30,
                       headers={"Content-Encoding": "gzip"})
    assert ok.status_code == 200 and ok.json() == {"predictions": [[2.0, 4.0]]}


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models/m", None),
    ("GET", "/v1/models/m/metadata", None),
    ("POST", "/v1/models/m:predict", b'{"instances": [[1.0, 2.0]]}'),
    ("POST", "/v1/models/m:predict?x=1", b'{"instances": [[1.0, 2.0]]}'),   # malformed either way
])
def test_an_absolute_form_request_target_is_answered_as_its_path(server, method, path, body):
    """HTTP/1.1 servers must accept a request target in absolute form ("POST http://host/v1/...",
    RFC 9112 3.2.2), as a client sends it to what it takes for a proxy; TF Serving's
    evhttp_request.cc takes the path and query out of it (evhttp_uri_parse). The same request
    in origin form is the reference. It was a 404 'Malformed request: POST http://...'."""
    import http.client
    import json
    host, port = server.rest_url.removeprefix("http://").split(":")

    def answer(target):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, target, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())   # (a map's order may vary)
        finally:
            conn.close()
    assert answer(server.rest_url + path) == answer(path)
