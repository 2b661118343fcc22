"""`pkm-serve serve --prefer_tflite_model=true`: version directories holding model.tflite
are served from it through LiteRT and the pkm_serve delegate (TF Serving's TFLite
servable), over gRPC and REST, with batching, version swaps and metrics.

Mirrors TF Serving's tensorflow_model_server_test.py testPredictOnTfLite (a .tflite without
SignatureDefs: one serving_default named by the tensors) and
testPredictWithSignatureDefOnTfLite (a .tflite with a SignatureDef): both send x =
float_val [2.0] of shape [1] and expect y = [3.0] from half_plus_two, with the model spec
(name, version, serving_default). The PKM models are PkmEmbeddingBag custom-op .tflite
files (fp32 and int8 tables), checked against tests/reference.py's float64 bag."""
import json
import os
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_pb2,
                                     model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc)

import half_plus_two as hpt
import reference
from serving_helpers import ServerProcess
from pkm_serve import tflite

State = get_model_status_pb2.ModelVersionStatus.State
N, D, K = 300, 16, 4
TABLES = {v: np.random.default_rng(v).standard_normal((N, D)).astype(np.float32) for v in (1, 2)}


def _half_plus_two_tflite(tmp, with_signature):
    import tensorflow as tf
    saved = hpt.write_tf2(os.path.join(tmp, "hpt_for_tflite"))
    model = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=["serving_default"]).convert()
    if with_signature:
        return model
    # testPredictOnTfLite's model has no SignatureDef and tensors named x and y.
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model), 0))
    m.signatureDefs = None
    graph = m.subgraphs[0]
    graph.tensors[graph.inputs[0]].name, graph.tensors[graph.outputs[0]].name = "x", "y"
    import flatbuffers
    b = flatbuffers.Builder(len(model) + 1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _pkm_tflite(version):
    model = tflite.build_embedding_bag_model(TABLES[version], K)
    return model if version == 1 else tflite.quantize_table_int8(model)   # version 2: int8 rows


def _pkm_reference(version, idx, w):
    table = TABLES[version].astype(np.float64)
    if version == 2:
        q, scales, zero_points = tflite.quantize_rows_int8_affine(TABLES[version])
        table = (q.astype(np.float64) - zero_points[:, None]) * scales[:, None]
    return reference.embedding_bag(table, idx, w)


def _write(base, version, model_bytes, saved_model_scale=None):
    path = os.path.join(base, str(version))
    tmp = os.path.join(base, f".tmp-{version}")
    if saved_model_scale is not None:
        hpt.write_tf2(tmp, scale=saved_model_scale)   # a SavedModel beside it that answers differently
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "model.tflite"), "wb") as f:
        f.write(model_bytes)
    os.rename(tmp, path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, tf_with_ops):
    root = tmp_path_factory.mktemp("tflite")
    # SavedModel y = 3x + 2 beside the .tflite's y = 0.5x + 2: the answer says which one served.
    _write(str(root / "hpt_sigdef"), 123, _half_plus_two_tflite(str(root), True), saved_model_scale=3.0)
    _write(str(root / "hpt_nosig"), 1, _half_plus_two_tflite(str(root), False))
    _write(str(root / "pkm"), 1, _pkm_tflite(1))
    return root


@pytest.fixture(scope="module")
def server(models):
    config = models / "models.config"
    config.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{n}" base_path: "{models / n}" model_platform: "tensorflow" }}\n'
        for n in ("hpt_sigdef", "hpt_nosig", "pkm")) + "}\n")
    (models / "batching.config").write_text("max_batch_size { value: 64 }\nbatch_timeout_micros { value: 2000 }\n"
                                            "num_batch_threads { value: 2 }\n")
    (models / "monitoring.config").write_text("prometheus_config { enable: true }\n")
    srv = ServerProcess(models, f"--model_config_file={config}", "--prefer_tflite_model=true",
                        "--num_tflite_pools=2", "--file_system_poll_wait_seconds=0.5", "--enable_batching",
                        f"--batching_parameters_file={models / 'batching.config'}",
                        f"--monitoring_config_file={models / 'monitoring.config'}")
    yield srv
    assert srv.terminate() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as ch:
        yield prediction_service_pb2_grpc.PredictionServiceStub(ch)


def _verify_predict_request(stub, model, version):
    """server_test VerifyPredictRequest(expected_output=3.0, specify_output=False)."""
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.inputs["x"].dtype = types_pb2.DT_FLOAT
    req.inputs["x"].float_val.append(2.0)
    req.inputs["x"].tensor_shape.dim.add().size = 1
    resp = stub.Predict(req, timeout=30)
    assert resp.outputs["y"].dtype == types_pb2.DT_FLOAT
    assert list(resp.outputs["y"].float_val) == [3.0]
    assert (resp.model_spec.name, resp.model_spec.version.value, resp.model_spec.signature_name) == \
        (model, version, "serving_default")


def test_predict_on_tflite(stub):
    """server_test testPredictOnTfLite: a .tflite without SignatureDefs."""
    _verify_predict_request(stub, "hpt_nosig", 1)


def test_predict_with_signature_def_on_tflite(stub):
    """server_test testPredictWithSignatureDefOnTfLite; the SavedModel beside the .tflite
    (which would answer 8.0) is not what serves."""
    _verify_predict_request(stub, "hpt_sigdef", 123)


def test_without_the_flag_the_saved_model_serves(models):
    from pkm_serve.serving.loader import make_loader_factory
    path = str(models / "hpt_sigdef" / "123")
    for prefer, expected in ((False, 8.0), (True, 3.0)):
        loader = make_loader_factory(warmup=False, prefer_tflite_model=prefer)("m", 123, path)
        loader.load()
        try:
            out = loader.servable().signature("").run({"x": np.array([[2.0]], np.float32)})
            assert out["y"].tolist() == [[expected]]
        finally:
            loader.unload()


def test_signature_defs_come_from_the_signature_runner(stub, server):
    req = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    req.model_spec.name = "hpt_sigdef"
    sig_map = get_model_metadata_pb2.SignatureDefMap()
    stub.GetModelMetadata(req, timeout=30).metadata["signature_def"].Unpack(sig_map)
    (key,) = sig_map.signature_def
    sdef = sig_map.signature_def[key]
    assert key == "serving_default" and sdef.method_name == "tensorflow/serving/predict"
    assert [(k, v.dtype, [d.size for d in v.tensor_shape.dim]) for k, v in sdef.inputs.items()] == \
        [("x", types_pb2.DT_FLOAT, [-1, 1])]
    assert list(sdef.outputs) == ["y"]
    with urllib.request.urlopen(server.rest_url + "/v1/models/pkm/metadata", timeout=30) as r:
        rest = json.loads(r.read())["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sorted(rest["inputs"]) == ["indices", "weights"] and list(rest["outputs"]) == ["output"]
    assert rest["inputs"]["indices"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in rest["inputs"]["indices"]["tensor_shape"]["dim"]] == ["-1", str(K)]


def _bags(rng, rows):
    idx = rng.integers(-1, N, size=(rows, K)).astype(np.int32)
    return idx, rng.random((rows, K)).astype(np.float32)


def _grpc_pkm(stub, idx, w, version=None):
    import tensorflow as tf
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    if version is not None:
        req.model_spec.version.value = version
    req.inputs["indices"].CopyFrom(tf.make_tensor_proto(idx))
    req.inputs["weights"].CopyFrom(tf.make_tensor_proto(w))
    resp = stub.Predict(req, timeout=30)
    return resp.model_spec.version.value, tf.make_ndarray(resp.outputs["output"])


def _rest_pkm(server, idx, w):
    body = json.dumps({"instances": [{"indices": i.tolist(), "weights": x.tolist()} for i, x in zip(idx, w)]})
    req = urllib.request.Request(server.rest_url + "/v1/models/pkm:predict", data=body.encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return np.array(json.loads(r.read())["predictions"], np.float64)


def test_pkm_tflite_answers_the_tflite_outputs_over_grpc_and_rest(stub, server):
    rng = np.random.default_rng(5)
    idx, w = _bags(rng, 7)
    direct = tflite.run_tflite(_pkm_tflite(1), {"indices": idx, "weights": w})[0]
    version, got = _grpc_pkm(stub, idx, w)
    assert version == 1
    np.testing.assert_array_equal(got, direct)
    np.testing.assert_allclose(got, _pkm_reference(1, idx, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_rest_pkm(server, idx, w), direct, rtol=1e-6, atol=1e-6)


def test_bad_index_is_invalid_argument_naming_it(stub):
    # Several in a row (each interpreter of the pools sees more than one): LiteRT's error buffer
    # keeps every earlier message, and each answer named the earlier requests' values too.
    for bad in range(N, N + 6):
        idx = np.array([[0, 1, bad, 2]], np.int32)
        with pytest.raises(grpc.RpcError) as err:
            _grpc_pkm(stub, idx, np.ones((1, K), np.float32))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"= {bad} is out of range [0, {N})" in err.value.details()
        assert err.value.details().count("is out of range") == 1, err.value.details()


def test_concurrent_requests_are_batched_and_each_gets_its_rows(stub, server):
    rng = np.random.default_rng(9)
    cases = [_bags(rng, int(rng.integers(1, 5))) for _ in range(48)]
    results, errors = [None] * len(cases), []

    def client(i):
        try:
            results[i] = _grpc_pkm(stub, *cases[i])[1]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    for (idx, w), got in zip(cases, results):
        np.testing.assert_allclose(got, _pkm_reference(1, idx, w), rtol=1e-5, atol=1e-5)
    with urllib.request.urlopen(server.rest_url + "/monitoring/prometheus/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'runtime="TFLite"' in metrics and 'model_name="pkm"' in metrics
    count = [line for line in metrics.splitlines()
             if line.startswith(":tensorflow:serving:batching_session:processed_batch_size_count")]
    assert count and float(count[0].split()[-1]) < len(cases), "no request was batched with another"


def _status(server):
    with grpc.insecure_channel(server.target) as ch:
        resp = model_service_pb2_grpc.ModelServiceStub(ch).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec=model_pb2.ModelSpec(name="pkm")), timeout=10)
    return {s.version: s.state for s in resp.model_version_status}


def test_version_swap_to_an_int8_table(stub, server, models):
    """Last in this module: version 2 (int8 table) replaces version 1 under the poller."""
    rng = np.random.default_rng(11)
    idx, w = _bags(rng, 5)
    _write(str(models / "pkm"), 2, _pkm_tflite(2))
    end = time.monotonic() + 60
    while _status(server) != {2: State.AVAILABLE, 1: State.END}:
        assert time.monotonic() < end, server.log()[-3000:]
        time.sleep(0.2)
    version, got = _grpc_pkm(stub, idx, w)
    assert version == 2
    np.testing.assert_allclose(got, _pkm_reference(2, idx, w), rtol=1e-5, atol=1e-5)
    # int8 rows are not the fp32 table: the answer really comes from the new version
    assert not np.allclose(got, reference.embedding_bag(TABLES[2].astype(np.float64), idx, w), atol=1e-6)


def test_broken_tflite_fails_the_load_with_a_clear_error(tmp_path):
    from pkm_serve.serving.errors import ServingError
    from pkm_serve.serving.tflite_servable import TfLiteServable
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.tflite").write_bytes(b"TFL3 not a flatbuffer")
    with pytest.raises(ServingError) as err:
        TfLiteServable("m", 1, str(tmp_path / "1"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot load" in err.value.message and "model.tflite" in err.value.message


def test_tflite_flags():
    from pkm_serve.serving import config
    a = config.parse_args(["--model_base_path=/m"])
    assert (a.prefer_tflite_model, a.num_tflite_pools, a.tflite_num_threads) == (False, None, 1)
    assert config.tflite_interpreters(a) == len(os.sched_getaffinity(0))
    a = config.parse_args(["--model_base_path=/m", "--prefer_tflite_model=true", "--num_tflite_pools=3"])
    assert (a.prefer_tflite_model, a.num_tflite_pools, config.tflite_interpreters(a)) == (True, 3, 3)
    # TF Serving's TfLiteSession takes max(1, N): an explicit 0 was one per CPU here.
    assert config.tflite_interpreters(config.parse_args(["--model_base_path=/m", "--num_tflite_pools=0"])) == 1
    with pytest.raises(SystemExit):
        config.parse_args(["--model_base_path=/m", "--num_tflite_pools=-1"])


def _int8_with(scale=None, zero_point=None, row=3):
    """The int8 PKM .tflite with row `row`'s scale or zero point replaced in the file."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(_pkm_tflite(2)), 0))
    quant = m.subgraphs[0].tensors[m.subgraphs[0].operators[0].inputs[0]].quantization
    if scale is not None:
        quant.scale[row] = scale
    if zero_point is not None:
        quant.zeroPoint[row] = zero_point
    b = flatbuffers.Builder(N * D + 8192)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


@pytest.mark.parametrize("scale, zero_point, says", [
    (float("nan"), None, "scale of row 3 is nan"), (-0.5, None, "scale of row 3 is -0.5"),
    (0.0, None, "scale of row 3 is 0.0"), (float("inf"), None, "scale of row 3 is inf"),
    # TFLite keeps zero points as int32: 2**33 + 5 would silently become 5.
    (None, 2 ** 33 + 5, "zero point of row 3 is 8589934597, past int32")])
def test_int8_table_with_bad_quantisation_fails_the_load(tmp_path, scale, zero_point, says):
    """Such a version loaded as AVAILABLE and then failed every request (the kernel refuses
    the scales when it is prepared) or answered wrong rows; now the load fails, with the
    reason in GetModelStatus, as TF Serving reports a servable that fails to load."""
    from pkm_serve.serving.loader import make_loader_factory
    from serving_helpers import polled_manager, version_states
    model = _int8_with(scale, zero_point)
    _write(str(tmp_path), 1, model)
    manager = polled_manager(tmp_path, loader_factory=make_loader_factory(
        warmup=False, prefer_tflite_model=True))
    try:
        assert version_states(manager) == {1: State.END}
        status = manager.status(model_pb2.ModelSpec(name="m"))[0].status
        assert status.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "int8 table 'params'" in status.error_message and says in status.error_message, \
            status.error_message
    finally:
        manager.stop()
    with pytest.raises(ValueError, match=says):
        tflite.check_int8_tables(model)


def test_good_int8_tables_pass_the_check():
    assert tflite.check_int8_tables(_pkm_tflite(2)) == 1
    assert tflite.check_int8_tables(_pkm_tflite(1)) == 0   # fp32 table: nothing to check


def test_scalar_inputs_stay_scalars(tmp_path, tf_with_ops):
    """A rank-0 input reaches the interpreter as rank 0, as the SavedModel's Session gets it
    (np.ascontiguousarray made it [1]: y = 0.5x + 2 answered [3.0], and a scalar id, which
    the SavedModel refuses, was read as a bag of one)."""
    import tensorflow as tf
    from pkm_serve.serving.errors import ServingError
    from pkm_serve.serving.tflite_servable import TfLiteServable

    class HalfPlusTwo(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)])
        def f(self, x):
            return {"y": x * 0.5 + 2.0}

    module = HalfPlusTwo()
    hpt_model = tf.lite.TFLiteConverter.from_concrete_functions(
        [module.f.get_concrete_function()], module).convert()
    hpt_sig = TfLiteServable("hpt", 1, _write(str(tmp_path / "hpt"), 1, hpt_model)).signature("")
    y = hpt_sig.run({"x": np.array(2.0, np.float32)})["y"]
    assert y.shape == () and y == 0.5 * 2.0 + 2.0
    assert hpt_sig.run({"x": np.array([[2.0]], np.float32)})["y"].tolist() == [[3.0]]
    pkm_sig = TfLiteServable("pkm", 1, _write(str(tmp_path / "pkm"), 1, _pkm_tflite(1))).signature("")
    with pytest.raises(ServingError) as e:
        pkm_sig.run({"indices": np.array(3, np.int32), "weights": np.array(1.0, np.float32)})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rank >= 1" in e.value.message


def test_tflite_version_under_a_file_url_base_path(tmp_path, tf_with_ops):
    """--model_base_path=file:///... with --prefer_tflite_model: model.tflite was looked for
    with os.path (not there for a URL), so the version went to the SavedModel loader."""
    from pkm_serve.serving.loader import make_loader_factory
    path = _write(str(tmp_path / "pkm"), 1, _pkm_tflite(1))
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("pkm", 1, "file://" + path)
    loader.load()
    servable = loader.servable()
    try:
        assert servable.runtime == "TFLite"
        idx, w = _bags(np.random.default_rng(3), 5)
        got = servable.signature("").run({"indices": idx, "weights": w})
        np.testing.assert_allclose(next(iter(got.values())), _pkm_reference(1, idx, w), rtol=1e-5, atol=1e-5)
    finally:
        loader.unload()
