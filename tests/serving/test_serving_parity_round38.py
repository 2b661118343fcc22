"""Round 38 parity checks against tensorflow_model_server, in process (no server, no model):
- a key spelled twice anywhere in a REST body, plainly or with \\u escapes, is read as
  json_tensor.cc reads rapidjson's members: the body's keys and a columnar "inputs" object's
  names by their first value, {"b64": x, "b64": y} as no base64 value (IsValBase64Object
  counts members), a repeated input of a named instance refused (AddInstanceItem appends both
  values, which shifts every later row of the tensor);
- an "instances" fault far down a long list is found without reading every element one by one;
- a gRPC tensor of another dtype than the signature's is refused in the Session's words."""
import json
import random

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.serving import rest_requests
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.rest_frontend import loads

F, S = tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.string)
_KEY = "Failed to process element: {} key: {} of 'instances' list. Error: INVALID_ARGUMENT: "


def _read(body, specs):
    doc = loads(body)
    if "instances" in doc:
        arrays = rest_requests.rows_to_inputs(doc["instances"], specs)
    else:
        arrays = rest_requests.columns_to_inputs(doc["inputs"], specs)
    return {k: v.tolist() for k, v in arrays.items()}


def _refusal(body, specs):
    with pytest.raises(ServingError) as err:
        _read(body, specs)
    assert err.value.code.name == "INVALID_ARGUMENT"
    return err.value.message


@pytest.mark.parametrize("body, element, key", [
    (b'{"instances": [{"a": 1, "b": 2, "a": 3}, {"a": 4, "b": 5}]}', 0, "a"),
    (b'{"instances": [{"a": 1, "b": 2}, {"a": 4, "b": 5, "b": 6}]}', 1, "b"),
    (b'{"instances": [{"a": 1, "\\u0061": 2, "b": 3}]}', 0, "a"),
])
def test_an_input_repeated_in_a_named_instance_is_refused(body, element, key):
    """It took the last value (Python's json), where upstream appends both to the tensor."""
    assert _refusal(body, {"a": F, "b": F}) == _KEY.format(element, key) + f"JSON object: has named input: {key} more than once"
    # Spelled once, the same instances are read.
    assert _read(b'{"instances": [{"a": 1, "b": 2}]}', {"a": F, "b": F}) == {"a": [1.0], "b": [2.0]}


_NOT_BASE64 = 'JSON Value: {"b64":"QQ==","b64":"Qg=="} not formatted correctly for base64 data'


@pytest.mark.parametrize("body, message", [
    # A leaf: JsonDecodeBase64Object's format error (it decoded the last value, "B").
    (b'{"instances": [[{"b64": "QQ==", "b64": "Qg=="}]]}',
     "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: " + _NOT_BASE64),
    (b'{"inputs": [{"b64": "QQ==", "b64": "Qg=="}]}', _NOT_BASE64),
    # A whole instance / "inputs" value: an object of named inputs, as upstream reads it.
    (b'{"instances": [{"b64": "QQ==", "b64": "Qg=="}]}',
     _KEY.format(0, "b64") + "JSON object: does not have named input: b64"),
    (b'{"inputs": {"b64": "QQ==", "b64": "Qg=="}}', "Missing named input: s in 'inputs' object."),
])
def test_b64_spelled_twice_is_no_base64_value(body, message):
    assert _refusal(body, {"s": S}) == message
    # Spelled once, the same value is read as the bytes it encodes.
    once = body.replace(b', "b64": "Qg=="', b"")
    assert np.ravel(_read(once, {"s": S})["s"]).tolist() == [b"A"]


def test_b64_spelled_twice_in_a_feature_is_no_base64_value():
    doc = loads(b'{"examples": [{"f": [{"b64": "QQ==", "b64": "Qg=="}]}]}')
    with pytest.raises(ServingError, match="Feature: f has element with unexpected JSON type: Object$"):
        rest_requests.example_input(doc)


@pytest.mark.parametrize("escaped, plain, specs", [
    (b'{"inputs": [1.0], "\\u0069nputs": [2.0]}', b'{"inputs": [1.0], "inputs": [2.0]}', {"x": F}),
    (b'{"instances": [1.0], "\\u0069nstances": [2.0]}', b'{"instances": [1.0], "instances": [2.0]}', {"x": F}),
    (b'{"inputs": {"a": [1], "\\u0061": [2], "b": [3]}}', b'{"inputs": {"a": [1], "a": [2], "b": [3]}}',
     {"a": F, "b": F}),
])
def test_a_key_spelled_with_escapes_repeats_as_a_plain_one(escaped, plain, specs):
    """The look for repeated keys searched for the plain spelling only: "\\u0069nputs" took
    the last value, where the same body spelled plainly took the first."""
    assert json.loads(escaped) == json.loads(plain)   # (the same document to any JSON reader)
    assert _read(escaped, specs) == _read(plain, specs) == {
        k: v for k, v in zip(specs, ([1.0], [3.0]) if len(specs) == 2 else ([1.0],))}


@pytest.mark.parametrize("body, repeats", [
    (b'{"inputs": {"s": [{"b64": "QQ==", "b64": "Qg=="}]}}', True),
    (b'{"instances": [{"a": 1, "b": 2}, {"b": 3, "a": 4, "b": 5}]}', True),
    (b'{"inputs": [1], "\\u0069nputs": [2]}', True),
    (b'{"instances": [{"a": "x:y", "b": 2}, {"a": "\\"", "b": 3}]}', False),
    (b'{"instances": [{"b64": "QQ=="}, {"b64": "Qg=="}]}', False),
    (b'{"instances": [{ "b64": "QQ=="}, {\n"b64" : "Qg=="}]}', False),
    (b'{"inputs": [{"b64": 1, "b64": 2}]}', True),
    (b'{"inputs": [{"b64": "QQ==", "\\u0062\\u0036\\u0034": "Qg=="}]}', True),
    (b'{"examples": [{"f": [{"b64": "QQ=="}], "g": 1}], "context": {"c": "a:b"}}', False),
])
def test_the_look_for_repeated_keys_counts_every_object(body, repeats):
    assert rest_requests.may_repeat_keys(body, json.loads(body)) == repeats


_SPECS = {"a": tf.TensorSpec([None, 2], tf.float32), "b": tf.TensorSpec([None], tf.int32)}
_BAD = [{"a": [1, "x"], "b": 1}, {"a": [1], "b": 1}, {"a": [[1, 2]], "b": 1}, {"a": [1, 2], "b": True},
        {"a": [1, 2]}, {"a": [1, 2], "b": 1.5}, [1, 2]]


@pytest.mark.parametrize("bad", _BAD)
def test_a_fault_far_down_the_instances_is_found_without_reading_each_one(bad, monkeypatch):
    """The fault reported is the first one element by element (upstream's order), but the
    elements are read one by one only near it (from the start, a fault in the last of 200k
    instances took 20x a good request's time)."""
    rng = random.Random(str(bad))
    instances = [{"a": [rng.random(), 1.0], "b": rng.randrange(9)} for _ in range(1500)]
    at = rng.randrange(1, len(instances))
    instances[at:] = [bad] + instances[at + 1:] + [bad]
    expected = rest_requests._first_element_fault(instances, _SPECS, True)   # every element, one by one
    assert f"item {at} " in expected or f"element: {at} " in expected
    read_one_by_one = []
    item_fault = rest_requests._item_fault
    monkeypatch.setattr(rest_requests, "_item_fault", lambda *a: read_one_by_one.append(1) or item_fault(*a))
    with pytest.raises(ServingError) as err:
        rest_requests.rows_to_inputs(instances, _SPECS)
    assert err.value.message == expected
    assert len(read_one_by_one) <= 256, len(read_one_by_one)   # (1500 elements of 2 inputs)


def test_a_grpc_input_of_another_dtype_is_refused_in_the_sessions_words():
    """TF Serving feeds the tensor to Session::Run, which refuses it (FunctionCallFrame::SetArgs)
    with INVALID_ARGUMENT naming the fed tensors' sorted place; the message was this server's own."""
    from tensorflow.core.protobuf import meta_graph_pb2

    from pkm_serve.serving.servable import SignatureBase
    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:
        a = v1.placeholder(tf.float32, [None], name="serving_default_a")
        b = v1.placeholder(tf.float32, [None], name="serving_default_b")
        total = a + b
        sdef = v1.saved_model.build_signature_def({"a": v1.saved_model.build_tensor_info(a),
                                                   "b": v1.saved_model.build_tensor_info(b)}, {})
        feeds = {a: np.ones(2, np.float32), b: np.ones(2, np.int32)}
        with v1.Session(graph=graph) as session:   # Session::Run, as TF Serving calls it
            with pytest.raises(tf.errors.InvalidArgumentError) as reference:
                session._call_tf_sessionrun(None, {t._as_tf_output(): v for t, v in feeds.items()},
                                            [total._as_tf_output()], [], None)
    signature = SignatureBase("serving_default", meta_graph_pb2.SignatureDef(inputs=sdef.inputs))
    with pytest.raises(ServingError) as err:
        signature.validate({"a": feeds[a], "b": feeds[b]})
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert err.value.message == f"{reference.value.message} (input 'b' of signature 'serving_default')"


class _PassCountingBody(bytes):
    """A body that counts the passes made over it (count / `in`)."""
    passes = 0

    def count(self, *args):
        type(self).passes += 1
        return super().count(*args)

    def __contains__(self, item):
        type(self).passes += 1
        return super().__contains__(item)


@pytest.mark.parametrize("doc", [
    {"instances": [[0.5, 1.0, 2.0]] * 64},
    {"instances": [{"q": [0.5, 1.0]}] * 64},
    {"instances": [{"b64": "QUJD" * 64}] * 32},
    {"inputs": {"a": [[1, 2]], "b": [3, 4]}},
])
def test_the_look_for_repeated_keys_reads_a_common_body_once(doc):
    """Where the colons are the parsed objects' keys, one count over the body decides (it also
    searched every body for "b64" first: a second pass, 1.5x-5x the look's cost)."""
    body = _PassCountingBody(json.dumps(doc).encode())
    _PassCountingBody.passes = 0
    assert rest_requests.may_repeat_keys(body, json.loads(body)) is False
    assert _PassCountingBody.passes == 1


@pytest.mark.parametrize("body", [
    b'{"instances": [[1]], "instances": [[2]], "inputs": [[3]]}',
    b'{"instances": [[1]], "inputs": {"x": [3], "x": [4]}}',
    b'{"instances": 1, "instances": [2]}',
    b'{"signature_name": 1, "signature_name": "a"}',
])
def test_a_document_shown_in_an_error_keeps_every_member_sent(body):
    """JsonValueToString prints rapidjson's document, every member as sent; the message showed
    only each key's first value (another document than the one sent)."""
    doc = loads(body)
    with pytest.raises(ServingError) as err:
        rest_requests.signature_name(doc)
        rest_requests.check_predict_body(doc, "", {"x": F})
    assert f"JSON Value: {body.replace(b' ', b'').decode()} " in err.value.message


@pytest.mark.parametrize("body", [
    b'{"instances": ["a\\ud800"]}',
    b'{"instances": ["\\ud800\\u0041"]}',   # (an escape follows, not a low surrogate's)
    b'{"signature_name": "\\udbff", "instances": [NaN]}',
])
def test_a_high_surrogate_escape_without_its_low_one_is_a_parse_error(body):
    """rapidjson 1.1.0 (ParseStringToStream) refuses it at the escape's backslash; Python's json
    kept a lone surrogate (a string value was then refused in this server's own words)."""
    backslash = body.index(b"\\ud")
    with pytest.raises(ServingError) as err:
        loads(body)
    assert err.value.message == f"JSON Parse error: The surrogate pair in string is invalid. at offset: {backslash}"


def test_a_surrogate_pair_and_an_escaped_backslash_are_no_lone_surrogate():
    assert loads(b'{"instances": ["\\ud800\\udc00", "\\\\ud800", NaN]}')["instances"][:2] == ["\U00010000", "\\ud800"]


@pytest.mark.parametrize("body, message", [
    (b'{"examples": [{"f": null, "f": 1}]}', "Feature: f has element with unexpected JSON type: Null"),
    (b'{"context": {"c": [[1]], "c": 2}, "examples": [{"f": 1}]}', "Feature: c has element with unexpected JSON type: Array"),
])
def test_a_repeated_feature_is_read_member_by_member(body, message):
    """MakeExampleFromJsonObject reads every member (the last value of a feature is kept): an
    earlier faulty value is refused (only the last value was read, so the body was served)."""
    with pytest.raises(ServingError) as err:
        rest_requests.example_input(loads(body))
    assert err.value.message == message
    # The last value is kept where every value is good.
    kept = rest_requests.example_input(loads(b'{"examples": [{"f": [1, 2], "f": 3}]}'))
    assert list(kept.example_list.examples[0].features.feature["f"].int64_list.value) == [3]
