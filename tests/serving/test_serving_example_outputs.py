"""Classify/Regress outputs shaped as TF Serving's classifier.cc / regressor.cc require: one
row per example. An output of another batch size was reshaped into the examples' rows, so a
[classes, n] scores tensor handed each example others' scores (HTTP 200), and a wider scores
than classes tensor was cut; now INVALID_ARGUMENT with TF Serving's messages."""
import contextlib

import grpc
import numpy as np
import pytest
from tensorflow.core.example import example_pb2
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import classification_pb2, regression_pb2

from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.servable import SignatureBase
from pkm_serve.serving.service import InferenceService

X = [1.0, 2.0, 3.0]


class _Signature(SignatureBase):
    """A string-input signature whose outputs `fn` computes from the examples' x values."""

    def __init__(self, name, fn):
        sdef = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        sdef.inputs["inputs"].dtype = types_pb2.DT_STRING
        for key in fn(np.zeros(1, np.float32)):   # declared, as classifier.cc/regressor.cc check them
            sdef.outputs[key].name = key
        super().__init__(name, sdef)
        self._fn = fn

    def run(self, inputs, output_filter=()):
        x = np.array([example_pb2.Example.FromString(e).features.feature["x"].float_list.value[0]
                      for e in inputs["inputs"]], np.float32)
        return self._fn(x)


def _two(x):
    return np.stack([x, 2 * x], 1)


SIGNATURES = {
    "ok": lambda x: {"classes": np.array([[b"a", b"b"]] * len(x), object), "scores": _two(x)},
    "scores_only": lambda x: {"scores": x[:, None]},
    "transposed": lambda x: {"scores": _two(x).T},
    "wide": lambda x: {"classes": np.array([[b"a", b"b"]] * len(x), object),
                       "scores": np.stack([x, 2 * x, 3 * x], 1)},
    "narrow": lambda x: {"classes": np.array([[b"a", b"b"]] * len(x), object), "scores": x[:, None]},
    "reg_ok": lambda x: {"outputs": x[:, None]},
    "reg_sum": lambda x: {"outputs": x.sum(keepdims=True)},
    "reg_row": lambda x: {"outputs": x[None, :]},
    "str_scores": lambda x: {"scores": np.array([[b"0.5"]] * len(x), object)},
    "complex_scores": lambda x: {"scores": (x + 1j * x)[:, None].astype(np.complex64)},
    "int_scores": lambda x: {"scores": x[:, None].astype(np.int64)},
    "reg_str": lambda x: {"outputs": np.array([b"abc"] * len(x), object)},
    "reg_complex": lambda x: {"outputs": (x + 2j).astype(np.complex128)},
    "reg_bool": lambda x: {"outputs": x > 1},
    "reg_float64": lambda x: {"outputs": x.astype(np.float64)},
}


class _Servable:
    name, version = "m", 1
    signatures = {k: _Signature(k, fn) for k, fn in SIGNATURES.items()}


class _Manager:
    @contextlib.contextmanager
    def serving(self, _spec):
        yield _Servable()


def _request(kind, signature):
    req = kind(model_spec={"name": "m", "signature_name": signature})
    for x in X:
        req.input.example_list.examples.add().features.feature["x"].float_list.value.append(x)
    return req


def _classify(signature):
    resp = InferenceService(_Manager()).classify(_request(classification_pb2.ClassificationRequest,
                                                          signature))
    return [[(c.label, c.score) for c in cl.classes] for cl in resp.result.classifications]


def test_classify_rows_are_the_examples():
    assert _classify("ok") == [[("a", x), ("b", 2 * x)] for x in X]
    assert _classify("scores_only") == [[("", x)] for x in X]


@pytest.mark.parametrize("signature, message", [
    ("transposed", "Expected scores output batch size of 3. Got: 2"),
    ("wide", "Tensors class and score should match in dim_size(1). Got 2 vs. 3"),
    ("narrow", "Tensors class and score should match in dim_size(1). Got 2 vs. 1"),
])
def test_classify_outputs_of_other_shapes_are_refused(signature, message):
    with pytest.raises(ServingError) as e:
        _classify(signature)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message


def test_regress_outputs_one_value_per_example():
    service = InferenceService(_Manager())
    resp = service.regress(_request(regression_pb2.RegressionRequest, "reg_ok"))
    assert [r.value for r in resp.result.regressions] == X
    for signature, message in [("reg_sum", "Input batch size did not match output batch size: 3 vs. 1"),
                               ("reg_row", "Expected output Tensor shape to be either [batch_size] or "
                                           "[batch_size, 1] but got [1,3]")]:
        with pytest.raises(ServingError) as e:
            service.regress(_request(regression_pb2.RegressionRequest, signature))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message


@pytest.mark.parametrize("call, signature, message", [
    ("classify", "str_scores", "Expected scores Tensor of DT_FLOAT. Got: DT_STRING"),
    ("classify", "complex_scores", "Expected scores Tensor of DT_FLOAT. Got: DT_COMPLEX64"),
    ("regress", "reg_str", "Expected output Tensor of DT_FLOAT.  Got: DT_STRING"),
    ("regress", "reg_complex", "Expected output Tensor of DT_FLOAT.  Got: DT_COMPLEX128"),
    ("regress", "reg_bool", "Expected output Tensor of DT_FLOAT.  Got: DT_BOOL"),
    ("classify", "int_scores", "Expected scores Tensor of DT_FLOAT. Got: DT_INT64"),
    ("regress", "reg_float64", "Expected output Tensor of DT_FLOAT.  Got: DT_DOUBLE"),
])
def test_scores_and_regressions_that_are_not_float32_are_refused(call, signature, message):
    """classifier.cc / regressor.cc want DT_FLOAT exactly (regressor.cc's words have two spaces);
    a string was a ValueError (HTTP 500), a complex value silently lost its imaginary part, and
    other real numbers were taken as float32."""
    kind = classification_pb2.ClassificationRequest if call == "classify" else regression_pb2.RegressionRequest
    with pytest.raises(ServingError) as e:
        getattr(InferenceService(_Manager()), call)(_request(kind, signature))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message
