"""Round 34 parity checks against tensorflow_model_server, on one server (batching on) with
real gRPC and REST clients:
- allowed_batch_sizes are used in the order listed, as batching_session.cc's
  RoundToLowestAllowedBatchSize (a batch pads to the first entry that holds it), and only the
  last listed entry must equal max_batch_size (bundle_factory_util.cc): `8, 4` with
  max_batch_size 4 was refused at start-up here, since the sorted list ended at 8;
- Classify whose classes output is not DT_STRING fails as classifier.cc's check does;
- bfloat16 REST outputs print by their own shortest decimal (0.1, not float32's 0.100097656);
- an unknown output_filter name is refused in predict_util.cc's words."""
import json
import math
import urllib.error
import urllib.request
from fractions import Fraction

import grpc
import ml_dtypes
import numpy as np
import pytest
from tensorflow_serving.apis import classification_pb2, predict_pb2, prediction_service_pb2_grpc

from serving_helpers import ServerProcess, save_graph

from pkm_serve.serving.json_floats import shortest_float32_as_float64


def _save_rows_model(path):
    """y = 2x, and batch_rows: the rows the model ran on (its batch, padding included)."""
    import tensorflow as tf

    class Rows(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
        def run(self, x):
            n = tf.shape(x)[0]
            return {"y": x * 2.0, "batch_rows": tf.fill([n], n)}

    module = Rows()
    tf.saved_model.save(module, path, signatures={"serving_default": module.run})


def _save_bfloat16_model(path):
    import tensorflow as tf

    class Half(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
        def run(self, x):
            return {"y": tf.cast(x, tf.bfloat16)}

    module = Half()
    tf.saved_model.save(module, path, signatures={"serving_default": module.run})


def _save_integer_classes_model(path, classes_shape=(2,), string_scores=False):
    """A classification signature whose classes are class ids (int64), not labels (of
    `classes_shape` per example), and whose scores are floats or (string_scores) text."""
    import tensorflow as tf
    with tf.Graph().as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32)})["x"]
        ids = tf.reshape(tf.constant([0, 1], tf.int64), classes_shape)
        classes = tf.tile(ids[None], [tf.shape(x)[0]] + [1] * len(classes_shape))
        scores = tf.strings.as_string(x) if string_scores else tf.nn.softmax(x)
        info = tf.compat.v1.saved_model.build_tensor_info   # (classification_signature_def refuses ids)
        sig = tf.compat.v1.saved_model.build_signature_def(
            {"inputs": info(serialized)}, {"classes": info(classes), "scores": info(scores)},
            "tensorflow/serving/classify")
        save_graph(path, {"serving_default": sig})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity34")
    models = {"rows": _save_rows_model, "bf16": _save_bfloat16_model, "int_classes": _save_integer_classes_model,
              "int_classes_string_scores": lambda p: _save_integer_classes_model(p, (2,), string_scores=True),
              "int_classes_3d_string_scores": lambda p: _save_integer_classes_model(p, (1, 2), True)}
    entries = []
    for name, save in models.items():
        save(str(tmp / name / "1"))
        entries.append(f'config {{ name: "{name}" base_path: "{tmp / name}" model_platform: "tensorflow" }}')
    (tmp / "models.config").write_text("model_config_list { %s }\n" % " ".join(entries))
    # Listed out of order: upstream takes it (the last entry is max_batch_size) and pads a
    # batch of up to 4 rows to 8, the first entry that holds it.
    (tmp / "batching.config").write_text("max_batch_size { value: 4 } num_batch_threads { value: 1 }\n"
                                         "allowed_batch_sizes: 8 allowed_batch_sizes: 4\n")
    srv = ServerProcess(tmp, f"--model_config_file={tmp / 'models.config'}", "--file_system_poll_wait_seconds=0",
                        "--enable_batching", f"--batching_parameters_file={tmp / 'batching.config'}")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def _post(server, path, body):
    req = urllib.request.Request(server.rest_url + path, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _rows_request(x, *output_filter):
    import tensorflow as tf
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "rows"
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    req.output_filter.extend(output_filter)
    return req


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_batches_pad_to_the_first_listed_allowed_size_that_holds_them(server, stub, rows):
    import tensorflow as tf
    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    resp = stub.Predict(_rows_request(x), timeout=30)
    np.testing.assert_array_equal(tf.make_ndarray(resp.outputs["y"]), x * 2.0)
    # RoundToLowestAllowedBatchSize over [8, 4]: 8 is the first entry >= rows.
    assert tf.make_ndarray(resp.outputs["batch_rows"]).tolist() == [8] * rows
    status, answer = _post(server, "/v1/models/rows:predict", {"instances": x.tolist()})
    assert status == 200 and [p["batch_rows"] for p in answer["predictions"]] == [8] * rows


def test_only_the_last_listed_allowed_batch_size_must_be_max_batch_size(tmp_path):
    from pkm_serve.serving import config
    from pkm_serve.serving.server import Server, StartupError
    (tmp_path / "batching.config").write_text("max_batch_size { value: 8 } "
                                              "allowed_batch_sizes: 8 allowed_batch_sizes: 2")
    argv = [f"--model_base_path={tmp_path}", "--port=0", "--rest_api_port=1", "--load_pkm_ops=false",
            "--enable_batching", f"--batching_parameters_file={tmp_path / 'batching.config'}"]
    # bundle_factory_util.cc's words; sorted, the list ended at 8 and was taken.
    with pytest.raises(StartupError, match="Last entry in allowed_batch_sizes must match max_batch_size; "
                                           "last entry was 2; expected 8"):
        Server(config.parse_args(argv))


_UNKNOWN_NOSUCH = "output tensor alias not found in signature: nosuch Outputs expected to be in the set {batch_rows,y}."


@pytest.mark.parametrize("output_filter, message", [
    (("y", "nosuch"), _UNKNOWN_NOSUCH),
    # predict_util.cc checks the names in order, each for being known, then for a repeat.
    (("nosuch", "y", "y"), _UNKNOWN_NOSUCH),
    (("y", "y", "nosuch"), "duplicate output tensor alias: y"),
])
def test_a_bad_output_filter_is_refused_in_upstreams_words(stub, output_filter, message):
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(_rows_request(np.zeros((1, 3), np.float32), *output_filter), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message


def test_a_repeated_output_filter_name_for_an_unknown_model_is_not_found(stub):
    """The filter is checked against the signature, once the servable is found (it was refused
    as a repeat before the model was looked up)."""
    req = _rows_request(np.zeros((1, 3), np.float32), "y", "y")
    req.model_spec.name = "no_such_model"
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _example(x):
    import tensorflow as tf
    return tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x))}))


def test_classify_refuses_classes_that_are_not_strings(server, stub):
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "int_classes"
    req.input.example_list.examples.extend([_example([1.0, 2.0]), _example([3.0, 0.5])])
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "Expected classes Tensor of DT_STRING. Got: DT_INT64"
    status, answer = _post(server, "/v1/models/int_classes:classify", {"examples": [{"x": [1.0, 2.0]}]})
    assert status == 400 and answer["error"] == "Expected classes Tensor of DT_STRING. Got: DT_INT64"


@pytest.mark.parametrize("model, error", [
    ("int_classes_string_scores", "Expected classes Tensor of DT_STRING. Got: DT_INT64"),
    ("int_classes_3d_string_scores", "Expected Tensor shape: [batch_size num_classes] but got [2,1,2] ('classes')")])
def test_classify_checks_the_classes_before_the_scores(server, stub, model, error):
    """classifier.cc's PostProcessClassificationResult: the classes' rank, dtype and batch,
    then the scores'; string scores were named before int64 or 3-D classes here."""
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = model
    req.input.example_list.examples.extend([_example([1.0, 2.0]), _example([3.0, 0.5])])
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == error


def _shortest_bfloat16_decimal(value):
    """Brute force in exact rationals: of the decimals of fewest significant digits that read
    back as `value` (every one within two units of the last digit either side), the nearest;
    of two as near, the one whose last digit is even (as the vectorised path's np.rint)."""
    target, exact = ml_dtypes.bfloat16(value), Fraction(float(value))
    if exact == 0:
        return float(value)
    exponent = math.floor(math.log10(abs(exact)))
    exponent += (abs(exact) >= Fraction(10) ** (exponent + 1)) - (abs(exact) < Fraction(10) ** exponent)
    for digits in range(1, 18):
        unit = Fraction(10) ** (exponent - digits + 1)
        base = math.floor(exact / unit)
        reads_back = [m for m in range(base - 2, base + 4) if ml_dtypes.bfloat16(float(m * unit)) == target]
        if reads_back:
            return float(min(reads_back, key=lambda m: (abs(m * unit - exact), m % 2)) * unit)
    raise AssertionError(value)


def test_bfloat16_shortest_decimals_match_brute_force():
    """Every power of two (the per-element path beyond 1e-14..1e23 included: 2**-59 is 1.74e-18,
    not 1.735e-18) and a sample of other values print their shortest decimal."""
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    values = bits.view(ml_dtypes.bfloat16)
    values = values[np.isfinite(values.astype(np.float32))]
    powers = values[(values.view(np.uint16) & 0x7F) == 0]
    sample = np.concatenate([powers, np.random.default_rng(34).choice(values, 1500, replace=False)])
    got = shortest_float32_as_float64(sample, like=ml_dtypes.bfloat16)
    expected = [_shortest_bfloat16_decimal(v) for v in sample]
    wrong = [(float(v), g, e) for v, g, e in zip(sample, got, expected) if g != e]
    assert not wrong, wrong[:5]


def test_bfloat16_rest_outputs_print_their_shortest_decimal(server):
    x = [0.1, 0.2, 1 / 3, 3.14159, 100.7, -7.0, 65504.0, 1e20, -2.5e-30, 3e38, 1e-38]
    status, answer = _post(server, "/v1/models/bf16:predict", {"inputs": [x]})
    assert status == 200, answer
    expected = [_shortest_bfloat16_decimal(ml_dtypes.bfloat16(v)) for v in x]
    assert answer["outputs"] == [expected]
    assert answer["outputs"][0][:2] == [0.1, 0.2]   # float32's repr of those halves: 0.100097656, 0.20019531


@pytest.mark.parametrize("fill", [lambda inp: None, lambda inp: inp.example_list.SetInParent(),
                                  lambda inp: inp.example_list_with_context.context.SetInParent()],
                         ids=["no-kind", "empty-list", "context-only"])
def test_classify_without_examples_is_refused_in_upstreams_words(stub, fill):
    req = classification_pb2.ClassificationRequest()
    req.model_spec.name = "int_classes"
    fill(req.input)
    with pytest.raises(grpc.RpcError) as err:
        stub.Classify(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "Input is empty."   # util.cc's InputToSerializedExampleTensor


def test_an_unknown_version_label_is_refused_in_upstreams_words(server, stub):
    req = _rows_request(np.zeros((1, 3), np.float32))
    req.model_spec.version_label = "nope"
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    # ServerCore::GetModelVersionForLabel's words (http_rest_api_handler_test matches them).
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("Unrecognized servable version label: nope")
    status, answer = _post(server, "/v1/models/rows/labels/nope:predict", {"instances": [[1.0, 2.0, 3.0]]})
    assert status == 400 and answer["error"].startswith("Unrecognized servable version label: nope")


def test_a_version_not_served_is_not_found_in_upstreams_words(server, stub):
    req = _rows_request(np.zeros((1, 3), np.float32))
    req.model_spec.version.value = 7
    with pytest.raises(grpc.RpcError) as err:
        stub.Predict(req, timeout=30)
    # AspiredVersionsManager's words for a ServableRequest::Specific.
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details().startswith("Servable not found for request: Specific(rows, 7)")
