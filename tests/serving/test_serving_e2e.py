"""End to end: a real server subprocess, TF Serving's own client stubs, and REST.

The server loads the pkm_serve op library, then SavedModels whose graphs use
PkmEmbeddingBag; outputs must equal the same SavedModel called in-process and,
for the bare lookup signature, an independent numpy EmbeddingBag.
"""
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_management_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_service_pb2_grpc)
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import status_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import ServerProcess, write_example_model

from tests import reference

MAX_REQUEST_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory, saved_models):
    tmp = tmp_path_factory.mktemp("e2e")
    write_example_model(str(tmp / "classifier" / "1"))
    store = saved_models[1].rsplit("/", 1)[0]
    (tmp / "models.config").write_text(f"""
model_config_list {{
  config {{
    name: "pkm"
    base_path: "{store}"
    model_platform: "tensorflow"
    model_version_policy {{ all {{}} }}
    version_labels {{ key: "stable" value: 1 }}
  }}
  config {{ name: "classifier" base_path: "{tmp / 'classifier'}" model_platform: "tensorflow" }}
}}""")
    (tmp / "monitoring.config").write_text(
        'prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }')
    srv = ServerProcess(tmp, f"--model_config_file={tmp / 'models.config'}",
                        f"--monitoring_config_file={tmp / 'monitoring.config'}",
                        f"--max_request_bytes={MAX_REQUEST_BYTES}", "--file_system_poll_wait_seconds=0")
    srv.config_path = str(tmp / "models.config")
    yield srv
    assert srv.terminate() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server.target)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


@pytest.fixture(scope="module")
def in_process(saved_models, tf_with_ops):
    return {v: tf_with_ops.saved_model.load(saved_models[v]) for v in (1, 2)}


def _request(name="pkm", signature="", version=None, label=None, **inputs):
    import tensorflow as tf
    req = predict_pb2.PredictRequest()
    req.model_spec.name = name
    req.model_spec.signature_name = signature
    if version is not None:
        req.model_spec.version.value = version
    if label is not None:
        req.model_spec.version_label = label
    for k, v in inputs.items():
        req.inputs[k].CopyFrom(tf.make_tensor_proto(v))
    return req


def _out(resp, key):
    import tensorflow as tf
    return tf.make_ndarray(resp.outputs[key])


def _rest(server, path, body=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.rest_url + path, data=data,
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


QUERIES = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)


def test_grpc_predict_equals_in_process_model(stub, in_process):
    resp = stub.Predict(_request(query=QUERIES), timeout=30)
    assert resp.model_spec.name == "pkm"
    assert resp.model_spec.version.value == 2          # latest of {1, 2}
    assert resp.model_spec.signature_name == "serving_default"
    want = in_process[2].signatures["serving_default"](query=QUERIES)
    np.testing.assert_allclose(_out(resp, "output"), want["output"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(_out(resp, "slots"), want["slots"].numpy())


def test_grpc_version_and_label_select_the_version(stub, in_process):
    by_version = stub.Predict(_request(query=QUERIES, version=1), timeout=30)
    by_label = stub.Predict(_request(query=QUERIES, label="stable"), timeout=30)
    want = in_process[1].signatures["serving_default"](query=QUERIES)["output"].numpy()
    for resp in (by_version, by_label):
        assert resp.model_spec.version.value == 1
        np.testing.assert_allclose(_out(resp, "output"), want, rtol=1e-6, atol=1e-7)
    v2 = in_process[2].signatures["serving_default"](query=QUERIES)["output"].numpy()
    assert not np.allclose(want, v2), "versions 1 and 2 must differ for this test to mean anything"


def test_grpc_lookup_signature_matches_numpy_embedding_bag(stub, in_process):
    rng = np.random.default_rng(1)
    indices = rng.integers(-1, 4096, size=(6, 7)).astype(np.int64)   # -1 = padding
    weights = rng.standard_normal((6, 7)).astype(np.float32)
    resp = stub.Predict(_request(signature="lookup", indices=indices, weights=weights), timeout=30)
    table = in_process[2].values.numpy()
    np.testing.assert_allclose(_out(resp, "output"), reference.embedding_bag(table, indices, weights),
                               rtol=1e-5, atol=1e-6)


def test_grpc_output_filter(stub):
    req = _request(query=QUERIES)
    req.output_filter.append("slots")
    resp = stub.Predict(req, timeout=30)
    assert set(resp.outputs) == {"slots"}


def test_rest_row_and_columnar_predict_equal_in_process(server, in_process):
    want = in_process[2].signatures["serving_default"](query=QUERIES)
    status, body = _rest(server, "/v1/models/pkm:predict", {"instances": QUERIES.tolist()})
    assert status == 200, body
    assert len(body["predictions"]) == len(QUERIES)
    np.testing.assert_allclose(np.array([p["output"] for p in body["predictions"]]),
                               want["output"].numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.array([p["slots"] for p in body["predictions"]]), want["slots"].numpy())

    status, body = _rest(server, "/v1/models/pkm/versions/2:predict", {"inputs": {"query": QUERIES.tolist()}})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"]["output"]), want["output"].numpy(), rtol=1e-6, atol=1e-7)

    want1 = in_process[1].signatures["lookup"](indices=np.array([[3, -1]]), weights=np.array([[0.5, 2.0]], np.float32))
    status, body = _rest(server, "/v1/models/pkm/labels/stable:predict",
                         {"signature_name": "lookup", "instances": [{"indices": [3, -1], "weights": [0.5, 2.0]}]})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["predictions"]), want1["output"].numpy(), rtol=1e-6, atol=1e-7)


def test_metadata_and_status_over_grpc_and_rest(server, channel, stub):
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = "pkm"
    resp = stub.GetModelMetadata(req, timeout=30)
    sig_map = get_model_metadata_pb2.SignatureDefMap()
    resp.metadata["signature_def"].Unpack(sig_map)
    # a TF2 SavedModel: __saved_model_init_op is listed too, as TF Serving lists it
    assert set(sig_map.signature_def) == {"serving_default", "lookup", "__saved_model_init_op"}
    assert set(sig_map.signature_def["serving_default"].inputs) == {"query"}
    assert set(sig_map.signature_def["serving_default"].outputs) == {"output", "slots"}
    assert resp.model_spec.version.value == 2

    status, body = _rest(server, "/v1/models/pkm/versions/1/metadata")
    assert status == 200, body
    assert body["model_spec"]["version"] == "1"
    assert set(body["metadata"]["signature_def"]["signature_def"]) == {"serving_default", "lookup",
                                                                       "__saved_model_init_op"}

    models = model_service_pb2_grpc.ModelServiceStub(channel)
    st = models.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "pkm"}), timeout=30)
    assert [(s.version, s.state) for s in st.model_version_status] == [
        (2, get_model_status_pb2.ModelVersionStatus.AVAILABLE),
        (1, get_model_status_pb2.ModelVersionStatus.AVAILABLE)]
    status, body = _rest(server, "/v1/models/pkm")
    assert status == 200
    assert [(s["version"], s["state"]) for s in body["model_version_status"]] == [("2", "AVAILABLE"), ("1", "AVAILABLE")]


def test_health_service_reports_serving(channel):
    h = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tensorflow.serving.PredictionService"):
        r = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("make_request, code, needle", [
    (lambda: _request(name="nope", query=QUERIES), grpc.StatusCode.NOT_FOUND, "nope"),
    (lambda: _request(version=7, query=QUERIES), grpc.StatusCode.NOT_FOUND, "Specific(pkm, 7)"),
    (lambda: _request(label="canary", query=QUERIES), grpc.StatusCode.INVALID_ARGUMENT, "canary"),
    (lambda: _request(signature="nosuch", query=QUERIES), grpc.StatusCode.FAILED_PRECONDITION, "nosuch"),
    (lambda: _request(), grpc.StatusCode.INVALID_ARGUMENT, "Missing but required: {query}."),   # predict_util.cc
    (lambda: _request(query=QUERIES, extra=QUERIES), grpc.StatusCode.INVALID_ARGUMENT, "Sent extra: {extra}."),
    (lambda: _request(query=QUERIES.astype(np.float64)), grpc.StatusCode.INVALID_ARGUMENT, "Expects arg[0] to be float but double is provided (input 'query'"),
    # Shapes are the graph's to judge (TF Serving feeds any shape): its own error comes back.
        (lambda: _request(query=QUERIES[:, :5]), grpc.StatusCode.INVALID_ARGUMENT, "Matrix size-incompatible"),
    (lambda: _request(signature="lookup", indices=np.array([[1, 5000]]), weights=np.ones((1, 2), np.float32)),
     grpc.StatusCode.INVALID_ARGUMENT, "5000 is out of range [0, 4096)"),
    (lambda: _request(query=np.zeros((MAX_REQUEST_BYTES // 128 + 8, 32), np.float32)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
])
def test_grpc_malformed_requests_fail_cleanly_and_server_stays_up(stub, make_request, code, needle):
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(make_request(), timeout=30)
    assert err.value.code() == code, err.value.details()
    assert needle in err.value.details()
    assert stub.Predict(_request(query=QUERIES[:1]), timeout=30).outputs["output"].tensor_shape.dim[1].size == 64


def test_grpc_bad_tensor_proto_is_invalid_argument(stub):
    req = _request(query=QUERIES[:1])
    req.inputs["query"].tensor_content = b"\x00" * 7    # not 32 floats
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _raw_query(shape, dtype=None, content=None, req=None, key="query", **vals):
    """A hand-made TensorProto for input `key` (shape and values need not agree)."""
    req = req or _request()
    p = req.inputs[key]
    p.dtype = dtype or types_pb2.DT_FLOAT
    for d in shape:
        p.tensor_shape.dim.add(size=d)
    if content is not None:
        p.tensor_content = content
    for field, values in vals.items():
        getattr(p, field).extend(values)
    return req


@pytest.mark.parametrize("make_request, needle", [
    # A few bytes that claim a 4 GiB tensor (one value broadcast): refused before decoding.
    (lambda: _raw_query([1 << 25, 32], float_val=[1.0]), "past the limit"),
    (lambda: _raw_query([4, 32], float_val=[]), "holds 0 values"),
    # Fewer values than the shape repeat the last one (Tensor::FromProto); more are refused.
    (lambda: _raw_query([2, 32], float_val=[1.0] * 65), "holds 65 values"),
    (lambda: _raw_query([-1, 32], float_val=[1.0]), "invalid shape"),
    # One short string repeated per element: the copies count against the limit too.
    (lambda: _raw_query([1 << 11, 32], dtype=types_pb2.DT_STRING, string_val=[b"x" * 64]),
     "past the limit"),
    # Fast path: (2**62 + 1) * 4 wraps to 4 in int64, which 16 bytes of content would match.
    (lambda: _raw_query([(1 << 62) + 1, 4], content=b"\0" * 16), "past the limit"),
    (lambda: _raw_query([2, 32], content=b"\0" * 8), "tensor_content holds 8 bytes"),
    # An element count of ~4800 digits (more than Python converts to text by default).
    (lambda: _raw_query([1 << 62] * 254, float_val=[1.0]), "past the limit"),
    (lambda: _raw_query([1] * 255, float_val=[1.0]), "rank 255"),
    # Rank beyond numpy's limit: the reshape fails.
    (lambda: _raw_query([1] * 70, content=b"\0" * 4), "not a valid TensorProto"),
])
def test_grpc_oversized_or_inconsistent_tensor_protos_are_invalid_argument(stub, make_request, needle):
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(make_request(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert needle in err.value.details()
    assert stub.Predict(_request(query=QUERIES[:1]), timeout=30).outputs["output"].tensor_shape.dim[1].size == 64


def test_grpc_inputs_decoded_size_is_bounded_together(stub):
    # 800 KB + 400 KB: each input alone is under the 1 MiB limit, the two together are not.
    req = _raw_query([1, 100_000], dtype=types_pb2.DT_INT64, key="indices", int64_val=[1])
    req = _raw_query([1, 100_000], key="weights", req=req, float_val=[1.0])
    req.model_spec.signature_name = "lookup"
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "past the limit of 1048576 bytes" in err.value.details()


def test_grpc_single_value_broadcast_is_still_accepted(stub):
    resp = stub.Predict(_raw_query([2, 32], float_val=[0.5]), timeout=30)
    want = stub.Predict(_request(query=np.full((2, 32), 0.5, np.float32)), timeout=30)
    np.testing.assert_array_equal(_out(resp, "output"), _out(want, "output"))


def test_classify_regress_multi_inference_on_a_predict_signature(stub):
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "pkm"
    req.input.example_list.examples.add()
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # classifier.cc's PreProcessClassification: the one input must be keyed "inputs".
    assert err.value.details().startswith('No classification inputs found in SignatureDef: inputs {\n  key: "query"')
    multi = inference_pb2.MultiInferenceRequest()
    task = multi.tasks.add()
    task.model_spec.name = "pkm"
    task.method_name = "tensorflow/serving/predict"
    multi.input.example_list.examples.add()
    with pytest.raises(grpc.RpcError) as err:
        stub.MultiInference(multi, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("path, body, raw, status, needle", [
    ("/v1/models/pkm:predict", None, b"{not json", 400, "JSON Parse error"),
    ("/v1/models/pkm:predict", [1, 2], None, 400, "JSON Value: [1,2] Is not object"),
    ("/v1/models/nope:predict", {"instances": [[0.0] * 32]}, None, 404, "nope"),
    ("/v1/models/pkm/versions/9:predict", {"instances": [[0.0] * 32]}, None, 404, "Specific(pkm, 9)"),
    ("/v1/models/pkm/versions/99999999999999999999999:predict", {"instances": [[0.0] * 32]}, None, 400,
     "Failed to convert version: 99999999999999999999999 to numeric."),
    ("/v1/models/pkm/versions/99999999999999999999999", None, None, 400, "Failed to convert version"),
    ("/v1/models/pkm:predict", {"signature_name": "lookup",
                                "inputs": {"indices": [[1, 2 ** 63]], "weights": [[1.0, 1.0]]}}, None, 400,
     "JSON Value: 9223372036854775808 Type: Number is not of expected type: int64"),
    ("/v1/models/pkm:predict", {"signature_name": "x", "instances": [[0.0] * 32]}, None, 400, "\"x\" not found"),
    ("/v1/models/pkm:predict", {"instances": [[0.0] * 32], "inputs": [[0.0] * 32]}, None, 400,
     "expecting only one of 'inputs' or 'instances' keys to exist"),
    ("/v1/models/pkm:predict", {"instances": [[0.0] * 31]}, None, 400, "Matrix size-incompatible"),
    ("/v1/models/pkm:predict", {"instances": [[0.0] * 32, [0.0] * 31]}, None, 400,
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting tensor size: 32 but got: 31"),
    ("/v1/models/pkm:predict", {"instances": [["a"] * 32]}, None, 400, "Type: String is not of expected type"),
    ("/v1/models/pkm:predict", {"signature_name": "lookup", "instances": [{"indices": [1]}]}, None, 400,
     "keys must be equal to: indices,weights"),
    ("/v1/models/pkm:predict", {"signature_name": "lookup",
                                "instances": [{"indices": [1.5], "weights": [1.0]}]}, None, 400,
     "JSON Value: 1.5 Type: Number is not of expected type: int64"),
    ("/v1/models/pkm:predict", {"signature_name": "lookup",
                                "instances": [{"indices": [99999], "weights": [1.0]}]}, None, 400, "out of range"),
    ("/v1/models/pkm:predict", None, b"[" + b"0.0," * (MAX_REQUEST_BYTES // 4) + b"0.0]", 413, "larger than"),
    ("/v1/nothing", None, None, 400, "Malformed request"),
    ("/v2/models/pkm", None, None, 404, "Not Found: GET /v2/models/pkm (only /v1/ paths are served"),
    ("/v1/models/pkm:predict", {"signature_name": 5, "instances": [[0.0] * 32]}, None, 400, "'signature_name' key must be a string"),
    ("/v1/models/classifier:classify", {"signature_name": 5, "examples": [{"x": [0.0, 1.0]}]}, None, 400,
     "'signature_name' key must be a string"),
    ("/v1/models/classifier:regress", {"signature_name": ["regress"], "examples": [{"x": [0.0, 1.0]}]}, None,
     400, "'signature_name' key must be a string"),
    ("/v1/models/classifier:classify", {"examples": [{"x": {"b64": "!!"}}]}, None, 400, "Unable to base64 decode"),
    ("/v1/models/classifier:classify", {"examples": [{"x": {"b64": 5}}]}, None, 400,
     "Feature: x has element with unexpected JSON type: Object"),
    ("/v1/models/classifier:classify", {"examples": [{"x": 2 ** 70}]}, None, 400, "out of range"),
    # (an integer literal past DBL_MAX: rapidjson refuses the body before its examples are read)
    ("/v1/models/classifier:classify", {"examples": [{"x": [0.5, 10 ** 400]}]}, None, 400,
     "JSON Parse error: Number too big to be stored in double. at offset: 26"),
    ("/v1/models/classifier:classify", {"examples": [{"x": "\ud800"}]}, None, 400, "The surrogate pair in string is invalid."),
    ("/v1/models/classifier:predict", {"instances": ["\ud800"]}, None, 400, "The surrogate pair in string is invalid."),
])
def test_rest_malformed_requests_get_4xx_and_server_stays_up(server, path, body, raw, status, needle):
    got, answer = _rest(server, path, body, raw)
    assert got == status, answer
    assert needle in answer["error"]
    ok, _ = _rest(server, "/v1/models/pkm:predict", {"instances": QUERIES[:1].tolist()})
    assert ok == 200


def test_prometheus_metrics(server, stub):
    stub.Predict(_request(query=QUERIES[:1]), timeout=30)
    with pytest.raises(grpc.RpcError):
        stub.Predict(_request(name="nope", query=QUERIES[:1]), timeout=30)
    with urllib.request.urlopen(server.rest_url + "/monitoring/prometheus/metrics", timeout=30) as r:
        text = r.read().decode()
    assert ':tensorflow:serving:request_count{model_name="pkm",status="OK"}' in text
    assert ':tensorflow:serving:request_count{model_name="nope",status="NOT_FOUND"}' in text
    assert ':tensorflow:serving:model_version_available{model_name="pkm",version="2"} 1.0' in text


def test_reload_config_adds_and_removes_models(server, channel, stub, saved_models, tf_with_ops):
    from pkm_serve.serving.config import read_model_config_file
    original = read_model_config_file(server.config_path)
    composite_base = saved_models["composite"].rsplit("/", 1)[0]
    cfg = model_server_config_pb2.ModelServerConfig()
    cfg.CopyFrom(original)
    cfg.model_config_list.config.add(name="composite", base_path=composite_base, model_platform="tensorflow")
    models = model_service_pb2_grpc.ModelServiceStub(channel)

    def reload(config):
        """The status as model_service_impl.cc gives it: OK in the answer, or the RPC's error."""
        try:
            return models.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config),
                                                    timeout=60).status
        except grpc.RpcError as e:
            return status_pb2.StatusProto(error_code=e.code().value[0], error_message=e.details())

    try:
        status = reload(cfg)
        assert status.error_code == 0, status.error_message
        out = stub.Predict(_request(name="composite", query=QUERIES), timeout=30)
        want = tf_with_ops.saved_model.load(saved_models["composite"]).signatures["serving_default"](query=QUERIES)
        np.testing.assert_allclose(_out(out, "output"), want["output"].numpy(), rtol=1e-6, atol=1e-7)

        # An empty ModelServerConfig is refused and changes nothing, as TF Serving's
        # HandleReloadConfigRequest (it unloaded every model once, then was an OK no-op).
        status = reload(model_server_config_pb2.ModelServerConfig())
        assert (status.error_code, status.error_message) == (
            grpc.StatusCode.INVALID_ARGUMENT.value[0], "ServerModelConfig type not supported by "
            "HandleReloadConfigRequest. Only ModelConfigList is currently supported")
        assert stub.Predict(_request(name="composite", query=QUERIES[:1]), timeout=30)
        # A model with no version on disk: its status is NOT_FOUND, as in TF Serving (was OK, empty).
        # The reload waits for a new model's version (ServerCore::ReloadConfig); this server polls
        # once (--file_system_poll_wait_seconds=0), so it says at once that none came, config applied.
        ghost = model_server_config_pb2.ModelServerConfig()
        ghost.CopyFrom(cfg)
        ghost.model_config_list.config.add(name="ghost", base_path=composite_base + "/no_such_dir",
                                           model_platform="tensorflow")
        status = reload(ghost)
        assert status.error_code == grpc.StatusCode.UNKNOWN.value[0]
        assert status.error_message.startswith("no version to load of ghost (base path ")
        with pytest.raises(grpc.RpcError) as err:
            models.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "ghost"}),
                                  timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "Could not find any versions of model ghost" in err.value.details()

        bad = model_server_config_pb2.ModelServerConfig()
        bad.model_config_list.config.add(name="x", base_path="/tmp", model_platform="pytorch")
        status = reload(bad)
        assert status.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "pytorch" in status.error_message
        assert stub.Predict(_request(name="composite", query=QUERIES[:1]), timeout=30)   # unchanged

        # A label on a version that is not loaded: FAILED_PRECONDITION and the labels stay as they
        # were, as in TF Serving without --allow_version_labels_for_unavailable_models (was accepted).
        moved = model_server_config_pb2.ModelServerConfig()
        moved.CopyFrom(cfg)
        pkm = next(c for c in moved.model_config_list.config if c.name == "pkm")
        pkm.version_labels["stable"] = 7
        status = reload(moved)
        assert status.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert ("Request to assign label to version 7 of model pkm, which is not currently available for "
                "inference") in status.error_message
        assert stub.Predict(_request(query=QUERIES[:1], label="stable"), timeout=30).model_spec.version.value == 1
        pkm.version_labels["stable"] = 2  # a loaded version: the label moves
        assert reload(moved).error_code == 0
        assert stub.Predict(_request(query=QUERIES[:1], label="stable"), timeout=30).model_spec.version.value == 2
    finally:
        assert reload(original).error_code == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(_request(name="composite", query=QUERIES[:1]), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Predict(_request(query=QUERIES[:1]), timeout=30).model_spec.version.value == 2


def _examples(request_input, rows):
    for a, b in rows:
        ex = request_input.example_list.examples.add()
        ex.features.feature["x"].float_list.value.extend([a, b])


def test_classify_regress_and_multi_inference_on_example_signatures(stub, server):
    rows = [(0.0, 1.0), (2.0, -1.0)]
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "classifier"
    _examples(req.input, rows)
    resp = stub.Classify(req, timeout=30)
    for (a, b), c in zip(rows, resp.result.classifications):
        want = np.exp([a, b]) / np.exp([a, b]).sum()
        assert [x.label for x in c.classes] == ["a", "b"]
        np.testing.assert_allclose([x.score for x in c.classes], want, rtol=1e-5)

    from tensorflow_serving.apis import regression_pb2
    rreq = regression_pb2.RegressionRequest()
    rreq.model_spec.name = "classifier"
    rreq.model_spec.signature_name = "regress"
    _examples(rreq.input, rows)
    rresp = stub.Regress(rreq, timeout=30)
    np.testing.assert_allclose([r.value for r in rresp.result.regressions], [1.0, 1.0])

    multi = inference_pb2.MultiInferenceRequest()
    for method, sig in (("tensorflow/serving/classify", ""), ("tensorflow/serving/regress", "regress")):
        t = multi.tasks.add(method_name=method)
        t.model_spec.name = "classifier"
        t.model_spec.signature_name = sig
    _examples(multi.input, rows)
    mresp = stub.MultiInference(multi, timeout=30)
    assert len(mresp.results) == 2
    assert mresp.results[0].classification_result.classifications[1].classes[0].label == "a"
    np.testing.assert_allclose([r.value for r in mresp.results[1].regression_result.regressions], [1.0, 1.0])

    with pytest.raises(grpc.RpcError) as err:   # a regress request on the classify signature
        rreq.model_spec.signature_name = ""
        stub.Regress(rreq, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "Expected one output Tensor."   # regressor.cc: it has classes and scores

    status, body = _rest(server, "/v1/models/classifier:classify", {"examples": [{"x": [0.0, 1.0]}]})
    assert status == 200, body
    assert [c[0] for c in body["results"][0]] == ["a", "b"]
    status, body = _rest(server, "/v1/models/classifier:regress",
                         {"signature_name": "regress", "examples": [{"x": [2.0, 3.5]}]})
    assert status == 200, body
    np.testing.assert_allclose(body["results"], [5.5])
