"""Fast in-process tests: flags, the shipped example configs, version policies,
the batch scheduler, REST JSON conversion and the TF Serving staging script."""
import os
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

from serving_helpers import REPO, run_concurrently
from pkm_serve.serving import config, protos, tensors
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.manager import aspired_versions


def _args(*argv):
    return config.parse_args(list(argv))


def test_flags_use_tf_serving_names_and_safe_defaults():
    a = _args("--model_base_path=/m", "--rest_api_port=8501", "--enable_batching",
              "--op_library=/a.so,/b.so", "--op_library", "/c.so")
    assert (a.port, a.rest_api_port, a.model_name, a.bind_address) == (8500, 8501, "default", "127.0.0.1")
    assert a.enable_batching is True and a.file_system_poll_wait_seconds == 1.0
    assert a.op_library == ["/a.so", "/b.so", "/c.so"]
    assert _args("--model_base_path=/m", "--enable_batching=false").enable_batching is False
    assert _args("--model_base_path=/m", "--grpc_channel_arguments=grpc.max_send_message_length=9, "
                 "grpc.primary_user_agent=x").grpc_channel_arguments == \
        [("grpc.max_send_message_length", 9), ("grpc.primary_user_agent", "x")]


@pytest.mark.parametrize("argv, needle", [
    ([], "give --model_base_path (with --model_name) or --model_config_file"),
    (["--model_base_path=/m", "--port=0"], "nothing to serve"),
    (["--model_base_path=/m", "--batching_parameters_file=/b"], "needs --enable_batching"),
    (["--model_base_path=/m", "--enable_per_model_batching_parameters"], "parameters needs --enable_batching"),
    (["--model_base_path=/m", "--enable_batching=maybe"], "expected true or false"),
    (["--model_base_path=/m", "--grpc_channel_arguments=a=1,foo"], "'foo' is not key=value"),
])
def test_bad_flags_are_rejected_with_a_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        config.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_shipped_example_configs_parse():
    cfg = config.read_model_config_file(os.path.join(REPO, "serving/configs/models.config"))
    names = [c.name for c in cfg.model_config_list.config]
    assert names == ["pkm", "pkm_pinned"]
    assert cfg.model_config_list.config[1].version_labels["canary"] == 2
    b = protos.parse_text_file(os.path.join(REPO, "serving/configs/batching.config"),
                               protos.BatchingParameters, "batching")
    assert b.max_batch_size.value == 32 and b.HasField("batch_timeout_micros")
    m = protos.parse_text_file(os.path.join(REPO, "serving/configs/monitoring.config"),
                               protos.MonitoringConfig, "monitoring")
    assert m.prometheus_config.enable and m.prometheus_config.path == "/monitoring/prometheus/metrics"


def test_bad_config_file_names_file_and_problem(tmp_path):
    bad = tmp_path / "models.config"
    bad.write_text("model_config_list { config { nmae: 'x' } }")
    with pytest.raises(ValueError, match=r"Error parsing text-format tensorflow.serving.ModelServerConfig from model config file .*models.config.*nmae"):
        config.read_model_config_file(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        config.read_model_config_file(str(tmp_path / "missing"))


def test_version_policies():
    from tensorflow_serving.config import model_server_config_pb2 as m
    present = {1: "", 2: "", 3: "", 5: ""}
    policy = m.ModelConfig().model_version_policy
    assert aspired_versions(policy, present) == {5}                    # default: latest 1
    policy.latest.num_versions = 2
    assert aspired_versions(policy, present) == {3, 5}
    policy.all.SetInParent()
    assert aspired_versions(policy, present) == {1, 2, 3, 5}
    policy.specific.versions.extend([2, 4])
    assert aspired_versions(policy, present) == {2}                    # 4 does not exist


class _FakeSignature:
    """Records the batch sizes it runs; output = input * 2 plus a per-row id check."""
    name = "serving_default"

    def __init__(self):
        self.batches = []
        self.lock = threading.Lock()

    def run(self, inputs, output_filter=()):
        x = inputs["x"]
        with self.lock:
            self.batches.append(x.shape[0])
        if np.any(x < 0):
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "negative input")
        return {"y": x * 2}


def _params(text):
    from google.protobuf import text_format
    return text_format.Parse(text, protos.BatchingParameters())


def test_batch_scheduler_merges_and_splits_back():
    sched = BatchScheduler(_params("max_batch_size { value: 8 } batch_timeout_micros { value: 200000 } "
                                   "num_batch_threads { value: 1 }"))
    sig = _FakeSignature()
    results = {}

    def call(i):
        results[i] = sched.run("servable", sig, {"x": np.full((1, 3), i, np.float32)})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sched.stop()
    assert sig.batches == [8]
    for i in range(8):
        np.testing.assert_array_equal(results[i]["y"], np.full((1, 3), 2 * i, np.float32))


def test_batch_scheduler_pads_to_allowed_sizes_and_isolates_bad_requests():
    sched = BatchScheduler(_params("max_batch_size { value: 8 } batch_timeout_micros { value: 200000 } "
                                   "num_batch_threads { value: 1 } allowed_batch_sizes: 4 allowed_batch_sizes: 8"))
    sig = _FakeSignature()
    out = {}

    def call(i, value):
        try:
            out[i] = sched.run("servable", sig, {"x": np.full((1, 2), value, np.float32)})
        except ServingError as e:
            out[i] = e

    threads = [threading.Thread(target=call, args=(i, -1.0 if i == 1 else float(i))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sched.stop()
    assert sig.batches[0] == 4                      # 3 rows padded up to the allowed size 4
    assert isinstance(out[1], ServingError) and out[1].code == grpc.StatusCode.INVALID_ARGUMENT
    np.testing.assert_array_equal(out[0]["y"], [[0.0, 0.0]])
    np.testing.assert_array_equal(out[2]["y"], [[4.0, 4.0]])


class _BuggySignature(_FakeSignature):
    """A negative row fails its batch with INVALID_ARGUMENT (so each request is rerun alone),
    and fails alone with a KeyError: a model bug, not a ServingError."""

    def run(self, inputs, output_filter=()):
        x = inputs["x"]
        with self.lock:
            self.batches.append(x.shape[0])
        if np.any(x < 0):
            if x.shape[0] > 1:
                raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "negative input")
            raise KeyError("model bug")
        return {"y": x * 2}


def test_batch_scheduler_survives_non_serving_errors():
    sched = BatchScheduler(_params("max_batch_size { value: 8 } batch_timeout_micros { value: 200000 } "
                                   "num_batch_threads { value: 1 }"))
    sig = _BuggySignature()

    def round_of(values):
        return run_concurrently(sched, sig, values, width=2, seconds=10)

    out = round_of([0.0, -1.0, 2.0])            # batch fails, the reruns: ok, KeyError, ok
    assert sig.batches[0] == 3
    assert isinstance(out[1], ServingError) and out[1].code == grpc.StatusCode.INTERNAL, out[1]
    assert "KeyError" in out[1].message
    np.testing.assert_array_equal(out[0]["y"], [[0.0, 0.0]])
    np.testing.assert_array_equal(out[2]["y"], [[4.0, 4.0]])
    out = round_of([-1.0])                      # a lone request's KeyError
    assert isinstance(out[0], ServingError) and out[0].code == grpc.StatusCode.INTERNAL, out[0]
    out = round_of([3.0, 4.0])                  # the (only) batch thread is still alive
    np.testing.assert_array_equal(out[0]["y"], [[6.0, 6.0]])
    np.testing.assert_array_equal(out[1]["y"], [[8.0, 8.0]])
    sched.stop()
    assert all(t.is_alive() is False for t in sched._threads)


class _BagSignature:
    """A [-1, 3] ids signature of an embedding bag over TABLE (D = 8): ids [K] are one bag
    ([D] out), ids [B, K] B bags, as PkmEmbeddingBag pools them."""
    name = "serving_default"
    TABLE = np.random.default_rng(5).standard_normal((20, 8))

    def __init__(self, declared=True):
        import tensorflow as tf
        from tensorflow.core.protobuf import meta_graph_pb2
        self.input_specs = {"ids": tf.TensorSpec([None, 3] if declared else [], tf.int32)}
        self.signature_def = meta_graph_pb2.SignatureDef()
        self.signature_def.inputs["ids"].name = "ids:0"
        if declared:
            self.signature_def.inputs["ids"].tensor_shape.dim.add(size=-1)
            self.signature_def.inputs["ids"].tensor_shape.dim.add(size=3)
        self.batches = []

    def run(self, inputs, output_filter=()):
        self.batches.append(inputs["ids"].shape)
        return {"out": self.TABLE[inputs["ids"]].sum(axis=-2)}


@pytest.mark.parametrize("params, sizes", [
    ("max_batch_size { value: 8 } allowed_batch_sizes: 8", [3]),   # padded to 8 = D
    ("max_batch_size { value: 8 }", [4, 4]),                        # two bags of 4: 8 ids = D
])
def test_batch_scheduler_runs_a_request_without_the_batch_dimension_alone(params, sizes):
    """ids of another rank than the signature's: dimension 0 is no batch, so merging or padding
    it pooled requests' (and the padding's) ids into one bag and gave each a slice of it."""
    sched = BatchScheduler(_params(params + " batch_timeout_micros { value: 100000 } "
                                   "num_batch_threads { value: 1 }"))
    sig = _BagSignature()
    rng = np.random.default_rng(6)
    ids = [rng.integers(0, 20, k).astype(np.int32) for k in sizes]
    out = {}
    threads = [threading.Thread(target=lambda i: out.__setitem__(i, sched.run("s", sig, {"ids": ids[i]})),
                                args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sched.stop()
    for i, bag in enumerate(ids):
        np.testing.assert_allclose(out[i]["out"], sig.TABLE[bag].sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("declared", [True, False])   # False: a TensorInfo without a shape
def test_batch_scheduler_still_merges_requests_of_the_signature_rank(declared):
    sched = BatchScheduler(_params("max_batch_size { value: 8 } batch_timeout_micros { value: 200000 } "
                                   "num_batch_threads { value: 1 }"))
    sig = _BagSignature(declared)
    ids = [np.array([[i, i + 1, i + 2]], np.int32) for i in range(2)]
    out = {}
    threads = [threading.Thread(target=lambda i: out.__setitem__(i, sched.run("s", sig, {"ids": ids[i]})),
                                args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    sched.stop()
    assert sig.batches == [(2, 3)]
    for i in range(2):
        np.testing.assert_allclose(out[i]["out"], sig.TABLE[ids[i]].sum(axis=1), rtol=1e-12)


def test_batch_scheduler_queue_is_bounded():
    sched = BatchScheduler(_params("max_batch_size { value: 1 } num_batch_threads { value: 1 } "
                                   "max_enqueued_batches { value: 1 }"))
    gate = threading.Event()
    sig = _FakeSignature()
    plain_run = sig.run
    sig.run = lambda inputs, output_filter=(): (gate.wait(10), plain_run(inputs))[1]
    one = {"x": np.ones((1, 1), np.float32)}
    running = threading.Thread(target=sched.run, args=("s", sig, one))   # occupies the only batch thread
    running.start()
    time.sleep(0.3)
    queued = threading.Thread(target=sched.run, args=("s", sig, one))    # fills the only queue slot
    queued.start()
    time.sleep(0.3)
    with pytest.raises(ServingError) as err:
        sched.run("s", sig, one)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "full" in err.value.message
    gate.set()
    running.join(10)
    queued.join(10)
    sched.stop()
    assert sig.batches == [1, 1]


@pytest.mark.parametrize("value, dtype, needle", [
    ([[1, 2], [3]], "float32", "ragged"),
    ([1.5], "int64", "JSON Value: 1.5 Type: Number is not of expected type: int64"),
    ([2 ** 40], "int32", "JSON Value: 1099511627776 Type: Number is not of expected type: int32"),
    # Beside a small int, 2^63 makes the array float64, whose float(int64 max) is 2^63 itself.
    ([1, 2 ** 63], "int64", "JSON Value: 9223372036854775808 Type: Number is not of expected type: int64"),
    ([1, 2 ** 31], "int32", "JSON Value: 2147483648 Type: Number is not of expected type: int32"),
    # Past 64 bits numpy keeps Python objects (this said "ragged or mixes types").
    ([1, 2 ** 70], "int64", r"JSON Value: 1.18059162e\+21 Type: Number is not of expected type: int64"),
    ([[1, 2 ** 70], [3, 4]], "int32", r"JSON Value: 1.18059162e\+21 Type: Number is not of expected type: int32"),
    ([[1], [2 ** 70, 3]], "float32", "is ragged"),
    ([1, 2], "string", "holds 1, which is not of the signature's type string"),
    ([None], "string", "holds null"),
    (["a"], "float32", 'JSON Value: "a" Type: String is not of expected type: float'),
    ([True], "float32", "JSON Value: true Type: True is not of expected type: float"),
])
def test_rest_json_conversion_refuses_lossy_casts(value, dtype, needle):
    import tensorflow as tf
    with pytest.raises(ServingError, match=needle):
        tensors.from_json("x", value, tf.TensorSpec([None], getattr(tf, dtype)))


@pytest.mark.parametrize("value, dtype, needle", [
    # TF Serving's json_tensor.cc: integer inputs take JSON integers only ...
    ([1.0], "int64", "JSON Value: 1.0 Type: Number is not of expected type: int64"),
    ([9007199254740993, 1.0], "int64", "JSON Value: 1.0 Type: Number is not of expected type: int64"),
    ([[1, 2]], "int32", None),
    ([2147483647.0], "int32", "JSON Value: 2.14748365e+09 Type: Number is not of expected type: int32"),
    # ... and IsLosslessDecimal: an integer must be held exactly (|n| < 2^24 for float,
    # 2^53 for double), a double must lie in the type's range; NaN/Infinity pass.
    ([16777217], "float32", "Cannot convert JSON value: 16777217 to float without loss of precision."),
    ([16777215, -16777215], "float32", None),
    ([0.5, 16777217], "float32", "Cannot convert JSON value: 16777217 to float without loss of precision."),
    ([1e300], "float32", "Cannot convert JSON value: 1e+300 to float without loss of precision."),
    ([-1e39], "float32", "Cannot convert JSON value: -1e+39 to float without loss of precision."),
    ([1e300], "float64", None),
    ([9007199254740993, 0.5], "float64",
     "Cannot convert JSON value: 9007199254740993 to double without loss of precision."),
    ([float("nan"), float("inf"), float("-inf"), 0.1], "float32", None),
    ([1.5, 2 ** 70], "float32", None),
])
def test_rest_json_values_that_would_change_are_refused_as_tf_serving_does(value, dtype, needle):
    import tensorflow as tf
    spec = tf.TensorSpec(None, getattr(tf, dtype))
    if needle is None:
        arr = tensors.from_json("x", value, spec)
        np.testing.assert_array_equal(arr, np.array(value, getattr(np, dtype)))
        return
    with pytest.raises(ServingError) as err:
        tensors.from_json("x", value, spec)
    assert needle in err.value.message and err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("value, needle", [
    (1e300, "Cannot convert JSON value: 1e+300 to float without loss of precision."),
    ([0.5, -1e39], "Cannot convert JSON value: -1e+39 to float without loss of precision."),
    ([1, 2.5], "Unexpected element type in feature: f expecting type: int64"),
    ([2.5, 16777217], "Unexpected element type in feature: f expecting type: float"),
    (2 ** 63, "Feature: f has uint64 element. Only int64 is supported."),
])
def test_rest_example_features_that_would_change_are_refused(value, needle):
    from pkm_serve.serving import rest_frontend
    with pytest.raises(ServingError) as err:
        rest_frontend._example({"f": value})
    assert needle in err.value.message


def test_rest_example_features_kept_exactly():
    from pkm_serve.serving import rest_frontend
    ex = rest_frontend._example({"i": [16777217, True], "f": [0.5, float("inf")], "s": ["a", {"b64": "AAE="}]})
    assert list(ex.features.feature["i"].int64_list.value) == [16777217, 1]
    assert list(ex.features.feature["f"].float_list.value) == [0.5, float("inf")]
    assert list(ex.features.feature["s"].bytes_list.value) == [b"a", b"\x00\x01"]


def test_rest_json_integer_past_64_bits_reads_as_a_double_for_a_float_input():
    import tensorflow as tf
    arr = tensors.from_json("x", [1.5, 2 ** 70], tf.TensorSpec([None], tf.float32))
    np.testing.assert_array_equal(arr, np.array([1.5, 2.0 ** 70], np.float32))


def test_rest_json_b64_round_trip():
    import tensorflow as tf
    arr = tensors.from_json("s", [{"b64": "AAE="}, "text"], tf.TensorSpec([None], tf.string))
    assert list(arr) == [b"\x00\x01", b"text"]
    assert tensors.to_json("s_bytes", arr) == [{"b64": "AAE="}, {"b64": "dGV4dA=="}]


def test_tensor_proto_fast_path_matches_tensorflow():
    import tensorflow as tf
    for a in (np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(5, dtype=np.int64),
              np.zeros((0, 3), np.int32), np.array([True, False])):
        p = tensors.to_proto(a)
        np.testing.assert_array_equal(tf.make_ndarray(p), a)
        np.testing.assert_array_equal(tensors.from_proto("x", tf.make_tensor_proto(a)), a)
    bad = tf.make_tensor_proto(np.ones((2, 2), np.float32))
    bad.tensor_content = bad.tensor_content[:-1]
    with pytest.raises(ServingError, match="holds 15 bytes"):
        tensors.from_proto("x", bad)


def test_stage_script_links_the_op_into_a_tf_serving_tree(tmp_path):
    servers = tmp_path / "tensorflow_serving" / "model_servers"
    servers.mkdir(parents=True)
    (servers / "BUILD").write_text('SUPPORTED_TENSORFLOW_OPS = if_v2([]) + [\n    "@org_tensorflow_text//x:y",\n]\n')
    script = os.path.join(REPO, "serving/tf_serving/stage_into_tf_serving.sh")
    for _ in range(2):   # idempotent
        subprocess.run([script, REPO, str(tmp_path)], check=True, capture_output=True)
    text = (servers / "BUILD").read_text()
    assert text.count('"//tensorflow_serving/custom_ops/pkm:pkm_ops"') == 1
    assert text.startswith('SUPPORTED_TENSORFLOW_OPS = ["//tensorflow_serving/custom_ops/pkm:pkm_ops"] + if_v2([])')
    ops = tmp_path / "tensorflow_serving" / "custom_ops" / "pkm"
    assert (ops / "BUILD").read_text() == open(os.path.join(REPO, "serving/tf_serving/BUILD.pkm_ops")).read()
    for rel in ("kernels/core/embedding_bag.h", "kernels/tf/embedding_bag_ops.cc", "kernels/cuda/forward.cu"):
        assert (ops / rel).exists(), rel
    assert not list(ops.glob("kernels/*/*_test.cc")) and not list(ops.glob("kernels/*/*.mk"))
    bad = subprocess.run([script, REPO, str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert bad.returncode != 0


def test_startup_errors_are_one_clear_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    # The main() that `pkm-serve serve` runs and whose status it exits with, in-process (the
    # console script's own process, a start-up error's exit status and stderr:
    # tests/cli/test_cli.py::test_serve_error_is_one_line); signal handlers and the logging
    # set-up stay the test process's.
    import logging

    from pkm_serve import cli
    from pkm_serve.serving import server
    monkeypatch.setattr(server._Wakeups, "install", lambda self, signals: None)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    monkeypatch.setattr(cli, "_verbose", False)
    status = server.main([f"--model_base_path={tmp_path}", "--op_library=/nonexistent/libfoo.so",
                          "--port=0", "--rest_api_port=1"])
    assert status == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["pkm-serve serve: error: --op_library '/nonexistent/libfoo.so' does not exist"], lines


@pytest.mark.parametrize("files, needle", [
    ({"batching.config": "max_batch_size { value: 0 }"}, "must be positive"),
    ({"batching.config": "max_batch_size { value: 8 } allowed_batch_sizes: 4"}, "must match max_batch_size"),
    ({"monitoring.config": "prometheus_config { enabel: true }"}, "enabel"),
    ({"ssl.config": "server_key: 'k'"}, "needs server_key and server_cert"),
])
def test_bad_config_files_fail_startup_with_a_message(tmp_path, files, needle):
    from pkm_serve.serving.server import Server, StartupError
    argv = [f"--model_base_path={tmp_path}", "--port=0", "--rest_api_port=1", "--load_pkm_ops=false"]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        flag = {"batching.config": "--batching_parameters_file", "monitoring.config": "--monitoring_config_file",
                "ssl.config": "--ssl_config_file"}[name]
        argv.append(f"{flag}={tmp_path / name}")
        if name == "batching.config":
            argv.append("--enable_batching")
    with pytest.raises(StartupError, match=needle):
        Server(config.parse_args(argv))


def test_grpc_response_is_not_capped_by_the_request_limit():
    """TF Serving sets gRPC's message limit to kint32max both ways: --max_request_bytes
    bounds what a client sends, not the size of the answer."""
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    from pkm_serve.serving.grpc_frontend import GrpcFrontend

    class _BigAnswers:
        def predict(self, request, deadline=None):
            resp = predict_pb2.PredictResponse()
            resp.outputs["y"].tensor_content = b"\0" * (64 << 10)   # 64 KiB answer
            return resp

        classify = regress = multi_inference = get_model_metadata = predict

    frontend = GrpcFrontend(_BigAnswers(), None, address="127.0.0.1", port=0, max_threads=2,
                            max_message_bytes=4096)
    frontend.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as ch:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
            resp = stub.Predict(predict_pb2.PredictRequest(model_spec={"name": "m"}), timeout=30)
            assert len(resp.outputs["y"].tensor_content) == 64 << 10
            big = predict_pb2.PredictRequest()
            big.inputs["x"].tensor_content = b"\0" * 8192            # the request limit still holds
            with pytest.raises(grpc.RpcError) as err:
                stub.Predict(big, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        frontend.stop(0, 10)


def test_rest_input_mismatch_names_only_what_is_missing_or_unknown():
    # "missing input(s) ['w'] / unknown input(s) []": the empty part was printed too. A missing
    # input is named in json_tensor.cc's words (FillTensorMapFromInstancesList / ...InputsMap).
    import tensorflow as tf

    from pkm_serve.serving.rest_frontend import RestFrontend

    specs = {name: tf.TensorSpec([None], tf.float32) for name in ("ids", "w")}
    with pytest.raises(ServingError, match=r"Failed to process element: 0 of 'instances' list. JSON object: "
                                           r'\{"ids":\[1.0\]\} keys must be equal to: ids,w$'):
        RestFrontend._rows_to_inputs([{"ids": [1.0]}], specs)
    with pytest.raises(ServingError, match=r"INVALID_ARGUMENT: Missing named input: w in 'inputs' object.$"):
        RestFrontend._columns_to_inputs({"ids": [1.0], "x": [2.0]}, specs)
    with pytest.raises(ServingError, match=r"INVALID_ARGUMENT: \"inputs\" has unknown input\(s\) \['x'\];"):
        RestFrontend._columns_to_inputs({"ids": [1.0], "w": [1.0], "x": [2.0]}, specs)
    assert tensors.input_mismatch(["a"], ["a"]) == ""


def test_a_version_of_model_tflite_alone_names_prefer_tflite_model(tmp_path):
    # Without --prefer_tflite_model it was TF's "SavedModel file does not exist" alone.
    from pkm_serve.serving.loader import make_loader_factory

    (tmp_path / "model.tflite").write_bytes(b"\0" * 16)
    with pytest.raises(ServingError, match=r"holds model.tflite but no SavedModel: serve it with "
                                           r"--prefer_tflite_model=true"):
        make_loader_factory(warmup=False)("m", 1, str(tmp_path)).load()
