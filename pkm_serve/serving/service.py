"""The protocol-independent request handling shared by the gRPC and REST front ends.

Every method takes and returns tensorflow_serving.apis protos and raises
ServingError; the front ends only translate transport details.
"""
import logging
import math
import time

import grpc
import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2, get_model_status_pb2,
                                     inference_pb2, model_management_pb2, predict_pb2,
                                     regression_pb2)
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import status_pb2

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError, invalid
from pkm_serve.serving.limits import DEFAULT_MAX_REQUEST_BYTES
from pkm_serve.serving.methods import CLASSIFY_METHOD, DEFAULT_SIGNATURE, PREDICT_METHOD, REGRESS_METHOD

log = logging.getLogger("pkm_serve.serving")


def debug_shape(shape) -> str:
    """A shape as TF's TensorShape::DebugString prints it in upstream's messages: [2,1,2]."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def _dtype_name(tensor) -> str:
    return types_pb2.DataType.Name(tf.as_dtype(tensor.dtype).as_datatype_enum)


def _per_example(tensor, what, n, dtype):
    """A classify output checked in TF Serving's classifier.cc order: rank 2 ([n, classes]),
    then `dtype` (DT_STRING classes, DT_FLOAT scores), then one row per example."""
    if tensor.ndim != 2:
        raise invalid(f"Expected Tensor shape: [batch_size num_classes] but got {debug_shape(tensor.shape)} "
                      f"('{what}')")
    if tf.as_dtype(tensor.dtype) != dtype:
        raise invalid(f"Expected {what} Tensor of {types_pb2.DataType.Name(dtype.as_datatype_enum)}. "
                      f"Got: {_dtype_name(tensor)}")
    if tensor.shape[0] != n:
        raise invalid(f"Expected {what} output batch size of {n}. Got: {tensor.shape[0]}")
    return tensor


def _check_example_signature(sig, what):
    """Before the model runs, PreProcessClassification / PreProcessRegression's checks in their
    order and words (classifier.cc, regressor.cc): one input, one or two outputs to classify
    (one to regress), the input keyed "inputs", then a "classes" or "scores" output to classify
    ("outputs" to regress). (Another input key and more outputs were accepted here.)"""
    sdef = sig.signature_def
    if len(sig.input_specs) != 1:
        raise invalid(f"Expected one input Tensor. ({what} signature '{sig.name}' has "
                      f"{sorted(sig.input_specs)})")
    if what == "classification" and len(sdef.outputs) not in (1, 2):
        raise invalid(f"Expected one or two output Tensors, found {len(sdef.outputs)}")
    if what == "regression" and len(sdef.outputs) != 1:
        raise invalid("Expected one output Tensor.")
    if "inputs" not in sdef.inputs:
        raise invalid(f"No {what} inputs found in SignatureDef: {sdef}")
    if what == "classification" and not {"classes", "scores"} & set(sdef.outputs):
        raise invalid('Expected classification signature outputs to contain at least one of "classes" '
                      f'or "scores". Signature was: {sdef}')
    if what == "regression" and "outputs" not in sdef.outputs:
        raise invalid(f"No regression outputs found in SignatureDef: {sdef}")


def _braced(names) -> str:
    return "{" + ",".join(sorted(names)) + "}"


def _check_request_input_names(sig, sent):
    """gRPC Predict's input names against the signature's, in predict_util.cc's
    VerifyRequestInputsSize and then saved_model::GetInputValues' order and words (defaults
    fill what the request leaves out)."""
    sent, wanted, defaults = set(sent), set(sig.input_specs), set(sig.signature_def.defaults)
    if len(sent) > len(wanted) or (len(sent) < len(wanted) and not defaults):
        raise invalid(f"input size does not match signature: {len(sent)}!={len(wanted)} len({_braced(sent)}) "
                      f"!= len({_braced(wanted)}). Sent extra: {_braced(sent - wanted)}. "
                      f"Missing but required: {_braced(wanted - sent)}.")
    for alias in sorted(wanted - sent - defaults):
        raise invalid(f"Signature input alias: {alias}(feed name: {sig.signature_def.inputs[alias].name}) not "
                      f"found in request and no default value provided. Inputs expected to be in the request "
                      f"{_braced(sent)}, or default input alias set: {','.join(sorted(defaults))}")
    if sent - wanted:
        raise invalid(f"Inputs contains invalid name. Used request inputs: {','.join(sorted(sent & wanted))}, "
                      f"request input: {','.join(sorted(sent))}")


# Why two signatures of a .tflite's signature runner never share an input tensor.
_OWN_SUBGRAPHS_NOTE = (": each SignatureDef the TFLite converter wrote runs a subgraph of its own, as each "
                       "signature of the SavedModel it came from reads a placeholder of its own; send a "
                       "request per signature, or give the .tflite TF Serving SignatureDefs "
                       "(signature_defs_metadata) that read one tensor")


_PREDICTABLE_METHODS = (PREDICT_METHOD, CLASSIFY_METHOD, REGRESS_METHOD)


class InferenceService:
    def __init__(self, manager, batcher=None, metrics=None, max_request_bytes=None,
                 outputs_as_tensor_content=False, check_signature_method_name=False):
        self.manager = manager
        self.batcher = batcher
        self.metrics = metrics
        # Also bounds what a request's inputs decode to (a proto's shape can claim far more).
        self.max_request_bytes = max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
        self.outputs_as_tensor_content = outputs_as_tensor_content
        self.check_signature_method_name = check_signature_method_name

    def serving(self, model_spec):
        """Context manager: the servable for model_spec, held until the request is done."""
        return self.manager.serving(model_spec)

    # ------------------------------------------------------------ helpers
    def _run(self, servable, sig, inputs, deadline, api, output_filter=()):
        t0 = time.monotonic()
        if self.batcher is not None:
            fetches = sig.fetches(output_filter)   # unknown names refused before the model runs
            outputs = self.batcher.run(servable, sig, inputs, deadline=deadline)
            if output_filter:
                outputs = {k: outputs[k] for k in fetches}
        else:
            outputs = sig.run(inputs, output_filter)
        if deadline is not None and time.monotonic() > deadline:
            raise ServingError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while the model ran")
        if self.metrics:
            self.metrics.runtime(servable.name, api, time.monotonic() - t0,
                                 getattr(servable, "runtime", "TF"))
        return outputs

    @staticmethod
    def _fill_spec(spec_proto, servable, signature_name):
        spec_proto.name = servable.name
        spec_proto.version.value = servable.version
        spec_proto.signature_name = signature_name

    # ------------------------------------------------------------ Predict
    def predict_on(self, servable, sig, inputs, deadline=None, output_filter=()):
        """Validates and runs on the servable the caller holds (see serving())."""
        inputs = sig.with_defaults(inputs)
        sig.validate(inputs)
        return self._run(servable, sig, inputs, deadline, "predict", output_filter)

    def check_predict_method(self, sig):
        """predict_util.cc's VerifySignature, on with --enable_signature_method_name_check: a
        Predict signature's method_name must be predict, classify or regress (INTERNAL)."""
        if self.check_signature_method_name and sig.method_name not in _PREDICTABLE_METHODS:
            raise ServingError(grpc.StatusCode.INTERNAL,
                               "Expected prediction signature method_name to be one of {"
                               + ", ".join(_PREDICTABLE_METHODS) + f"}}. Was: {sig.method_name}")

    def predict(self, request, deadline=None):
        # predict_util.cc's order: the servable, its signature (and its method, when checked),
        # the input names, their values.
        with self.serving(request.model_spec) as servable:
            sig = servable.signature(request.model_spec.signature_name)
            self.check_predict_method(sig)
            _check_request_input_names(sig, request.inputs)
            inputs = tensors.from_protos(request.inputs, self.max_request_bytes)
            outputs = self.predict_on(servable, sig, inputs, deadline, tuple(request.output_filter))
            resp = predict_pb2.PredictResponse()
            self._fill_spec(resp.model_spec, servable, sig.name)
        for k, v in outputs.items():
            resp.outputs[k].CopyFrom(tensors.to_proto(v, self.outputs_as_tensor_content))
        return resp

    # ------------------------------------------------------------ metadata/status
    def get_model_metadata(self, request):
        # get_model_metadata_impl.cc's checks and words; "signature_def" twice is accepted.
        if not request.metadata_field:
            raise invalid("GetModelMetadataRequest must specify at least one metadata_field")
        for field in request.metadata_field:
            if field != "signature_def":
                raise invalid(f"Metadata field {field} is not supported")
        resp = get_model_metadata_pb2.GetModelMetadataResponse()
        sig_map = get_model_metadata_pb2.SignatureDefMap()
        with self.serving(request.model_spec) as servable:
            self._fill_spec(resp.model_spec, servable, "")
            for k, v in servable.signature_defs.items():
                sig_map.signature_def[k].CopyFrom(v)
        resp.metadata["signature_def"].Pack(sig_map)
        return resp

    def get_model_status(self, request):
        if not request.HasField("model_spec"):   # get_model_status_impl.cc's check and words
            raise invalid("Missing ModelSpec")
        resp = get_model_status_pb2.GetModelStatusResponse()
        resp.model_version_status.extend(self.manager.status(request.model_spec))
        return resp

    def reload_config(self, request, deadline=None):
        """model_service_impl.cc: only a model_config_list is taken (an empty config too is
        INVALID_ARGUMENT there), and a failed reload is the RPC's status, not an OK answer
        carrying it (a client that relies on the RpcError took a failure for success)."""
        if request.config.WhichOneof("config") != "model_config_list":
            raise invalid("ServerModelConfig type not supported by HandleReloadConfigRequest. "
                          "Only ModelConfigList is currently supported")
        try:
            self.manager.apply_config(request.config,
                                      await_new_models_until=math.inf if deadline is None else deadline)
        except ServingError as e:
            log.error("ReloadConfig failed: %s", e.message)
            raise
        resp = model_management_pb2.ReloadConfigResponse()
        resp.status.CopyFrom(status_pb2.StatusProto(error_code=0))
        return resp

    # ------------------------------------------------------------ Classify/Regress
    @staticmethod
    def _serialized_examples(input_proto):
        kind = input_proto.WhichOneof("kind")
        if kind == "example_list":
            serialized = [e.SerializeToString() for e in input_proto.example_list.examples]
        elif kind == "example_list_with_context":
            # As util.cc's InputToSerializedExampleTensor: the context's bytes, then the example's
            # (parsed, an example's own features win). A merged copy of each example instead fed
            # the model other bytes, and took ~1.3 KB and ~3 us an example: a 64 MiB request of
            # empty examples would have needed ~40 GB.
            with_context = input_proto.example_list_with_context
            context = with_context.context.SerializeToString()
            serialized = [context + e.SerializeToString() for e in with_context.examples]
        else:
            serialized = []
        if not serialized:   # no kind set, or no examples in it: util.cc's words for both
            raise invalid("Input is empty.")
        return np.array(serialized, dtype=object)

    def _example_signature(self, servable, model_spec, method, what):
        key = model_spec.signature_name or DEFAULT_SIGNATURE
        if key not in servable.signatures:   # classifier.cc / regressor.cc: InvalidArgument
            raise invalid(f"No signature was found with the name: {key} (model '{servable.name}' "
                          f"version {servable.version} has {sorted(servable.signatures)})")
        sig = servable.signatures[key]
        # TF Serving checks the method name only with --enable_signature_method_name_check:
        # tf.saved_model.save writes .../predict for every signature, Classify works on them.
        if self.check_signature_method_name and sig.method_name != method:
            raise invalid(f"Expected {what} signature method_name to be {method}. Was: {sig.method_name} "
                          f"(signature '{sig.name}' of model '{servable.name}'; use Predict for it)")
        _check_example_signature(sig, what)
        if next(iter(sig.input_specs.values())).dtype != tf.string:   # (upstream: TF's feed error)
            (key, spec), = sig.input_specs.items()
            raise invalid(f"{what} signature '{sig.name}' needs one string input (serialized "
                          f"tf.Example); its input '{key}' is {spec.dtype.name}")
        return sig, next(iter(sig.input_specs))

    def _classify_outputs(self, servable, model_spec, input_proto, deadline):
        sig, in_key = self._example_signature(servable, model_spec, CLASSIFY_METHOD, "classification")
        examples = self._serialized_examples(input_proto)
        outputs = self._run(servable, sig, {in_key: examples}, deadline, "classify")
        classes, scores = outputs.get("classes"), outputs.get("scores")
        if classes is None and scores is None:
            raise invalid(f"classification signature '{sig.name}' has neither 'classes' nor 'scores' outputs")
        n = len(examples)
        # As classifier.cc: every check of the classes before any of the scores.
        classes, scores = (None if t is None else _per_example(t, what, n, dtype)
                           for t, what, dtype in ((classes, "classes", tf.string),
                                                  (scores, "scores", tf.float32)))
        if classes is not None and scores is not None and classes.shape[1] != scores.shape[1]:
            raise invalid(f"Tensors class and score should match in dim_size(1). Got "
                          f"{classes.shape[1]} vs. {scores.shape[1]} (signature '{sig.name}')")
        result = classification_pb2.ClassificationResult()
        width = (classes if classes is not None else scores).shape[1]
        for i in range(n):
            c = result.classifications.add()
            for j in range(width):
                cls = c.classes.add()
                if classes is not None:
                    label = classes[i, j]
                    cls.label = label.decode("utf-8", "replace") if isinstance(label, bytes) else str(label)
                if scores is not None:
                    cls.score = float(scores[i, j])
        return sig, result

    def _regress_outputs(self, servable, model_spec, input_proto, deadline):
        sig, in_key = self._example_signature(servable, model_spec, REGRESS_METHOD, "regression")
        examples = self._serialized_examples(input_proto)
        outputs = self._run(servable, sig, {in_key: examples}, deadline, "regress")
        if "outputs" not in outputs:
            raise invalid(f"regression signature '{sig.name}' has no 'outputs' output")
        values = outputs["outputs"]
        # regressor.cc's checks, in its order and words (two spaces before "Got" are upstream's).
        if not (values.ndim == 1 or (values.ndim == 2 and values.shape[1] == 1)):
            raise invalid("Expected output Tensor shape to be either [batch_size] or [batch_size, 1] "
                          f"but got {debug_shape(values.shape)} (signature '{sig.name}')")
        if values.shape[0] != len(examples):
            raise invalid(f"Input batch size did not match output batch size: {len(examples)} vs. "
                          f"{values.shape[0]} (signature '{sig.name}')")
        if tf.as_dtype(values.dtype) != tf.float32:
            raise invalid(f"Expected output Tensor of DT_FLOAT.  Got: {_dtype_name(values)}")
        values = values.reshape(len(examples), 1)
        result = regression_pb2.RegressionResult()
        for v in values[:, 0]:
            result.regressions.add(value=float(v))
        return sig, result

    def classify(self, request, deadline=None):
        return self._example_task(request, deadline, self._classify_outputs, classification_pb2.ClassificationResponse)

    def regress(self, request, deadline=None):
        return self._example_task(request, deadline, self._regress_outputs, regression_pb2.RegressionResponse)

    def _example_task(self, request, deadline, outputs, response_type):
        """Classify / Regress: `outputs` runs the signature on the request's examples."""
        with self.serving(request.model_spec) as servable:
            sig, result = outputs(servable, request.model_spec, request.input, deadline)
            resp = response_type(result=result)
            self._fill_spec(resp.model_spec, servable, sig.name)
        return resp

    def multi_inference(self, request, deadline=None):
        if not request.tasks:
            raise invalid("MultiInference request has no tasks")
        resp = inference_pb2.MultiInferenceResponse()
        # One servable (the first task's version) answers every task, as in TF Serving: it is
        # looked up first (multi_inference_helper.cc), so an unknown model is NOT_FOUND.
        with self.serving(request.tasks[0].model_spec) as servable:
            plan = self._multi_inference_plan(servable, request.tasks)
            for task, run in plan:
                out = resp.results.add()
                sig, result = run(servable, task.model_spec, request.input, deadline)
                if task.method_name == CLASSIFY_METHOD:
                    out.classification_result.CopyFrom(result)
                else:
                    out.regression_result.CopyFrom(result)
                self._fill_spec(out.model_spec, servable, sig.name)
        return resp

    def _multi_inference_plan(self, servable, tasks):
        """[(task, how to run it)], every task checked before any runs, one after another in
        multi_inference.cc's order and words: its model name, a repeated signature, a signature
        the model lacks, its method, and that all signatures read the same input tensor (the
        examples are serialized once and fed to that tensor)."""
        plan, model_name, seen, input_tensor = [], "", set(), None
        for task in tasks:
            if not task.model_spec.name:
                raise invalid("Found ModelSpec with an empty model name.")
            if model_name and task.model_spec.name != model_name:
                raise invalid("All ModelSpecs in a MultiInferenceRequest must access the same model name.")
            model_name = task.model_spec.name
            name = task.model_spec.signature_name or DEFAULT_SIGNATURE
            if name in seen:
                raise invalid(f"Duplicate evaluation of signature: {name}")
            seen.add(name)
            if name not in servable.signatures:
                raise invalid(f"Requested signature not found in model graph: {name} (model "
                              f"'{servable.name}' version {servable.version} has {sorted(servable.signatures)})")
            if task.method_name == CLASSIFY_METHOD:
                run, what = self._classify_outputs, "classification"
            elif task.method_name == REGRESS_METHOD:
                run, what = self._regress_outputs, "regression"
            else:
                raise ServingError(grpc.StatusCode.UNIMPLEMENTED,
                                   f"Unsupported signature method_name: {task.method_name} (MultiInference "
                                   f"runs {CLASSIFY_METHOD} and {REGRESS_METHOD} tasks)")
            sig, in_key = self._example_signature(servable, task.model_spec, task.method_name, what)
            tensor = sig.signature_def.inputs[in_key].name
            if input_tensor is None:
                input_tensor = tensor
            elif tensor != input_tensor:
                raise invalid(f"Input tensor must be the same for all Signatures. (signature "
                              f"'{sig.name}' reads '{tensor}', an earlier task's reads '{input_tensor}'"
                              f"{_OWN_SUBGRAPHS_NOTE if getattr(sig, 'runs_own_subgraph', False) else ''})")
            plan.append((task, run))
        return plan
