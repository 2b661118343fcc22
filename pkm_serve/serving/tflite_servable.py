"""One version served from its model.tflite (TF Serving's TFLite servable,
`--prefer_tflite_model=true`), through LiteRT with the pkm_serve delegate
(pkm_serve/tflite.py), so PkmEmbeddingBag custom ops and int8 tables run.

Signatures: TF Serving's own SignatureDefs where the .tflite holds them (its
signature_defs_metadata entry, the one source upstream's tflite_session.cc reads),
else the .tflite's signature runner: each SignatureDef the converter wrote
becomes one, its inputs and outputs by their signature names; a .tflite without
any gets one `serving_default` whose aliases are the interpreter's input and
output tensor names up to any ':' (TF Serving's tflite_session.cc).
Every TensorInfo carries the tensor's name, dtype and shape signature (-1 for
a dynamic dimension). A signature must feed every input of its subgraph, each from an
input of its own (an unfed one keeps the previous request's data), and tensors of one
name are refused, as upstream's GetTensorInfoMap.

Threads: a TFLite interpreter is not thread-safe. Each version owns a pool of
`num_interpreters` interpreters over one copy of the model bytes (constant
tensors, the tables included, are read from that buffer: a pool costs its
activation arenas, not N tables); a request takes an interpreter from the pool
for one invoke and puts it back, so at most `num_interpreters` requests run at
once and never two on one interpreter. Outputs are copied out before the
interpreter is returned.

With `interpreters_per_pool` > 1 (TF Serving's --num_tflite_interpreters_per_pool), as
upstream's TfLiteSession, the version batches its own requests: a scheduler with one batch
thread per interpreter merges the requests that queue while every interpreter is busy
(no timeout), splits a request past `max_execution_batch_size` rows into pieces of that
size and refuses one past 500 rows (tflite_session.cc's options; see _session_batching).
Its threads start once the signatures are built, so a refused load leaves none.
"""
import logging
import time

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2

from pkm_serve import tflite, tflite_metadata
from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import invalid
from pkm_serve.serving.servable import (DEFAULT_SIGNATURE, PREDICT_METHOD, ServableBase,
                                        SignatureBase)
from pkm_serve.serving.tflite_pool import InterpreterPool, assigns_resource_variables, served_subgraphs

log = logging.getLogger("pkm_serve.serving")

TFLITE_MODEL_FILE = "model.tflite"


def _tensor_info(detail) -> meta_graph_pb2.TensorInfo:
    info = meta_graph_pb2.TensorInfo(name=detail["name"],
                                     dtype=tf.as_dtype(detail["dtype"]).as_datatype_enum)
    for d in detail["shape_signature"]:
        info.tensor_shape.dim.add(size=int(d))
    return info


def _by_legacy_names(details):
    """{alias: tensor detail}, the alias being the tensor's name up to its first ':'
    ("serving_default_x:0" -> "serving_default_x"), as tflite_session.cc names the
    inputs and outputs of the signature it makes for a .tflite without any. Where two
    tensors' names cut so would be one alias (upstream keeps only the last of them), both
    keep their whole names."""
    cut = [d["name"].split(":", 1)[0] for d in details]
    return {(short if cut.count(short) == 1 else d["name"]): d for short, d in zip(cut, details)}


# The Metadata entry where TFLite's signature_def_util (SetSignatureDefMap) keeps a
# FlexBuffer map {signature key: serialized SignatureDef}: TF Serving's only source of
# a .tflite's SignatureDefs (tflite_session.cc reads them with GetSignatureDefMap).
_SIGNATURE_DEFS_METADATA = b"signature_defs_metadata"


def _metadata_signature_defs(model_bytes) -> dict:
    """{key: SignatureDef} of the model's signature_defs_metadata, {} without one;
    ValueError where it cannot be read (upstream: "Invalid SignatureDefs found")."""
    from flatbuffers import flexbuffers
    model = tflite.flatbuffer_schema().Model.GetRootAsModel(model_bytes, 0)
    for i in range(model.MetadataLength()):
        entry = model.Metadata(i)
        if entry.Name() != _SIGNATURE_DEFS_METADATA:
            continue
        try:
            if entry.Buffer() >= model.BuffersLength():   # (flatbuffers would read past the buffers)
                raise IndexError(f"buffer {entry.Buffer()} of {model.BuffersLength()}")
            buffer = model.Buffers(entry.Buffer())
            if buffer.DataIsNone():
                raise IndexError(tflite_metadata.no_data_reason(int(buffer.Offset())))
            data = buffer.DataAsNumpy().tobytes()
            sigs = flexbuffers.GetRoot(data).AsMap
            return {key.AsKey: meta_graph_pb2.SignatureDef.FromString(sigs[key.AsKey].AsStringBytes)
                    for key in sigs.Keys}
        except Exception as e:  # noqa: BLE001 - any malformed entry is the same fault
            raise ValueError(f"Invalid SignatureDefs found in TfLite model (its "
                             f"{_SIGNATURE_DEFS_METADATA.decode()}): {type(e).__name__}: {e}") from None
    return {}


def _dtype_name(enum_value) -> str:
    from tensorflow.core.framework import types_pb2
    try:
        return types_pb2.DataType.Name(enum_value)
    except ValueError:
        return f"<unknown DataType {enum_value}>"


def _refuse_shared_names(key, details, what):
    """Two input (or output) tensors of one name: as upstream's GetTensorInfoMap ("...
    has multiple indices"), refused; served by name, one of them would never be fed."""
    seen = {}
    for d in details:
        if d["name"] in seen:
            raise ValueError(f"signature '{key}': {what} tensors {seen[d['name']]} and {d['index']} are "
                             f"both named '{d['name']}' ({what.capitalize()} tensor name: {d['name']} "
                             f"has multiple indices)")
        seen[d["name"]] = d["index"]


def _check_inputs_one_to_one(key, in_index, input_details):
    """A signature's input aliases map one-to-one onto the interpreter's inputs: an input no
    alias feeds keeps the previous request's data (another client's) or uninitialised memory;
    two aliases of one tensor overwrite each other."""
    names = {d["index"]: d["name"] for d in input_details}
    aliases = {}
    for alias, index in in_index.items():
        aliases.setdefault(index, []).append(alias)
    for index, shared in aliases.items():
        if len(shared) > 1:
            raise ValueError(f"signature '{key}': inputs {', '.join(sorted(shared))} all feed tensor "
                             f"'{names.get(index, index)}' (each input must feed a tensor of its own)")
    unfed = [name for index, name in names.items() if index not in aliases]
    if unfed:
        raise ValueError(f"signature '{key}' feeds only some of the model's inputs: no input for "
                         f"tensor(s) {', '.join(map(repr, unfed))} (they would keep another request's data)")


def _metadata_bindings(interp, signature_defs):
    """_bindings of SignatureDefs from the metadata, run on the main subgraph's tensors by
    name: a TensorInfo name not among them is tried cut at its first ':' (the converter's
    old tensor names), as tflite_session.cc's FixTfLiteTensorName; else the load fails.
    A TensorInfo without a dtype or shape takes the tensor's; one that declares another
    dtype than its tensor's fails the load (every request would be refused or misread)."""
    out = {}
    for key, sdef in signature_defs.items():
        _refuse_shared_names(key, interp.get_input_details(), "input")
        _refuse_shared_names(key, interp.get_output_details(), "output")
        sdef = meta_graph_pb2.SignatureDef.FromString(sdef.SerializeToString())
        indices = []
        for infos, details, what in ((sdef.inputs, interp.get_input_details(), "input"),
                                     (sdef.outputs, interp.get_output_details(), "output")):
            by_name = {d["name"]: d for d in details}
            index = {}
            for alias, info in infos.items():
                name = info.name if info.name in by_name else info.name.split(":", 1)[0]
                if name not in by_name:
                    raise ValueError(f"Signature {what} {alias} of signature '{key}' references an "
                                     f"unknown tensor '{info.name}' (the model's {what}s: {sorted(by_name)})")
                found = _tensor_info(by_name[name])
                if info.dtype and info.dtype != found.dtype:
                    raise ValueError(f"Signature {what} {alias} of signature '{key}' declares dtype "
                                     f"{_dtype_name(info.dtype)}, but tensor '{name}' is "
                                     f"{_dtype_name(found.dtype)}")
                if not info.dtype:   # (a TensorInfo that gives no dtype or shape: the tensor's)
                    info.dtype = found.dtype
                if not info.HasField("tensor_shape"):
                    info.tensor_shape.CopyFrom(found.tensor_shape)
                info.name, index[alias] = name, by_name[name]["index"]
            indices.append(index)
        _check_inputs_one_to_one(key, indices[0], interp.get_input_details())
        out[key] = (sdef, indices[0], indices[1], False)
    return out


def _text(name) -> str:
    """A flatbuffer string field; "" where the file leaves it out (the verifier allows that)."""
    return name.decode("utf-8", "replace") if name is not None else ""


def _signature_subgraph_inputs(model_bytes) -> dict:
    """{signature key: [{index, name} of each input of its subgraph]}, from the flatbuffer
    (the signature runner tells only the inputs its SignatureDef names). Also refuses what the
    runner's by-alias dicts would hide: two inputs (or outputs) of one alias (one of them is
    dropped: an output alias answered with the other tensor's values), and input (or output)
    tensors of one name, as the other signature paths do (upstream's GetTensorInfoMap)."""
    model = tflite.flatbuffer_schema().Model.GetRootAsModel(model_bytes, 0)   # (no copy)
    out = {}
    for i in range(model.SignatureDefsLength()):
        sig = model.SignatureDefs(i)
        key = _text(sig.SignatureKey())
        graph = model.Subgraphs(sig.SubgraphIndex())

        def detail(t):
            return {"index": int(t), "name": _text(graph.Tensors(int(t)).Name())}
        for what, maps in (("input", [sig.Inputs(j) for j in range(sig.InputsLength())]),
                           ("output", [sig.Outputs(j) for j in range(sig.OutputsLength())])):
            by_alias = {}
            for m in maps:
                alias, name = _text(m.Name()), detail(m.TensorIndex())["name"]
                if not alias:   # (no request could name it)
                    raise ValueError(f"signature '{key}' has an {what} with no name (tensor '{name}')")
                if alias in by_alias:
                    raise ValueError(f"signature '{key}' names two {what}s '{alias}' (tensors "
                                     f"'{by_alias[alias]}' and '{name}'): one of them could not be "
                                     f"{'fed' if what == 'input' else 'fetched'}")
                by_alias[alias] = name
        out[key] = [detail(t) for t in graph.InputsAsNumpy()]
        _refuse_shared_names(key, out[key], "input")
        outputs = {int(sig.Outputs(j).TensorIndex()) for j in range(sig.OutputsLength())}
        _refuse_shared_names(key, [detail(t) for t in sorted(outputs)], "output")
    return out


def _bindings(interp, model_bytes):
    """{signature key: (SignatureDef, input alias -> tensor index, output alias -> index,
    whether it runs through a signature runner)} for one interpreter: TF Serving's
    SignatureDefs from the metadata where the model has them, else the signature runner's."""
    metadata_defs = _metadata_signature_defs(model_bytes)
    if metadata_defs:
        return _metadata_bindings(interp, metadata_defs)
    out = {}
    keys = list(interp.get_signature_list())
    if not keys:   # no SignatureDef in the .tflite: one by tensor names (tflite_session.cc)
        _refuse_shared_names(DEFAULT_SIGNATURE, interp.get_input_details(), "input")
        _refuse_shared_names(DEFAULT_SIGNATURE, interp.get_output_details(), "output")
        ins = _by_legacy_names(interp.get_input_details())
        outs = _by_legacy_names(interp.get_output_details())
        keys, by_runner = [DEFAULT_SIGNATURE], False
        details = {DEFAULT_SIGNATURE: (ins, outs)}
    else:
        by_runner, subgraph_inputs = True, _signature_subgraph_inputs(model_bytes)
        details = {}
        for key in keys:
            runner = interp.get_signature_runner(key)
            details[key] = (runner.get_input_details(), runner.get_output_details())
            _check_inputs_one_to_one(key, {a: d["index"] for a, d in details[key][0].items()},
                                     subgraph_inputs[key])
    for key in keys:
        ins, outs = details[key]
        sdef = meta_graph_pb2.SignatureDef(method_name=PREDICT_METHOD)
        for alias, d in ins.items():
            sdef.inputs[alias].CopyFrom(_tensor_info(d))
        for alias, d in outs.items():
            sdef.outputs[alias].CopyFrom(_tensor_info(d))
        out[key] = (sdef, {a: d["index"] for a, d in ins.items()},
                    {a: d["index"] for a, d in outs.items()}, by_runner)
    return out


class _Interpreter:
    """One interpreter of the pool; used by one request at a time."""

    # LiteRT's Python error reporter appends every message to one buffer that is never
    # cleared, and each error's text is that whole buffer: run() reports the new part only
    # and starts a fresh interpreter once the buffer passes this size.
    _MAX_ERROR_BUFFER = 1 << 20

    def __init__(self, model_bytes, num_threads):
        self._model_bytes, self._num_threads = model_bytes, num_threads
        self._start()

    def _start(self):
        self.interp = tflite.make_interpreter(self._model_bytes, num_threads=self._num_threads)
        self.bindings = _bindings(self.interp, self._model_bytes)
        self._runners = {}
        self._errors_so_far = ""

    def prepare(self):
        """As TF Serving's interpreter pool, allocates the tensors (prepares every kernel), of
        the primary subgraph and of every subgraph a signature served runs (SignatureDefs from
        the metadata run the primary one: as upstream, the others are never prepared). A refusal
        left to the calls (a kernel that refuses the converter's shapes) stays in the runtime's
        error text: run() reports what follows it."""
        self.interp.allocate_tensors()
        self._errors_so_far = tflite.allocate_signature_subgraphs(
            self.interp, keys=[key for key, binding in self.bindings.items() if binding[3]])

    def run(self, key, inputs):
        try:
            return self._run(key, inputs)
        except RuntimeError as e:  # the interpreter's (ValueErrors are the Python wrapper's own)
            text = str(e)
            new = text[len(self._errors_so_far):] if text.startswith(self._errors_so_far) else text
            self._errors_so_far = text
            if len(text) > self._MAX_ERROR_BUFFER:
                self._start()
            raise type(e)(new or text) from None

    def _run(self, key, inputs):
        _sdef, in_index, out_index, by_runner = self.bindings[key]
        if by_runner:
            runner = self._runners.get(key)
            if runner is None:
                runner = self._runners[key] = self.interp.get_signature_runner(key)
            return runner(**inputs)
        interp = self.interp
        for alias, value in inputs.items():
            interp.resize_tensor_input(in_index[alias], list(value.shape), strict=False)
        interp.allocate_tensors()
        for alias, value in inputs.items():
            interp.set_tensor(in_index[alias], value)
        interp.invoke()
        return {alias: interp.get_tensor(i) for alias, i in out_index.items()}


class TfLiteSignature(SignatureBase):
    def __init__(self, name, signature_def, pool, runs_own_subgraph=False):
        super().__init__(name, signature_def)
        self._pool = pool
        self.runs_own_subgraph = runs_own_subgraph   # (a signature runner's: its subgraph's own inputs)
        self.scheduler = None   # the version's own (interpreters_per_pool > 1), set once loaded

    def run(self, inputs: dict, output_filter=()) -> dict:
        fetches = self.fetches(output_filter)
        # np.require, not np.ascontiguousarray: that makes a scalar [1] (ndim >= 1).
        arrays = {k: np.require(v, requirements="C") for k, v in inputs.items()}
        if self.scheduler is not None:
            outputs = self.scheduler.run(self._pool, _Unbatched(self), arrays)
        else:
            outputs = self.run_unbatched(arrays)
        return {k: np.asarray(outputs[k]) for k in fetches}   # (LiteRT gives a scalar as np.float32)

    def run_unbatched(self, arrays: dict) -> dict:
        with self._pool.take() as interp:
            try:
                return interp.run(self.name, arrays)
            except (ValueError, RuntimeError) as e:   # resize, allocate or invoke refused them
                empty = self._empty_outputs(interp, arrays)
                if empty is not None:
                    return empty
                raise invalid(f"signature '{self.name}' rejected the inputs: "
                              f"{'; '.join(tflite.runtime_messages(str(e)))[:2000]}{self._shape_note(arrays)}") from None

    def _empty_outputs(self, interp, arrays):
        """{alias: empty array} for a request of 0 rows the interpreter refused (XNNPack's
        reshape cannot infer a -1 from 0 elements), as the SavedModel answers it: the request is
        run on one row of zeros (empty strings) of the same other dimensions, and each output
        answered with 0 rows and that run's other dimensions and dtype. None where an input has
        rows or a shape its signature does not take, the one-row run is refused too (the shapes
        themselves are wrong: weights unlike the ids), or an output is not one row per input row."""
        if not arrays or any(v.ndim == 0 or v.shape[0] != 0 or
                             not self.input_specs[k].shape.is_compatible_with(v.shape)
                             for k, v in arrays.items()):
            return None
        one_row = {k: np.full((1, *v.shape[1:]), b"" if v.dtype.kind in "SUO" else 0, v.dtype)
                   for k, v in arrays.items()}
        try:
            with self._pool.probing(interp) as prober:
                probe = prober.run(self.name, one_row)
        except (ValueError, RuntimeError):
            return None
        out = {}
        for alias, value in probe.items():
            value = np.asarray(value)
            declared = self.signature_def.outputs[alias].tensor_shape
            if value.ndim == 0 or value.shape[0] != 1 or not declared.dim or declared.dim[0].size != -1:
                return None
            out[alias] = np.zeros((0, *value.shape[1:]), value.dtype)
        return out

    def _fixed_batch_note(self, arrays) -> str:
        """Where an input's batch differs from the one the model fixes (the kernels' refusal
        names neither)."""
        for key, value in arrays.items():
            shape = self.input_specs[key].shape
            if value.ndim and shape.rank and shape[0] is not None and shape[0] != value.shape[0]:
                return (f" (input '{key}' has {value.shape[0]} rows; the model fixes its batch at "
                        f"{shape[0]}: {shape.as_list()})")
        return ""

    def _shape_note(self, arrays) -> str:
        """Where an input's shape does not fit its signature's: the interpreter was resized to
        it, as upstream's TfLiteSession resizes, but the converter lowered the ops for the
        signature's shape, and the kernels' refusal (XNNPack's "failed to reshape") names no
        input. (A signature shape [] may be a converted input of unknown rank: no note.)"""
        note = self._fixed_batch_note(arrays)
        for key, value in arrays.items():
            shape = self.input_specs[key].shape
            if note or not shape.rank or shape.is_compatible_with(value.shape):
                continue
            declared = [-1 if d is None else d for d in shape.as_list()]
            rank = f"rank {value.ndim}, " if value.ndim != shape.rank else ""
            note = f" (input '{key}' has {rank}shape {list(value.shape)}; the signature takes {declared})"
        return note

    def release(self):
        pass


class _Unbatched:
    """What the version's own scheduler runs a batch on: the signature straight on an
    interpreter (its name, SignatureDef and input specs key and check the batch)."""

    def __init__(self, signature):
        self.name, self.signature_def = signature.name, signature.signature_def
        self.input_specs = signature.input_specs
        self.run = signature.run_unbatched


# tflite_interpreter_pool.h's kInitialBatchSize: the scheduler's max_batch_size.
_SESSION_MAX_BATCH = 500


def _session_batching(model_bytes, num_interpreters, interpreters_per_pool):
    """The version's own BatchScheduler for interpreters_per_pool > 1, else None, with
    TfLiteSession::Create's options: one batch thread per interpreter, no batch timeout,
    large requests split into pieces of the model's fixed batch size (a single input whose
    stored dimension 0 is above 1; above 500 refused, as upstream) or else
    ceil(500 / interpreters_per_pool) rows, and 100 batches queued per interpreter. A run of
    fewer rows than a fixed batch is padded to it (copies of a row, outputs dropped)."""
    if interpreters_per_pool <= 1:
        return None
    model = tflite.flatbuffer_schema().Model.GetRootAsModel(model_bytes, 0)   # (no copy)
    graph = model.Subgraphs(0)
    fixed = graph.Tensors(graph.Inputs(0)).Shape(0) if graph.InputsLength() == 1 and \
        graph.Tensors(graph.Inputs(0)).ShapeLength() else 0
    per_run = fixed if fixed > 1 else -(-_SESSION_MAX_BATCH // interpreters_per_pool)
    if per_run > _SESSION_MAX_BATCH:   # (upstream's SharedBatchScheduler::AddQueue refuses the load)
        raise invalid(f"the model's fixed input batch is {per_run} rows, above the {_SESSION_MAX_BATCH} "
                      "a TFLite session with --num_tflite_interpreters_per_pool above 1 takes: When "
                      "enable_large_batch_splitting is true, input_batch_size_limit must be greater "
                      "than or equal to max_execution_batch_size.")
    params = protos.BatchingParameters()
    params.max_batch_size.value = _SESSION_MAX_BATCH
    params.batch_timeout_micros.value = 0
    params.num_batch_threads.value = num_interpreters
    params.max_enqueued_batches.value = num_interpreters * 100
    params.enable_large_batch_splitting.value = True
    params.max_execution_batch_size.value = per_run
    one_input = graph.Tensors(graph.Inputs(0)) if graph.InputsLength() == 1 else None
    dynamic = one_input is not None and one_input.ShapeSignatureLength() and one_input.ShapeSignature(0) == -1
    if fixed > 1 and not dynamic:
        # A short run (a request's last piece, or small ones together) is padded to the fixed
        # batch and the padding's outputs dropped, as upstream's interpreter keeps its batch for
        # string inputs: a model whose ops hold that batch could not run fewer rows.
        params.allowed_batch_sizes.extend(sorted({per_run, _SESSION_MAX_BATCH}))
    return BatchScheduler(params, stopped_message="this model version was unloaded")


# TF Serving's TfLiteSession registers TFLite's ParseExample custom op (the stock converter
# writes it, allow_custom_ops=True, for tf.io.parse_example); no Python LiteRT, tflite_runtime or
# tf.lite interpreter has its kernel, so such a model cannot run here.
_PARSE_EXAMPLE_UNSUPPORTED = (
    "the model parses tf.Example input with TFLite's ParseExample custom op, which TF Serving's "
    "TFLite servable links in but the Python LiteRT interpreter has no kernel for: serve this "
    "version from its SavedModel (remove model.tflite or --prefer_tflite_model), or convert "
    "signatures that take parsed features. ")


class TfLiteServable(ServableBase):
    runtime = "TFLite"

    def __init__(self, name, version, path, warmup=True, num_interpreters=1, num_threads=1,
                 interpreters_per_pool=1):
        super().__init__(name, version, path)
        t0 = time.perf_counter()
        model_path = f"{path}/{TFLITE_MODEL_FILE}"
        try:
            with tf.io.gfile.GFile(model_path, "rb") as f:   # a URL (file://, gs://) too
                model_bytes = f.read()
            interpreters = [_Interpreter(model_bytes, num_threads) for _ in range(max(1, num_interpreters))]
            # After the interpreters (their verifier refuses a malformed flatbuffer): int8
            # tables the kernel would refuse at every request fail the load instead. Then
            # every kernel is prepared (_Interpreter.prepare).
            tflite.check_int8_tables(model_bytes)
            for interpreter in interpreters:
                interpreter.prepare()
        except (OSError, ValueError, RuntimeError, tf.errors.OpError) as e:
            # (the runtime's messages each on its own: they came glued, "runtimeNode number 2")
            reason = ('; '.join(tflite.runtime_messages(str(e))) or type(e).__name__)[:2000]
            if "unresolved custom op: ParseExample" in reason:
                reason = _PARSE_EXAMPLE_UNSUPPORTED + reason
            raise invalid(f"cannot load {model_path} in LiteRT with the pkm_serve delegate: {reason}") from None
        served = served_subgraphs(model_bytes, {k: b[3] for k, b in interpreters[0].bindings.items()})
        self._pool = InterpreterPool(interpreters, make_probe=(
            (lambda: _Interpreter(model_bytes, num_threads)) if assigns_resource_variables(model_bytes, served) else None))
        self.signature_defs = {k: b[0] for k, b in interpreters[0].bindings.items()}
        self.signatures = {k: TfLiteSignature(k, sdef, self._pool, runs_own_subgraph=interpreters[0].bindings[k][3])
                           for k, sdef in self.signature_defs.items()}
        # The batch threads start last: a load refused before them leaves none running.
        self._scheduler = _session_batching(model_bytes, self._pool.size, interpreters_per_pool)
        for signature in self.signatures.values():
            signature.scheduler = self._scheduler
        log.info("model %s version %d: serving %s with %d TFLite interpreter(s)", name, version,
                 model_path, self._pool.size)
        self._finish_load(t0, warmup, rounds=self._pool.size)

    def release(self):
        if self._scheduler is not None:
            self._scheduler.stop()
        self._pool.close()
