"""One loaded SavedModel version: a TF Session over its MetaGraph, as TF Serving's
SavedModelBundle is, with its signatures, metadata and warmup.

Why a Session rather than `tf.saved_model.load`: TF Serving feeds the request's
tensors to the signature's tensors by name and lets the graph decide which shapes
it accepts (its own tests send `[1]` and `[2, 3, 4]` to an `x` declared `[-1, 1]`);
a tf.function signature refuses any shape that differs from its spec before the
graph runs. A Session also owns the version's variables, so closing it on unload
frees them however many Python references are left.
"""
import contextlib
import logging
import math
import os
import threading
import time

import grpc
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError, from_tf_error, invalid
from pkm_serve.serving.methods import (CLASSIFY_METHOD, DEFAULT_SIGNATURE,  # noqa: F401 - re-exported
                                       PREDICT_METHOD, REGRESS_METHOD)

log = logging.getLogger("pkm_serve.serving")

SERVE_TAGS = ["serve"]
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")


def make_session_callable(session, feeds, fetches):
    """Session::MakeCallable over tensor names.

    `Session._make_callable_from_options` is private: the public `make_callable`
    with a feed list goes through `Session.run`, which refuses any fed shape that
    differs from the tensor's static shape (TF Serving does not) and costs ~20x more
    per call. tests/serving/test_serving_units.py::test_private_tf_apis_still_exist
    fails loudly if a TF upgrade moves it."""
    options = config_pb2.CallableOptions(feed=list(feeds), fetch=list(fetches))
    return session._make_callable_from_options(options)  # noqa: SLF001 - see docstring


class SignatureBase:
    """What every runtime's signature shares: its SignatureDef, input specs by alias and
    request validation (names and dtypes; shapes are the model's to judge, as TF Serving
    feeds any shape). Subclasses add run(inputs, output_filter=()) and release()."""

    def __init__(self, name, signature_def):
        self.name = name
        self.signature_def = signature_def
        self.method_name = signature_def.method_name
        self.input_specs = {k: _spec_of(v) for k, v in signature_def.inputs.items()}
        self._input_dtypes = {k: (None if s.dtype == tf.string else np.dtype(s.dtype.as_numpy_dtype))
                              for k, s in self.input_specs.items()}
        # Values for inputs a request may leave out (tf.function default arguments, which
        # tf.saved_model.save writes as SignatureDef.defaults; TF Serving's GetInputValues).
        # (The model's own constants: not held to the request size limit.)
        self.defaults = {k: tensors.from_proto(k, v, max_bytes=math.inf)
                         for k, v in signature_def.defaults.items() if k in self.input_specs}

    def with_defaults(self, inputs: dict) -> dict:
        """inputs plus the defaults of the signature inputs it leaves out."""
        missing = [k for k in self.defaults if k not in inputs]
        return {**inputs, **{k: self.defaults[k] for k in missing}} if missing else inputs

    def validate(self, inputs: dict):
        mismatch = tensors.input_mismatch(self.input_specs, inputs)
        if mismatch:
            raise invalid(f"{mismatch} for signature '{self.name}'; "
                          f"it expects exactly {sorted(self.input_specs)}")
        for key, array in inputs.items():
            if array.dtype != self._input_dtypes[key]:
                tensors.check_dtype(key, array, self.input_specs[key].dtype, self.name,
                                    self._arg_index(key, inputs))

    def _arg_index(self, alias, inputs):
        """The input's place among the fed tensors' names, sorted (DirectSession's feed order)."""
        tensor_names = sorted(self.signature_def.inputs[k].name for k in inputs)
        return tensor_names.index(self.signature_def.inputs[alias].name)

    def fetches(self, output_filter):
        """The output aliases to return: output_filter (checked) or all of them, sorted."""
        seen = set()
        for alias in output_filter:   # checked in order, in predict_util.cc's words
            if alias not in self.signature_def.outputs:
                raise invalid(f"output tensor alias not found in signature: {alias} Outputs expected to "
                              f"be in the set {{{','.join(sorted(self.signature_def.outputs))}}}.")
            if alias in seen:
                raise invalid(f"duplicate output tensor alias: {alias}")
            seen.add(alias)
        return tuple(output_filter) or tuple(sorted(self.signature_def.outputs))


class Signature(SignatureBase):
    """One SignatureDef of a loaded SavedModel version, run through the Session."""

    def __init__(self, name, signature_def, session):
        super().__init__(name, signature_def)
        self._session = session
        self._runners = {}            # (feed aliases, fetch aliases) -> session callable
        self._runners_lock = threading.Lock()

    def _runner(self, feeds, fetches):
        key = (feeds, fetches)
        runner = self._runners.get(key)
        if runner is None:
            with self._runners_lock:
                runner = self._runners.get(key)
                if runner is None:
                    sdef = self.signature_def
                    runner = make_session_callable(self._session, [sdef.inputs[k].name for k in feeds],
                                                   [sdef.outputs[k].name for k in fetches])
                    self._runners[key] = runner
        return runner

    def run(self, inputs: dict, output_filter=()) -> dict:
        fetches = self.fetches(output_filter)
        feeds = tuple(sorted(inputs))
        try:
            values = self._runner(feeds, fetches)(*[inputs[k] for k in feeds])
        except tf.errors.OpError as e:
            raise from_tf_error(e) from None
        except (TypeError, ValueError) as e:   # e.g. a value numpy cannot hand to TF
            raise invalid(f"signature '{self.name}' rejected the inputs: {e}") from None
        return dict(zip(fetches, values))

    def release(self):
        with self._runners_lock:
            self._runners.clear()   # each callable's handle is freed while the session is open


class _quiet_tf_logger:
    """The Session loader is TF Serving's own way in (SavedModelBundle) and the one way to
    feed by tensor name, but TF 2 logs it as deprecated in favour of tf.saved_model.load,
    which cannot do that: the advice would only mislead whoever reads the server log.
    Loads may overlap (--num_load_threads): the level is lowered by the first one in and
    restored by the last one out (each restoring its own saved level left TF's logger at
    ERROR for good when two loads' spans interleaved)."""
    _lock = threading.Lock()
    _depth = 0
    _level = None

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                cls._level = tf.get_logger().level
                tf.get_logger().setLevel("ERROR")
            cls._depth += 1

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                tf.get_logger().setLevel(cls._level)


def _spec_of(tensor_info) -> tf.TensorSpec:
    dims = tensor_info.tensor_shape
    shape = None if dims.unknown_rank else [None if d.size < 0 else d.size for d in dims.dim]
    return tf.TensorSpec(shape, tf.as_dtype(tensor_info.dtype))


class ServableBase:
    """What every runtime's loaded version shares: its name and version, its signatures
    (runnable, by key) and signature_defs (what metadata lists), lookup, and warmup.
    Subclasses set those in __init__, then call _finish_load, and implement release()."""

    runtime = "TF"            # the runtime label of :tensorflow:serving:runtime_latency

    def __init__(self, name: str, version: int, path: str):
        self.name, self.version, self.path = name, version, path
        self.signature_defs, self.signatures = {}, {}
        self.load_seconds = self.warmup_seconds = 0.0

    def _finish_load(self, t0, warmup, rounds=1):
        """`warmup`: how many times each warmup record runs (TF Serving's
        --num_request_iterations_for_warmup; True is once), 0 or False: no warmup."""
        if not self.signatures:
            self.release()
            raise invalid(f"the model at {self.path} has no serving signatures")
        self.load_seconds = time.perf_counter() - t0
        try:
            self.warmup_seconds = self._warmup(rounds, int(warmup)) if warmup else 0.0
        except Exception:
            self.release()
            raise

    def signature(self, name: str, rest: bool = False):
        """The Predict signature `name` picks. One it lacks: gRPC's FAILED_PRECONDITION in
        predict_util.cc's words, REST's INVALID_ARGUMENT in http_rest_api_handler.cc's
        (GetInfoMap, which looks the signature up to read the JSON before Predict runs)."""
        key = name or DEFAULT_SIGNATURE
        sig = self.signatures.get(key)
        if sig is None:
            has = f"model '{self.name}' version {self.version} has {sorted(self.signatures)}"
            if rest:
                raise invalid(f"Serving signature name: \"{key}\" not found in signature def; {has}")
            raise ServingError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Serving signature key \"{key}\" not found. ({has})")
        return sig

    def release(self):
        raise NotImplementedError

    def _warmup(self, rounds=1, iterations=1) -> float:
        """Replays assets.extra/tf_serving_warmup_requests if present, `rounds` times (one per
        TFLite interpreter), each record `iterations` times in a row (saved_model_warmup_util.cc);
        a failure fails the load. Without that file nothing runs, as in
        TF Serving: a signature may change the model's state (assign a variable, count calls),
        so running signatures on made-up inputs could corrupt it before the first request."""
        t0 = time.perf_counter()
        warmup_path = os.path.join(self.path, WARMUP_FILE)
        if not tf.io.gfile.exists(warmup_path):
            return 0.0
        count = 0
        for _ in range(rounds):
            count = self._replay_warmup_file(warmup_path, iterations)
        log.info("model %s version %d: replayed %d warmup requests", self.name, self.version, count)
        return time.perf_counter() - t0

    def _replay_warmup_file(self, warmup_path, iterations=1) -> int:
        """Runs each PredictionLog record of the warmup file through the request handlers
        live requests use (predict, classify, regress, multi_inference), on this version:
        TF Serving's saved_model_warmup.cc replays all four kinds."""
        from tensorflow_serving.apis import prediction_log_pb2
        from pkm_serve.serving.service import InferenceService
        service = InferenceService(_ThisVersion(self))
        handlers = {"predict_log": service.predict, "classify_log": service.classify,
                    "regress_log": service.regress, "multi_inference_log": service.multi_inference}
        count = 0
        for record in tf.data.TFRecordDataset(warmup_path):
            entry = prediction_log_pb2.PredictionLog.FromString(record.numpy())
            kind = entry.WhichOneof("log_type")
            if kind not in handlers:
                raise invalid(f"{warmup_path}: unsupported log_type for warmup: {kind} (predict_log, "
                              "classify_log, regress_log and multi_inference_log are replayed)")
            for _ in range(iterations):
                handlers[kind](getattr(entry, kind).request)
            count += 1
        return count


class _ThisVersion:
    """The manager a warmup replay's InferenceService sees: every model_spec resolves to
    the version being loaded (TF Serving's warmup also ignores the record's model name)."""

    def __init__(self, servable):
        self._servable = servable

    @contextlib.contextmanager
    def serving(self, _model_spec):
        yield self._servable


def session_config(gpu_memory_fraction=0.0):
    """The ConfigProto of a version's Session. A Session does not read tf.config.threading
    (eager's settings) by itself: pass on what --tensorflow_intra_op_parallelism /
    --tensorflow_inter_op_parallelism (or --tensorflow_session_parallelism) set; and
    --per_process_gpu_memory_fraction, which TF Serving puts in every session's config."""
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=tf.config.threading.get_intra_op_parallelism_threads(),
        inter_op_parallelism_threads=tf.config.threading.get_inter_op_parallelism_threads())
    config.gpu_options.per_process_gpu_memory_fraction = gpu_memory_fraction
    return config


class Servable(ServableBase):
    def __init__(self, name: str, version: int, path: str, warmup: bool = True, tags=SERVE_TAGS,
                 gpu_memory_fraction=0.0):
        """`tags`: the MetaGraph to load (--saved_model_tags)."""
        super().__init__(name, version, path)
        t0 = time.perf_counter()
        self._graph = tf.Graph()
        self.session_config = session_config(gpu_memory_fraction)
        self._session = tf.compat.v1.Session(graph=self._graph, config=self.session_config)
        try:
            with self._graph.as_default(), _quiet_tf_logger():
                meta = tf.compat.v1.saved_model.loader.load(self._session, list(tags), path)
        except Exception as e:
            self._session.close()
            raise ServingError(_code_of(e), f"cannot read SavedModel at {path}: {_short(e)}") from None
        # Metadata lists every SignatureDef, __saved_model_init_op included (as TF Serving's
        # does); the "__" ones are graph plumbing, not something a request can run.
        self.signature_defs = dict(meta.signature_def)
        self.signatures = {k: Signature(k, v, self._session) for k, v in self.signature_defs.items()
                           if not k.startswith("__")}
        self._finish_load(t0, warmup)

    def release(self):
        """Frees the version's graph, variables and callables (unload)."""
        for sig in self.signatures.values():
            sig.release()
        self._session.close()
        self._graph = None


def _short(e) -> str:
    text = getattr(e, "message", None) or str(e)
    text = " ".join(text.split())
    return text[:2000]


def _code_of(e):
    if isinstance(e, ServingError):
        return e.code
    if isinstance(e, tf.errors.OpError):
        return from_tf_error(e).code
    return grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, (OSError, ValueError)) \
        else grpc.StatusCode.UNKNOWN
