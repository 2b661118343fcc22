"""Round 37 parity checks against tensorflow_model_server, on one in-process REST front end
(requests as the client) and in-process managers:
- a key spelled twice in a body (or in its "inputs" object) stands for its first value, as
  json_tensor.cc reads it with rapidjson's FindMember (Python's json kept the last); a name
  counts as repeated only where it is spelled twice as a key;
- the body is decoded as TF Serving's evhttp request decodes it (NeedUncompressGzipContent):
  gunzipped where Content-Encoding contains "gzip" (bytes past the gzip stream refused, as
  its ZLib refuses extra data), read as sent under any other encoding;
- the body is parsed as rapidjson 1.1.0 parses it: Inf/-Inf/-NaN, string bytes that are not
  UTF-8, a lone low-surrogate escape as its three UTF-8 bytes, a blank body's empty-document
  error; such bytes in a signature or feature name are a 400 (not a 500), and answers stay
  valid UTF-8;
- "instances" faults are reported element by element, as AddInstanceItem meets them, and
  {"b64": ...} is read as IsValBase64Object reads it;
- a model removed and re-added lists its ended versions (ServableStateMonitor keeps them);
- paths outside /v1/ are Not Found; metrics carry TF Serving's counter names; the method
  name check covers Predict."""
import gzip
import math

import numpy as np
import pytest
import requests

from serving_helpers import polled_manager, save_graph, version_states


def _save_model(path):
    """serving_default: x float [n, 2] -> y = 2x; "i32": i int32 [n] -> j = i + 1;
    "two": a, b float [n] -> c = a + b; "str": s string [n] -> t = its length in bytes;
    "as_classify" and "nomethod": serving_default's, with method_name classify and none."""
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        i = v1.placeholder(tf.int32, [None], name="i")
        a = v1.placeholder(tf.float32, [None], name="a")
        b = v1.placeholder(tf.float32, [None], name="b")
        text = v1.placeholder(tf.string, [None], name="s")
        info = v1.saved_model.build_tensor_info

        def sig(inputs, outputs, method="tensorflow/serving/predict"):
            return v1.saved_model.build_signature_def({k: info(v) for k, v in inputs.items()},
                                                      {k: info(v) for k, v in outputs.items()}, method)
        save_graph(path, {"serving_default": sig({"x": x}, {"y": 2.0 * x}),
                          "i32": sig({"i": i}, {"j": i + 1}),
                          "two": sig({"a": a, "b": b}, {"c": a + b}),
                          "str": sig({"s": text}, {"t": tf.strings.length(text)}),
                          "as_classify": sig({"x": x}, {"y": 2.0 * x}, "tensorflow/serving/classify"),
                          "nomethod": sig({"x": x}, {"y": 2.0 * x}, "")})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(REST predict URL, InferenceService) over one in-process server of the model, run as
    with --enable_signature_method_name_check (only "nomethod" has a method it refuses)."""
    from pkm_serve.serving.rest_frontend import RestFrontend
    from pkm_serve.serving.service import InferenceService
    base = tmp_path_factory.mktemp("parity37") / "m"
    _save_model(str(base / "1"))
    manager = polled_manager(base)
    service = InferenceService(manager, check_signature_method_name=True)
    frontend = RestFrontend(service, None, None, address="127.0.0.1", port=0, num_threads=2,
                            timeout_ms=0, max_body_bytes=1 << 20, drain_seconds=1)
    frontend.start()
    try:
        yield f"http://127.0.0.1:{frontend.port}/v1/models/m:predict", service
    finally:
        frontend.stop()
        manager.stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def _post(url, data, **headers):
    r = requests.post(url, data=data, headers=headers, timeout=30)
    return r.status_code, r.json()


@pytest.mark.parametrize("body, answer", [
    (b'{"instances": [[1, 2]], "instances": [[3, 4]]}', {"predictions": [[2.0, 4.0]]}),
    (b'{"inputs": [[1, 2]], "inputs": [[3, 4]]}', {"outputs": [[2.0, 4.0]]}),
    (b'{"signature_name": "i32", "signature_name": "two", "instances": [1]}', {"predictions": [2]}),
    (b'{"signature_name": "two", "inputs": {"a": [1], "b": [2], "a": [5]}}', {"outputs": [3.0]}),
])
def test_a_repeated_key_stands_for_its_first_value(url, body, answer):
    assert _post(url, body) == (200, answer)


@pytest.mark.parametrize("encoding", ["br", "deflate", "identity", "compress"])
def test_a_body_under_an_encoding_other_than_gzip_is_read_as_sent(url, encoding):
    body = b'{"instances": [[1, 2]]}'
    assert _post(url, body, **{"Content-Encoding": encoding}) == (200, {"predictions": [[2.0, 4.0]]})
    # Bytes that are not JSON: a JSON parse error in TF Serving's JSON error form.
    code, answer = _post(url, b"\x8b\x0b\x80" + body, **{"Content-Encoding": encoding})
    assert code == 400 and answer["error"].startswith("JSON Parse error"), answer


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip"])
def test_a_gzip_body_is_gunzipped_and_bounded(url, encoding):
    body = b'{"instances": [[1, 2]]}'
    assert _post(url, gzip.compress(body), **{"Content-Encoding": encoding}) == (200, {"predictions": [[2.0, 4.0]]})
    code, answer = _post(url, gzip.compress(body)[:-12], **{"Content-Encoding": encoding})
    assert code == 400 and answer["error"].startswith("cannot read the request body") and "gzip" in answer["error"]
    # Bytes past the gzip stream (a second member, junk) are refused, as upstream's ZLib refuses
    # "extra data" (they were dropped: the first member's JSON was served).
    for tail in (gzip.compress(b" "), b"junk"):
        code, answer = _post(url, gzip.compress(body) + tail, **{"Content-Encoding": encoding})
        assert code == 400 and "bytes follow the end of the gzip stream" in answer["error"], answer
    # No body at all is the empty document, as without gzip (it was a gzip stream ending early).
    assert _post(url, b"", **{"Content-Encoding": encoding}) == (400, {"error": "JSON Parse error: The document is empty"})
    # The server's limit (1 MiB here) holds for the gunzipped body, not only for the bytes sent.
    bomb = gzip.compress(b'{"instances": [[1, 2]], "pad": "' + b" " * (2 << 20) + b'"}')
    code, answer = _post(url, bomb, **{"Content-Encoding": encoding})
    assert code == 413 and "larger than the limit of 1048576 bytes" in answer["error"], answer


def test_a_re_added_model_lists_its_ended_versions_beside_its_new_ones(tmp_path):
    """GetModelStatus reads ServableStateMonitor's states, kept per model name for every version
    that had one (servable_state_monitor.cc adds to states_, its ForgetUnloadedServableStates is
    not called by the server): a model removed by a reload and re-added lists its old version
    END beside the new one (the old one was forgotten here); a version that had failed is tried
    again, as upstream's manager loads a re-aspired version afresh."""
    import grpc
    from tensorflow_serving.apis.get_model_status_pb2 import ModelVersionStatus
    from tensorflow_serving.config import model_server_config_pb2
    from test_serving_manager_fakes import Fakes

    from pkm_serve.serving.errors import ServingError
    State = ModelVersionStatus.State
    fakes = Fakes(tmp_path / "m")
    fakes.add_version(1)
    manager = polled_manager(fakes.base, loader_factory=fakes.factory)
    try:
        config = model_server_config_pb2.ModelServerConfig()
        config.model_config_list.config.add(name="m", base_path=str(fakes.base), model_platform="tensorflow")
        none = model_server_config_pb2.ModelServerConfig()
        none.model_config_list.SetInParent()
        manager.apply_config(none)
        fakes.add_version(2)
        manager.apply_config(config)
        assert version_states(manager) == {2: State.AVAILABLE, 1: State.END}
        # Version 2 failed before the model left: re-added, it loads again (its files unchanged).
        manager.apply_config(none)
        fakes.failures[3] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, "bad graph")
        fakes.add_version(3)
        with pytest.raises(ServingError, match="Some models did not become available"):
            manager.apply_config(config)
        assert version_states(manager) == {3: State.END, 2: State.END, 1: State.END}
        manager.apply_config(none)
        fakes.failures.clear()
        manager.apply_config(config)
        assert version_states(manager) == {3: State.AVAILABLE, 2: State.END, 1: State.END}
    finally:
        manager.stop()


_ELEMENT = "Failed to process element: {} of 'instances' list. Error: INVALID_ARGUMENT: "
_KEY = "Failed to process element: {} key: {} of 'instances' list. Error: INVALID_ARGUMENT: "
_NOT_FLOAT = "JSON Value: {} Type: {} is not of expected type: float"


@pytest.mark.parametrize("body, message", [
    # Element 0's bad value comes before element 1's unknown key (that was reported).
    ({"signature_name": "two", "instances": [{"a": "bad", "b": 1}, {"z": 1}]},
     _KEY.format(0, "a") + _NOT_FLOAT.format('"bad"', "String")),
    # Within one element, its keys in their order: b's value before the unknown z.
    ({"signature_name": "two", "instances": [{"a": 1, "b": 2}, {"b": [1], "z": 1}]},
     _KEY.format(1, "b") + "Expecting shape [] but got: [1]"),
    # Element 1's value before element 2's missing key, across inputs (b before a's input order).
    ({"signature_name": "two", "instances": [{"a": 1, "b": 2}, {"b": True, "a": 1}, {"a": 1}]},
     _KEY.format(1, "b") + "JSON Value: true Type: True is not of expected type: float"),
    ({"signature_name": "two", "instances": [{"a": 1, "b": 2}, {"a": 1}, {"a": 1, "b": "x"}]},
     "Failed to process element: 1 of 'instances' list. JSON object: {\"a\":1} keys must be equal to: a,b"),
    # A value fault before a list/object mismatch further on.
    ({"signature_name": "two", "instances": [{"a": None, "b": 2}, [1, 2]]},
     _KEY.format(0, "a") + _NOT_FLOAT.format("null", "Null")),
    # {"b64": ...} for a float input: a type error of an Object, ragged beside numbers or not.
    ({"instances": [[1, 2], {"b64": "AAAA"}]}, _ELEMENT.format(1) + _NOT_FLOAT.format('{"b64":"AAAA"}', "Object")),
    ({"instances": [{"b64": "AAAA"}]}, _ELEMENT.format(0) + _NOT_FLOAT.format('{"b64":"AAAA"}', "Object")),
    ({"inputs": {"b64": "AAAA"}}, _NOT_FLOAT.format('{"b64":"AAAA"}', "Object")),
    # A "b64" key not holding a string: no base64 object (IsValBase64Object), but a named
    # instance, or a leaf not formatted for base64.
    ({"signature_name": "str", "instances": [{"b64": 5}]},
     _KEY.format(0, "b64") + "JSON object: does not have named input: b64"),
    ({"signature_name": "str", "instances": [[{"b64": 5}]]},
     _ELEMENT.format(0) + 'JSON Value: {"b64":5} not formatted correctly for base64 data'),
    ({"signature_name": "str", "inputs": [{"b64": "!!"}]}, 'Unable to base64 decode (JSON Value: {"b64":"!!"})'),
])
def test_instance_faults_are_reported_element_by_element(url, body, message):
    import json
    code, answer = _post(url, json.dumps(body))
    assert code == 400 and answer["error"].startswith(message), answer


@pytest.mark.parametrize("body", [b"   ", b"\n\t\r "])
def test_a_blank_body_is_an_empty_document_at_its_end(url, body):
    """rapidjson skips the blanks, then finds no value: kParseErrorDocumentEmpty at the offset
    past them, in json_tensor.cc's ParseJson words (Python's "Expecting value: line 1 ...")."""
    assert _post(url, body) == (400, {"error": f"JSON Parse error: The document is empty. at offset: {len(body)}"})


@pytest.mark.parametrize("spelling, value", [(b"Inf", math.inf), (b"-Inf", -math.inf), (b"-NaN", math.nan),
                                             (b"Infinity", math.inf), (b"-Infinity", -math.inf), (b"NaN", math.nan)])
def test_non_finite_numbers_are_read_as_rapidjson_spells_them(url, spelling, value):
    """json_tensor.cc parses with kParseNanAndInfFlag: rapidjson reads Inf and -NaN too
    (Python's json only NaN, Infinity, -Infinity: the others were a parse error)."""
    code, answer = _post(url, b'{"instances": [[' + spelling + b", 1]]}")
    assert code == 200, answer
    np.testing.assert_array_equal(answer["predictions"], 2.0 * np.array([[value, 1.0]]))
    # Inside a string, the same letters are text, never a number.
    assert _post(url, b'{"signature_name": "str", "instances": ["' + spelling + b'"]}') == (
        200, {"predictions": [len(spelling)]})


def test_string_bytes_that_are_not_utf8_reach_the_tensor_as_sent(url):
    """rapidjson (no kParseValidateEncodingFlag) keeps such bytes: a Latin-1 "caf\xe9" is a
    4-byte string tensor upstream (it was a 400 'utf-8' codec error here)."""
    texts = [b"caf\xe9", b"\xff\xfe", b"ok"]
    body = b'{"signature_name": "str", "instances": ["' + b'", "'.join(texts) + b'"]}'
    assert _post(url, body) == (200, {"predictions": [len(t) for t in texts]})
    code, answer = _post(url, b'{"instances": [[1, 2]]} \xe9')   # outside a string: still a parse error
    assert code == 400 and answer["error"].startswith("JSON Parse error"), answer


@pytest.mark.parametrize("path", ["//v1/models/m", "/v2/models/m", "/models/m"])
def test_a_path_outside_v1_is_not_found_not_malformed(url, path):
    """TF Serving's dispatcher takes only paths matching (?i)/v1/.*; others get evhttp's 404
    "Not Found". Its "Malformed request" words belong to its handler's 400 (they were used here)."""
    r = requests.get(url.split("/v1/")[0] + path, timeout=30)
    assert r.status_code == 404 and r.json()["error"].startswith(f"Not Found: GET {path} "), r.text


def test_metrics_are_exposed_under_tf_servings_names():
    """prometheus_exporter.cc writes a counter as `NAME{labels} value` under `# TYPE NAME counter`
    and no `_created` series; prometheus_client wrote NAME_total (a query for TF Serving's
    :tensorflow:serving:request_count found nothing) and NAME_created gauges."""
    from pkm_serve.serving.metrics import Metrics
    metrics = Metrics()
    for status in ("OK", "OK", "NOT_FOUND"):
        metrics.request("m", "predict", "REST", status, 0.002)
    metrics.load_attempt("m", "/models/m/1", ok=True, seconds=1.0)
    text = metrics.exposition()[0].decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples[':tensorflow:serving:request_count{model_name="m",status="OK"}']) == 2
    assert float(samples[':tensorflow:serving:request_count{model_name="m",status="NOT_FOUND"}']) == 1
    assert float(samples[':tensorflow:cc:saved_model:load_attempt_count{model_path="/models/m/1",status="success"}']) == 1
    assert "# TYPE :tensorflow:serving:request_count counter" in text.splitlines()
    assert "_total" not in text and "_created" not in text, text
    # Histograms keep their _bucket/_sum/_count series, as upstream's.
    assert float(samples[':tensorflow:serving:request_latency_count{API="predict",entrypoint="REST",model_name="m"}']) == 3


def test_the_method_name_check_covers_predict(served):
    """With --enable_signature_method_name_check, predict_util.cc's VerifySignature refuses a
    Predict signature whose method_name is not predict, classify or regress (INTERNAL, after
    the JSON is read over REST); it was served here."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    from pkm_serve.serving.errors import ServingError
    url, service = served
    message = ("Expected prediction signature method_name to be one of {tensorflow/serving/predict, "
               "tensorflow/serving/classify, tensorflow/serving/regress}. Was: ")
    assert _post(url, b'{"signature_name": "nomethod", "instances": [[1, 2]]}') == (500, {"error": message})
    # The JSON's faults come first, as FillPredictRequestFromJson runs before Predict.
    code, answer = _post(url, b'{"signature_name": "nomethod", "instances": [["a", 2]]}')
    assert code == 400 and "is not of expected type: float" in answer["error"], answer
    assert _post(url, b'{"signature_name": "as_classify", "instances": [[1, 2]]}') == (
        200, {"predictions": [[2.0, 4.0]]})
    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "m", "nomethod"
    request.inputs["z"].CopyFrom(tf.make_tensor_proto([[1.0, 2.0]]))   # (the method is checked first)
    with pytest.raises(ServingError) as err:
        service.predict(request)
    assert (err.value.code, err.value.message) == (grpc.StatusCode.INTERNAL, message)


@pytest.mark.parametrize("body, message", [
    # A signature name can hold no such byte (a protobuf string): not found (it was a 500).
    (b'{"signature_name": "\xff", "instances": [[1, 2]]}', 'Serving signature name: "\ufffd" not found'),
    # A name the answer repeats: valid Unicode (it was a "\udcff" escape, refused by strict parsers).
    (b'{"signature_name": "str", "instances": [{"\xff": "a"}]}', _KEY.format(0, "\ufffd")),
])
def test_a_string_byte_that_is_not_utf8_stays_out_of_names_and_answers(url, body, message):
    r = requests.post(url, data=body, timeout=30)
    answer = r.json()
    assert r.status_code == 400 and answer["error"].startswith(message), answer
    answer["error"].encode("utf-8")   # (a lone surrogate would raise here)


def test_an_example_feature_name_that_is_not_utf8_is_refused():
    """A tf.train.Example's feature key is a protobuf string: such a name was a 500."""
    from pkm_serve.serving import rest_requests
    from pkm_serve.serving.errors import ServingError
    with pytest.raises(ServingError, match="Feature name: caf\ufffd is not valid UTF-8"):
        rest_requests.example({"caf\udce9": [1]})


def test_a_lone_low_surrogate_escape_is_its_three_utf8_bytes(url):
    """rapidjson 1.1.0 (TF Serving's) writes a lone "\\udcff" escape as the code point's UTF-8
    bytes (ED B3 BF); it reached the tensor as the one byte FF, as a raw body byte FF does."""
    import json
    texts = ["\\udcff", "a\\uDC80b", "\\udfff", "\\ud83d\\ude00", "\\\\udcff"]
    expected = [len(json.loads(f'"{t}"').encode("utf-8", "surrogatepass")) for t in texts] + [1]
    body = ('{"signature_name": "str", "instances": ["' + '", "'.join(texts) + '", "').encode() + b'\xff"]}'
    assert _post(url, body) == (200, {"predictions": expected})


@pytest.mark.parametrize("body, repeats", [
    (b'{"inputs": {"s": ["s", "t", "s"]}}', False),   # a value spelling the name is no key
    (b'{"signature_name": "signature_name", "instances": ["instances"]}', False),
    (b'{"inputs": {"s": ["s"], "s" :["t"]}}', True),
    (b'{"instances": [1], "instances"\n: [2]}', True),
    (b'{"inputs": {"s": [{"b64": "QQ=="}], "s": [{"b64": "Qg=="}]}}', True),
    (b'{"inputs": {"s": [{"b64": "QQ=="}]}, "inputs": {"s": ["t"]}}', True),
    (b'{"inputs": {"b64": [1], "b64": [2]}}', True),
    (b'{"inputs": {"s": [{"b64": "QQ=="}, "a:b"], "t": ["s"]}}', False),
])
def test_only_a_name_spelt_twice_as_a_key_counts_as_repeated(body, repeats):
    """The cheap look for a repeated key (which makes the body parse again, in Python) counts
    a quoted name only where a colon follows it."""
    import json

    from pkm_serve.serving import rest_requests
    assert rest_requests.may_repeat_keys(body, json.loads(body)) == repeats


@pytest.mark.parametrize("body, words, offset", [
    (b'{"instances": [[1, 2],]}', "Invalid value.", 22),
    (b'{"instances": tru}', "Invalid value.", 17),   # past the letters ParseTrue matched
    (b'{"instances": -x}', "Invalid value.", 15),
    (b'{"instances": [[1, 2]],}', "Missing a name for object member.", 23),
    (b'{"instances" [[1, 2]]}', "Missing a colon after a name of object member.", 13),
    (b'{"instances": [[1, 2] [3, 4]]}', "Missing a comma or ']' after an array element.", 22),
    (b'{"instances": [{"x": [1, 2] "y": 1}]}', "Missing a comma or '}' after an object member.", 28),
    (b'{"instances": [[1., 2]]}', "Missing fraction part in number.", 18),
    (b'{"instances": [[1e+, 2]]}', "Missing exponent in number.", 19),
    (b'{"instances": [[1, 2]]} {}', "The document root must not be followed by other values.", 24),
    (b'{"instances": [["ab', "Missing a closing quotation mark in string.", 19),
    (b'{"instances": [["a\\qb"]]}', "Invalid escape character in string.", 18),
    (b'{"instances": [["\\u00G0"]]}', "Incorrect hex digit after \\u escape in string.", 17),
    # rapidjson 1.1.0 (TF Serving's) calls a control character an escape error, at its byte
    # (rapidjson issue #780); later rapidjson says "Invalid encoding in string.".
    (b'{"instances": [["a\tb"]]}', "Invalid escape character in string.", 18),
    (b'{"instances": [["ab\\', "Invalid escape character in string.", 19),   # at the lone backslash
    (b'{"\xc3\xa9": x}', "Invalid value.", 7),   # a byte offset, past the two bytes of the e-acute
])
def test_a_body_that_is_not_json_is_refused_in_rapidjsons_words(url, body, words, offset):
    """json_tensor.cc's ParseJson: "JSON Parse error: " + GetParseError_En + " at offset: " + the
    byte rapidjson stopped at (Python's json said "Expecting value: line 1 column 23 (char 22)")."""
    assert _post(url, body) == (400, {"error": f"JSON Parse error: {words} at offset: {offset}"})
