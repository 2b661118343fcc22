"""Round 37 parity checks of the REST API against tensorflow_model_server, on one in-process
REST front end (requests as the client):
- a key spelled twice in a body (or in its "inputs" object) stands for its first value, as
  json_tensor.cc reads it with rapidjson's FindMember (Python's json kept the last: another
  signature, or other input values, were served);
- the body is decoded as TF Serving's evhttp request decodes it (evhttp_request.cc
  NeedUncompressGzipContent): gunzipped where Content-Encoding contains "gzip", read as sent
  under any other encoding (aiohttp decoded deflate itself, and refused br -- without the
  Brotli module -- in a plain-text 400, where TF Serving serves a plain JSON body)."""
import gzip

import pytest
import requests

from serving_helpers import rest_predict_url, save_graph


def _save_model(path):
    """serving_default: x float [n, 2] -> y = 2x; "i32": i int32 [n] -> j = i + 1;
    "two": a, b float [n] -> c = a + b."""
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2], name="x")
        i = v1.placeholder(tf.int32, [None], name="i")
        a = v1.placeholder(tf.float32, [None], name="a")
        b = v1.placeholder(tf.float32, [None], name="b")
        info = v1.saved_model.build_tensor_info

        def sig(inputs, outputs):
            return v1.saved_model.build_signature_def({k: info(v) for k, v in inputs.items()},
                                                      {k: info(v) for k, v in outputs.items()},
                                                      "tensorflow/serving/predict")
        save_graph(path, {"serving_default": sig({"x": x}, {"y": 2.0 * x}),
                          "i32": sig({"i": i}, {"j": i + 1}),
                          "two": sig({"a": a, "b": b}, {"c": a + b})})


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    base = tmp_path_factory.mktemp("parity37") / "m"
    _save_model(str(base / "1"))
    with rest_predict_url(base) as predict_url:
        yield predict_url


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
    # The server's limit (1 MiB here) holds for the gunzipped body, not only for the bytes sent.
    bomb = gzip.compress(b'{"instances": [[1, 2]], "pad": "' + b" " * (2 << 20) + b'"}')
    code, answer = _post(url, bomb, **{"Content-Encoding": encoding})
    assert code == 413 and "larger than the limit of 1048576 bytes" in answer["error"], answer
