"""One loaded SavedModel version: its signatures, metadata and warmup."""
import logging
import os
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.saved_model import loader_impl  # parses .pb and .pbtxt alike

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError, from_tf_error, invalid

log = logging.getLogger("pkm_serve.serving")

DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")


class Signature:
    """A callable signature with its input specs and the SignatureDef it came from."""

    def __init__(self, name, function, signature_def):
        self.name = name
        self.function = function
        self.signature_def = signature_def
        self.method_name = signature_def.method_name if signature_def is not None else PREDICT_METHOD
        self.input_specs = dict(function.structured_input_signature[1])
        self._fast_checks = {
            k: (np.dtype(spec.dtype.as_numpy_dtype) if spec.dtype != tf.string else None,
                spec.shape.as_list() if spec.shape.rank is not None else None)
            for k, spec in self.input_specs.items()}
        outputs = function.structured_outputs
        self.output_keys = sorted(outputs) if isinstance(outputs, dict) else []

    def validate(self, inputs: dict):
        missing = sorted(set(self.input_specs) - set(inputs))
        extra = sorted(set(inputs) - set(self.input_specs))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if extra:
                parts.append(f"unknown input(s) {extra}")
            raise invalid(f"{' and '.join(parts)} for signature '{self.name}'; "
                          f"it expects exactly {sorted(self.input_specs)}")
        for key, array in inputs.items():
            expected_dtype, expected_shape = self._fast_checks[key]
            if array.dtype == expected_dtype and expected_shape is not None \
                    and len(array.shape) == len(expected_shape) \
                    and all(e is None or e == d for e, d in zip(expected_shape, array.shape)):
                continue  # the common case, without TensorShape/DType objects
            tensors.check_against_spec(key, array, self.input_specs[key], self.name)

    def run(self, inputs: dict, output_filter=()) -> dict:
        try:
            result = self.function(**{k: tf.convert_to_tensor(v) for k, v in inputs.items()})
        except tf.errors.OpError as e:
            raise from_tf_error(e) from None
        except (TypeError, ValueError) as e:
            raise invalid(f"signature '{self.name}' rejected the inputs: {e}") from None
        if not isinstance(result, dict):
            result = {"output_0": result}
        keys = list(output_filter) or list(result)
        unknown = [k for k in keys if k not in result]
        if unknown:
            raise invalid(f"output_filter names unknown output(s) {unknown}; signature "
                          f"'{self.name}' has {sorted(result)}")
        return {k: result[k].numpy() for k in keys}


def _synthetic_input(spec: tf.TensorSpec):
    shape = [1 if d is None else d for d in (spec.shape.as_list() if spec.shape.rank is not None else [1])]
    if spec.dtype == tf.string:
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=spec.dtype.as_numpy_dtype)


class Servable:
    def __init__(self, name: str, version: int, path: str, warmup: bool = True):
        self.name = name
        self.version = version
        self.path = path
        t0 = time.perf_counter()
        try:
            saved_model = loader_impl.parse_saved_model(path)
        except Exception as e:
            raise ServingError(_code_of(e), f"cannot read SavedModel at {path}: {_short(e)}") from None
        meta = saved_model.meta_graphs[0] if saved_model.meta_graphs else None
        self.signature_defs = {k: v for k, v in (meta.signature_def.items() if meta else [])
                               if not k.startswith("__")}
        try:
            self._loaded = tf.saved_model.load(path)
        except Exception as e:
            raise ServingError(_code_of(e), f"cannot load SavedModel at {path}: {_short(e)}") from None
        self.signatures = {k: Signature(k, fn, self.signature_defs.get(k))
                           for k, fn in self._loaded.signatures.items()}
        if not self.signatures:
            raise invalid(f"SavedModel at {path} has no serving signatures")
        self.load_seconds = time.perf_counter() - t0
        self.warmup_seconds = self._warmup() if warmup else 0.0

    def signature(self, name: str) -> Signature:
        key = name or DEFAULT_SIGNATURE
        sig = self.signatures.get(key)
        if sig is None:
            raise invalid(f"Serving signature name: \"{key}\" not found in signature def; "
                          f"model '{self.name}' version {self.version} has {sorted(self.signatures)}")
        return sig

    def _warmup(self) -> float:
        """Replays assets.extra/tf_serving_warmup_requests if present (failure fails the load,
        as in TF Serving); otherwise runs every signature once on synthetic inputs so the
        first real request does not pay for tracing/allocation (failures there are only
        logged: zeros are not valid input for every model)."""
        t0 = time.perf_counter()
        warmup_path = os.path.join(self.path, WARMUP_FILE)
        if tf.io.gfile.exists(warmup_path):
            from tensorflow_serving.apis import prediction_log_pb2
            count = 0
            for record in tf.data.TFRecordDataset(warmup_path):
                entry = prediction_log_pb2.PredictionLog.FromString(record.numpy())
                if not entry.HasField("predict_log"):
                    raise invalid(f"{warmup_path}: only predict_log warmup records are supported")
                req = entry.predict_log.request
                sig = self.signature(req.model_spec.signature_name)
                inputs = tensors.from_protos(req.inputs)
                sig.validate(inputs)
                sig.run(inputs)
                count += 1
            log.info("model %s version %d: replayed %d warmup requests", self.name, self.version, count)
        else:
            for sig in self.signatures.values():
                try:
                    sig.run({k: _synthetic_input(s) for k, s in sig.input_specs.items()})
                except Exception as e:  # noqa: BLE001 - logged, see docstring
                    log.info("model %s version %d: synthetic warmup of '%s' skipped: %s",
                             self.name, self.version, sig.name, _short(e))
        return time.perf_counter() - t0


def _short(e) -> str:
    text = getattr(e, "message", None) or str(e)
    text = " ".join(text.split())
    return text[:2000]


def _code_of(e):
    if isinstance(e, ServingError):
        return e.code
    if isinstance(e, tf.errors.OpError):
        return from_tf_error(e).code
    import grpc
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, (OSError, ValueError)) \
        else grpc.StatusCode.UNKNOWN
