"""Round 35 parity checks against tensorflow_model_server, on one server with real gRPC and
REST clients:
- Classify wants rank-2 classes and scores and DT_FLOAT scores, Regress DT_FLOAT values, as
  classifier.cc / regressor.cc (float64, half and int32 scores were taken as float32, and a
  [n] classes or scores tensor as one class each); shapes print as TensorShape::DebugString
  does ([2,2], not [2, 2]);
- GetModelStatus reads only the spec's version (get_model_status_impl.cc): with a version
  label, or none, it answers every version of the model (a label answered its version only,
  an unknown label was INVALID_ARGUMENT); no model_spec is "Missing ModelSpec", a model not
  configured "Could not find any versions of model M"; Predict, Classify, Regress and
  GetModelMetadata without a model_spec are "Missing ModelSpec" too (their inputs, or no
  model name, were named instead);
- float8 outputs: gRPC carries them in float8_val as TF's AsProtoField (it was an INTERNAL
  AttributeError), REST refuses them as json_tensor.cc's writer does (they were printed);
- a signature without the outputs Classify/Regress read is refused before the model runs in
  PreProcessClassification / PreProcessRegression's words (this server's, after running it);
- REST URLs are parsed as http_rest_api_util.cc's patterns: case-insensitively, on the path as
  sent (a %2F in a name is the name's), versions of digits only, no trailing slash; GET
  /v1/models is "Missing model name in request.";
- Predict looks the model up, then checks input names in predict_util.cc's words, then reads
  the values (a malformed input was named before an unknown model);
- Predict on a signature the model lacks: gRPC FAILED_PRECONDITION 'Serving signature key "S"
  not found.' (predict_util.cc; REST's words were given), REST 400 in GetInfoMap's words;
- MultiInference looks the servable up first and checks each task in multi_inference.cc's
  order and words (an unknown first model was INVALID_ARGUMENT, the words were this server's)."""
import json
import urllib.error
import urllib.request

import grpc
import ml_dtypes
import numpy as np
import pytest
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)

from serving_helpers import ServerProcess, save_graph

X = [[1.0, 2.0], [3.0, 0.5]]


def _save_example_model(path, scores_dtype="float32", classes_rank=2, scores_rank=2):
    """serving_default classifies into ("a", "b") with softmax scores ("scores_only" gives only
    those); "reg" regresses x[:, 0] and "reg_wide" all of x, all cast to `scores_dtype`;
    `*_rank` 1 keeps column 0 only."""
    import tensorflow as tf
    with tf.Graph().as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32)})["x"]
        scores = tf.cast(tf.nn.softmax(x), scores_dtype)
        classes = tf.tile(tf.constant([["a", "b"]]), [tf.shape(x)[0], 1])
        classes = classes[:, 0] if classes_rank == 1 else classes
        scores = scores[:, 0] if scores_rank == 1 else scores
        info = tf.compat.v1.saved_model.build_tensor_info
        build = tf.compat.v1.saved_model.build_signature_def
        sigs = {"serving_default": build({"inputs": info(serialized)},
                                         {"classes": info(classes), "scores": info(scores)},
                                         "tensorflow/serving/classify"),
                "reg": build({"inputs": info(serialized)}, {"outputs": info(tf.cast(x[:, 0], scores_dtype))},
                             "tensorflow/serving/regress"),
                "reg_wide": build({"inputs": info(serialized)}, {"outputs": info(tf.cast(x, scores_dtype))},
                                  "tensorflow/serving/regress"),
                "scores_only": build({"inputs": info(serialized)}, {"scores": info(scores)},
                                     "tensorflow/serving/classify")}
        save_graph(path, sigs)


def _save_float8_model(path):
    import tensorflow as tf
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.cast(x, tf.dtypes.as_dtype("float8_e4m3fn"))
        info = tf.compat.v1.saved_model.build_tensor_info
        sig = tf.compat.v1.saved_model.build_signature_def({"x": info(x)}, {"y": info(y)},
                                                           "tensorflow/serving/predict")
        save_graph(path, {"serving_default": sig})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity35")
    models = {"f32": lambda p: _save_example_model(p),
              "f64": lambda p: _save_example_model(p, "float64"),
              "f16": lambda p: _save_example_model(p, "float16"),
              "i32": lambda p: _save_example_model(p, "int32"),
              "rank1": lambda p: _save_example_model(p, classes_rank=1, scores_rank=1),
              "rank1_scores": lambda p: _save_example_model(p, scores_rank=1)}
    entries = []
    for name, save in models.items():
        save(str(tmp / name / "1"))
        entries.append(f'config {{ name: "{name}" base_path: "{tmp / name}" model_platform: "tensorflow" }}')
    for version in (1, 2, 3):
        _save_float8_model(str(tmp / "f8" / str(version)))
    entries.append(f'config {{ name: "f8" base_path: "{tmp / "f8"}" model_platform: "tensorflow" '
                   'model_version_policy { all {} } version_labels { key: "stable" value: 1 } '
                   'version_labels { key: "canary" value: 2 } }')
    (tmp / "models.config").write_text("model_config_list { %s }\n" % " ".join(entries))
    srv = ServerProcess(tmp, f"--model_config_file={tmp / 'models.config'}", "--file_system_poll_wait_seconds=0")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def _rest(server, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.rest_url + path, data=data, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _examples(request, model, signature=""):
    import tensorflow as tf
    request.model_spec.name, request.model_spec.signature_name = model, signature
    for x in X:
        request.input.example_list.examples.add().CopyFrom(tf.train.Example(features=tf.train.Features(
            feature={"x": tf.train.Feature(float_list=tf.train.FloatList(value=x))})))
    return request


def _grpc_error(call, request):
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("model, message", [
    ("f64", "Expected scores Tensor of DT_FLOAT. Got: DT_DOUBLE"),
    ("f16", "Expected scores Tensor of DT_FLOAT. Got: DT_HALF"),
    ("i32", "Expected scores Tensor of DT_FLOAT. Got: DT_INT32"),
    ("rank1", "Expected Tensor shape: [batch_size num_classes] but got [2] ('classes')"),
    ("rank1_scores", "Expected Tensor shape: [batch_size num_classes] but got [2] ('scores')")])
def test_classify_wants_rank_2_float32_scores(server, channel, model, message):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    assert _grpc_error(stub.Classify, _examples(classification_pb2.ClassificationRequest(), model)) == (
        grpc.StatusCode.INVALID_ARGUMENT, message)
    status, answer = _rest(server, f"/v1/models/{model}:classify", {"examples": [{"x": x} for x in X]})
    assert (status, answer) == (400, {"error": message})


def test_classify_of_float32_scores_answers_the_softmax(server, channel):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    resp = stub.Classify(_examples(classification_pb2.ClassificationRequest(), "f32"), timeout=30)
    x = np.array(X, np.float64)
    softmax = np.exp(x) / np.exp(x).sum(1, keepdims=True)
    got = [[(c.label, c.score) for c in cl.classes] for cl in resp.result.classifications]
    assert [[label for label, _ in row] for row in got] == [["a", "b"]] * 2
    np.testing.assert_allclose([[score for _, score in row] for row in got], softmax, rtol=1e-6)


@pytest.mark.parametrize("model, signature, message", [
    ("f64", "reg", "Expected output Tensor of DT_FLOAT.  Got: DT_DOUBLE"),
    ("i32", "reg", "Expected output Tensor of DT_FLOAT.  Got: DT_INT32"),
    ("f32", "reg_wide", "Expected output Tensor shape to be either [batch_size] or [batch_size, 1] "
                        "but got [2,2] (signature 'reg_wide')")])
def test_regress_wants_float32_values_and_prints_shapes_as_tensorflow(server, channel, model, signature, message):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    assert _grpc_error(stub.Regress, _examples(regression_pb2.RegressionRequest(), model, signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT, message)
    status, answer = _rest(server, f"/v1/models/{model}:regress",
                           {"signature_name": signature, "examples": [{"x": x} for x in X]})
    assert (status, answer) == (400, {"error": message})


def _versions(response):
    return [(s.version, get_model_status_pb2.ModelVersionStatus.State.Name(s.state))
            for s in response.model_version_status]


@pytest.mark.parametrize("label", ["stable", "canary", "no_such_label"])
def test_model_status_with_a_label_answers_every_version(server, channel, label):
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name, request.model_spec.version_label = "f8", label
    every_version = [(3, "AVAILABLE"), (2, "AVAILABLE"), (1, "AVAILABLE")]
    assert _versions(stub.GetModelStatus(request, timeout=30)) == every_version
    status, answer = _rest(server, f"/v1/models/f8/labels/{label}")
    assert status == 200 and [(int(s["version"]), s["state"]) for s in answer["model_version_status"]] == every_version


def test_model_status_words_for_what_is_missing(channel):
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    assert _grpc_error(stub.GetModelStatus, get_model_status_pb2.GetModelStatusRequest()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec")
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "ghost"
    assert _grpc_error(stub.GetModelStatus, request) == (
        grpc.StatusCode.NOT_FOUND, "Could not find any versions of model ghost")
    request.model_spec.version.value = 4
    assert _grpc_error(stub.GetModelStatus, request) == (
        grpc.StatusCode.NOT_FOUND, "Could not find version 4 of model ghost")


def test_float8_outputs_go_over_grpc_and_are_refused_over_rest(server, channel):
    import tensorflow as tf
    x = np.array([[0.1, 1.5, -300.0]], np.float32)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "f8"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    y = stub.Predict(request, timeout=30).outputs["y"]
    assert len(y.float8_val) == 3   # TF's AsProtoField: one byte per value in float8_val
    got = tf.make_ndarray(y)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.view(np.uint8), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    message = "Failed to write JSON value for tensor type: float8_e4m3fn (output 'y'); the gRPC API returns it"
    for body in ({"instances": x.tolist()}, {"inputs": x.tolist()}):
        assert _rest(server, "/v1/models/f8:predict", body) == (400, {"error": message})


@pytest.mark.parametrize("dtype", ["float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn", "int4", "uint4"])
def test_rest_refuses_the_one_byte_types_upstreams_json_writer_lacks(dtype):
    """json_tensor.cc's AddSingleValueAndAdvance writes float, double, the integers of 8 bits
    and more, strings and bools; TF's DataTypeString names these as ml_dtypes does."""
    from pkm_serve.serving import tensors
    from pkm_serve.serving.errors import ServingError
    with pytest.raises(ServingError) as err:
        tensors.to_json("y", np.array([1.0, -2.0], np.float32).astype(getattr(ml_dtypes, dtype)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith(f"Failed to write JSON value for tensor type: {dtype} (output 'y')")


def _multi(*tasks):
    """A MultiInferenceRequest of (model, signature, method) tasks on the examples X."""
    request = _examples(classification_pb2.ClassificationRequest(), "")
    multi = inference_pb2.MultiInferenceRequest(input=request.input)
    for model, signature, method in tasks:
        task = multi.tasks.add(method_name=f"tensorflow/serving/{method}")
        task.model_spec.name, task.model_spec.signature_name = model, signature
    return multi


def test_multi_inference_answers_each_task(channel):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    resp = stub.MultiInference(_multi(("f32", "", "classify"), ("f32", "reg", "regress")), timeout=30)
    classes = resp.results[0].classification_result.classifications
    x = np.array(X, np.float64)
    np.testing.assert_allclose([[c.score for c in cl.classes] for cl in classes],
                               np.exp(x) / np.exp(x).sum(1, keepdims=True), rtol=1e-6)
    assert [r.value for r in resp.results[1].regression_result.regressions] == [x[0] for x in X]


@pytest.mark.parametrize("tasks, code, message", [
    ((("f32", "", "classify"), ("f64", "reg", "regress")), grpc.StatusCode.INVALID_ARGUMENT,
     "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    ((("f32", "", "classify"), ("", "reg", "regress")), grpc.StatusCode.INVALID_ARGUMENT,
     "Found ModelSpec with an empty model name."),
    ((("ghost", "", "classify"), ("f32", "reg", "regress")), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request"),
    ((("f32", "", "classify"), ("f32", "nosuch", "regress")), grpc.StatusCode.INVALID_ARGUMENT,
     "Requested signature not found in model graph: nosuch"),
    ((("f32", "reg", "predict"),), grpc.StatusCode.UNIMPLEMENTED,
     "Unsupported signature method_name: tensorflow/serving/predict"),
    # Task by task: the second task's duplicate is found before the third's other model.
    ((("f32", "reg", "regress"), ("f32", "reg", "regress"), ("f64", "", "classify")),
     grpc.StatusCode.INVALID_ARGUMENT, "Duplicate evaluation of signature: reg")])
def test_multi_inference_refuses_tasks_in_upstreams_order_and_words(channel, tasks, code, message):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    got_code, details = _grpc_error(stub.MultiInference, _multi(*tasks))
    assert got_code == code and details.startswith(message), (got_code, details)


@pytest.mark.parametrize("call, signature, message", [
    ("Classify", "reg", 'Expected classification signature outputs to contain at least one of "classes" or '
                        '"scores". Signature was: inputs {'),
    ("Regress", "", "Expected one output Tensor."),
    ("Regress", "scores_only", "No regression outputs found in SignatureDef: inputs {")])
def test_signatures_without_the_outputs_read_are_refused_in_upstreams_words(server, channel, call, signature,
                                                                            message):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    kind = classification_pb2.ClassificationRequest if call == "Classify" else regression_pb2.RegressionRequest
    code, details = _grpc_error(getattr(stub, call), _examples(kind(), "f32", signature))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(message), details


@pytest.mark.parametrize("path, body, status, answer", [
    ("/V1/Models/f32/Versions/1:classify", {"examples": [{"x": X[0]}]}, 200, None),
    ("/v1/models/f32:Classify", {"examples": [{"x": X[0]}]}, 400, "Malformed request: POST /v1/models/f32:Classify"),
    ("/v1/models", None, 400, "Missing model name in request."),
    ("/v1/models/f32/", None, 400, "Malformed request: GET /v1/models/f32/"),
    ("/v1/models/f32/versions/-1", None, 400, "Malformed request: GET /v1/models/f32/versions/-1"),
    ("/v1/models/f32/versions/9223372036854775808:predict", {"instances": [1]}, 400,
     "Failed to convert version: 9223372036854775808 to numeric."),
    ("/v1/models/f%33%32%2Fx:predict", {"instances": [1]}, 404, "Servable not found for request: Latest(f32/x)")])
def test_rest_urls_are_parsed_as_upstream(server, path, body, status, answer):
    got_status, got = _rest(server, path, body)
    assert got_status == status, got
    if answer is None:
        assert [label for label, _ in got["results"][0]] == ["a", "b"]
    else:
        assert got["error"].startswith(answer), got


def test_requests_without_a_model_spec_are_missing_it(channel):
    """Checked first, as upstream: before the request's inputs and metadata fields."""
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    bad_input = predict_pb2.PredictRequest()
    bad_input.inputs["x"].dtype = 1   # DT_FLOAT without values or shape: refused if looked at
    bad_input.inputs["x"].tensor_shape.dim.add(size=2)
    for call, request in [(stub.Predict, bad_input), (stub.Classify, classification_pb2.ClassificationRequest()),
                          (stub.Regress, regression_pb2.RegressionRequest()),
                          (stub.GetModelMetadata, get_model_metadata_pb2.GetModelMetadataRequest())]:
        assert _grpc_error(call, request) == (grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec"), call


def test_predict_on_a_signature_the_model_lacks_in_each_transports_words(server, channel):
    import tensorflow as tf
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "f8", "nosuch"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.zeros((1, 3), np.float32)))
    code, details = _grpc_error(stub.Predict, request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.startswith('Serving signature key "nosuch" not found.'), details
    status, answer = _rest(server, "/v1/models/f8:predict", {"signature_name": "nosuch", "instances": [[0, 0, 0]]})
    assert status == 400 and answer["error"].startswith('Serving signature name: "nosuch" not found in signature def')


def test_predict_looks_the_model_up_before_reading_the_inputs(channel):
    """predict_impl.cc finds the servable, then predict_util.cc reads the inputs: an unknown
    model is NOT_FOUND whatever the inputs hold (a malformed input was named first)."""
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "ghost"
    request.inputs["x"].dtype = 1   # DT_FLOAT with a shape and no values
    request.inputs["x"].tensor_shape.dim.add(size=2)
    code, details = _grpc_error(stub.Predict, request)
    assert code == grpc.StatusCode.NOT_FOUND and "ghost" in details, details
