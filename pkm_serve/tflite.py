"""Run pkm_serve models in a TFLite interpreter through ``libpkm_tflite.so``.

``libpkm_tflite.so`` is an external delegate: a stock interpreter (LiteRT
``ai_edge_litert``, the legacy ``tflite_runtime``, or ``tf.lite``) keeps the
``PkmEmbeddingBag`` custom op as a placeholder and the delegate claims it.
With ``fuse_composites=True`` it also claims stock GATHER -> MUL -> SUM chains.

This module imports no TensorFlow unless ``tf.lite`` is the interpreter asked
for (or the only one installed), so it works on a device-like environment
that has only ``tflite_runtime`` and numpy.

    from pkm_serve import tflite
    outputs = tflite.run_tflite("model.tflite", {"indices": idx, "weights": w},
                                num_threads=2)

(input names: the signature's, ``indices``, or the tensors', ``serving_default_indices:0``.)
"""

from __future__ import annotations

import importlib
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

# The model files' side (flatbuffer schema, int8 tables, a one-op model), here for the
# callers of pkm_serve.tflite.
from pkm_serve.tflite_model import (  # noqa: F401
    CUSTOM_OP_NAME,
    CUSTOM_OP_NAMES,
    RAGGED_CUSTOM_OP_NAME,
    SIGNATURE_DEFS_METADATA,
    TFLITE_FILE_IDENTIFIER,
    _schema,
    build_embedding_bag_model,
    check_int8_tables,
    check_tflite_bytes,
    flatbuffer_schema,
    metadata_names,
    quantize_rows_int8,
    quantize_rows_int8_affine,
    quantize_table_int8,
    signature_defs_metadata_size,
)
from pkm_serve.tflite_report import execution_plan, ops_in_plan, runtime_messages  # noqa: F401

INTERPRETERS = ("litert", "tflite_runtime", "tf")
_MODULES = {
    "litert": "ai_edge_litert.interpreter",
    "tflite_runtime": "tflite_runtime.interpreter",
    "tf": "tensorflow.lite.python.interpreter",  # tf.lite.Interpreter, tf.lite.experimental.load_delegate
}
_PACKAGES = {"litert": "ai-edge-litert", "tflite_runtime": "tflite-runtime", "tf": "tensorflow"}
_LIB_NAME = "libpkm_tflite.so"


def delegate_path() -> str:
    """Absolute path of libpkm_tflite.so (override with $PKM_TFLITE_DELEGATE)."""
    override = os.environ.get("PKM_TFLITE_DELEGATE")
    if override:
        return os.path.abspath(override)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", _LIB_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"pkm_serve's TFLite delegate {path} does not exist: install a wheel (`make wheel`, "
            "then `pip install dist/pkm_serve_device-*.whl` on a device or dist/pkm_serve-*.whl "
            "with TensorFlow), or run `make build` in a source checkout")
    return path


def interpreter_module(interpreter: str = "auto"):
    """The module providing ``Interpreter`` and ``load_delegate``.

    ``interpreter`` is one of "litert", "tflite_runtime", "tf" or "auto" (the
    first of those installed, in that order).
    """
    if interpreter != "auto":
        if interpreter not in _MODULES:
            raise ValueError(f"interpreter must be 'auto' or one of {INTERPRETERS}, "
                             f"got {interpreter!r}")
        module = _MODULES[interpreter]
        try:
            return importlib.import_module(module)
        except ImportError as e:   # (bare, "No module named 'ai_edge_litert'" named no choice)
            if e.name and (module + ".").startswith(e.name + "."):
                raise type(e)(f"interpreter {interpreter!r} needs pip's {_PACKAGES[interpreter]}, which is "
                              f"not installed here ({e})", name=e.name) from None
            # Installed, but its import fails (a dependency missing, a numpy it was not built for).
            raise type(e)(f"interpreter {interpreter!r} is installed but cannot be imported: {e}",
                          name=e.name) from None
    errors = []
    for name in INTERPRETERS:
        try:
            return importlib.import_module(_MODULES[name])
        except ImportError as e:  # try the next runtime
            errors.append(f"{name}: {e}")
    raise ImportError("no TFLite interpreter is installed (tried " + "; ".join(errors) + ")")


def _load_delegate_fn(module):
    # tf.lite keeps it under tf.lite.experimental.
    fn = getattr(module, "load_delegate", None)
    return fn if fn is not None else module.experimental.load_delegate


def _option_strings(options: Mapping[str, Any]) -> Dict[str, str]:
    known = {"num_threads", "fuse_composites"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown delegate option(s) {sorted(unknown)}; known: {sorted(known)}")
    out = {}
    for key, value in options.items():
        if isinstance(value, (bool, np.bool_)):
            out[key] = "true" if value else "false"
        else:
            out[key] = str(value)
    return out


MAX_DELEGATE_THREADS = 256  # libpkm_tflite's num_threads option takes [1, 256]


def _thread_count(threads) -> int:
    """``threads`` as a Python int: any integer (numpy's too, which the runtimes' Interpreter
    refuses: "type of num_threads should be int") in [1, 256]; else a ValueError (the delegate
    refuses it too, but the runtimes' load_delegate keeps only "Failed to load delegate")."""
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral) \
            or not 1 <= threads <= MAX_DELEGATE_THREADS:
        raise ValueError(f"num_threads must be an integer in [1, {MAX_DELEGATE_THREADS}], got {threads!r}")
    return int(threads)


def _runtime_thread_count(threads) -> int:
    """``threads`` as a Python int for an interpreter without the delegate: the runtimes' own
    range, 1 or more (the delegate's 256 does not bound it)."""
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"num_threads must be an integer >= 1 without the delegate, got {threads!r}")
    return int(threads)


def load_delegate(interpreter: str = "auto", **options):
    """Loads libpkm_tflite.so as an external delegate for the chosen interpreter.

    options: ``num_threads`` (an integer in [1, 256], numpy's too; default 1), ``fuse_composites``
    (bool, default False).
    """
    options["num_threads"] = _thread_count(options.get("num_threads", 1))
    module = interpreter_module(interpreter)
    return _load_delegate_fn(module)(delegate_path(), options=_option_strings(options))


def make_interpreter(model: Union[str, bytes, os.PathLike], interpreter: str = "auto",
                     num_threads: int = 1, fuse_composites: bool = False,
                     use_delegate: bool = True):
    """An interpreter for ``model`` (a path, or the model's bytes: bytes, bytearray, a
    memoryview, an mmap, any C-contiguous bytes-like object), not yet allocated: resize its
    inputs if need be, then ``allocate_tensors()``."""
    module = interpreter_module(interpreter)
    num_threads = _thread_count(num_threads) if use_delegate else _runtime_thread_count(num_threads)
    kwargs: Dict[str, Any] = {"num_threads": num_threads}
    content = _model_content(model)
    if content is not None:
        check_tflite_bytes(content, "make_interpreter")
        kwargs["model_content"] = content
    else:
        kwargs["model_path"] = os.fspath(model)
        _check_tflite_file(kwargs["model_path"])
    if use_delegate:
        kwargs["experimental_delegates"] = [load_delegate(
            interpreter, num_threads=num_threads, fuse_composites=fuse_composites)]
    try:
        return module.Interpreter(**kwargs)
    except ValueError as e:   # the runtime could not read the model: name the file
        if "model_path" not in kwargs:
            raise
        raise ValueError(f"{kwargs['model_path']}: {' '.join(runtime_messages(str(e))) or e}") from None


def _model_content(model) -> Optional[bytes]:
    """A bytes-like ``model`` as bytes, None for a path (the runtimes' model_content takes bytes
    only: a memoryview or an mmap was "incompatible function arguments" there)."""
    if isinstance(model, bytes):
        return model
    if isinstance(model, (str, os.PathLike)):
        return None
    try:
        view = memoryview(model)
    except TypeError:
        raise TypeError(f"make_interpreter: model must be a path (str or os.PathLike) or the model's "
                        f"bytes (a bytes-like object), got {type(model).__name__}") from None
    with view:
        if not view.c_contiguous:
            raise TypeError("make_interpreter: the model's bytes must be contiguous, got a strided "
                            f"{type(model).__name__}")
        return view.tobytes()


def _check_tflite_file(path: str) -> None:
    """ValueError naming the file where it cannot be a TFLite model: the runtimes' words for
    an empty or foreign file name neither ("Mmap of '3' at offset '0' failed with error '22'",
    "Model provided has model identifier 'o wo', should be 'TFL3'"). A missing file is left
    to the runtime ("Could not open")."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return
    if not head:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a TFLite model")
    if len(head) < 8 or head[4:8] != TFLITE_FILE_IDENTIFIER:
        raise ValueError(f"{path}: not a TFLite model (no file identifier "
                         f"{TFLITE_FILE_IDENTIFIER.decode()!r} at bytes 4..8; the file starts {head!r})")


def run_tflite(model: Union[str, bytes, os.PathLike],
               inputs: Union[Mapping[str, np.ndarray], Sequence[np.ndarray]],
               interpreter: str = "auto", num_threads: int = 1,
               fuse_composites: bool = False, use_delegate: bool = True,
               signature_key: Optional[str] = None) -> List[np.ndarray]:
    """Runs ``model`` once and returns its outputs (in output-detail order).

    ``inputs`` maps input names to arrays, or lists arrays in input order
    (``interp.get_input_details()``); one array (numpy's, a tf.Tensor...) is
    a one-input model's input. A name is either the input tensor's
    name (``serving_default_ids:0``) or the signature's input name (``ids``,
    as the SavedModel's signature and ``get_signature_runner()`` call it);
    an unknown name is a ValueError listing both kinds. Input shapes may
    differ from the model's (dynamic batch): inputs are resized before
    allocation.

    ``signature_key`` runs that signature of a multi-signature model (its own
    subgraph; without it the primary subgraph runs) through its signature
    runner: ``inputs`` by its input names, or listed in the order of
    ``get_signature_runner(key).get_input_details()``; the outputs in the order
    of its ``get_output_details()``. The runtime's refusal is a RuntimeError of its
    messages, one a line.
    """
    if not isinstance(inputs, (Mapping, list, tuple)) and hasattr(inputs, "__array__"):
        inputs = [inputs]   # one input's array (numpy's, a tf.Tensor, a torch tensor), not its rows
    interp = make_interpreter(model, interpreter, num_threads, fuse_composites, use_delegate)
    try:
        if signature_key is not None:
            return _run_signature(interp, signature_key, inputs)
        return _run_primary(interp, inputs)
    except RuntimeError as e:   # the runtime's refusal: its messages came glued ("...padding)Node number 1")
        raise RuntimeError("\n".join(runtime_messages(str(e))) or str(e)) from None


def _run_primary(interp, inputs) -> List[np.ndarray]:
    """run_tflite of the primary subgraph: resize, allocate, set, invoke."""
    details = interp.get_input_details()
    if isinstance(inputs, Mapping):
        pairs = _named_inputs(interp, details, inputs)
    else:
        if len(inputs) != len(details):
            raise ValueError(f"model has {len(details)} inputs, got {len(inputs)} arrays")
        pairs = [(d, np.asarray(v)) for d, v in zip(details, inputs)]
    for d, value in pairs:
        _check_input_dtype(d, value)
        if tuple(d["shape"]) != value.shape:
            interp.resize_tensor_input(d["index"], list(value.shape))
    allocate_primary_subgraph(interp)
    for d, value in pairs:
        interp.set_tensor(d["index"], value.astype(d["dtype"], copy=False))
    interp.invoke()
    return [interp.get_tensor(d["index"]) for d in interp.get_output_details()]


def _check_input_dtype(detail, value) -> None:
    """Integer inputs take integers that fit (astype() wraps int64 ids >= 2**31, truncates floats)."""
    if not np.issubdtype(detail["dtype"], np.integer):
        return
    name, info = np.dtype(detail["dtype"]).name, np.iinfo(detail["dtype"])
    scale, zero = (tuple(detail.get("quantization") or ()) + (0.0, 0))[:2]
    hint = f" (quantized: q = round(x / {scale:.6g}) {'-' if zero < 0 else '+'} {abs(zero)})" if scale else ""
    if not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"input {detail['name']!r} expects {name} values{hint}, got {value.dtype}")
    if value.size and (value.min() < info.min or value.max() > info.max):
        raise ValueError(f"input {detail['name']!r} is {name}{hint}; values "
                         f"[{value.min()}, {value.max()}] do not fit [{info.min}, {info.max}]")


def _run_signature(interp, key, inputs) -> List[np.ndarray]:
    """run_tflite of one signature, through its runner (which resizes and prepares its subgraph)."""
    keys = list(interp.get_signature_list())
    if key not in keys:
        raise ValueError(f"signature_key {key!r} is not a signature of the model; its signatures: {keys}")
    runner = interp.get_signature_runner(key)
    details = runner.get_input_details()
    if isinstance(inputs, Mapping):
        unknown, missing = sorted(set(inputs) - set(details)), sorted(set(details) - set(inputs))
        if unknown or missing:
            raise ValueError(f"signature {key!r} takes inputs {list(details)}; unknown {unknown}, "
                             f"missing {missing}")
        named = {name: np.asarray(inputs[name]) for name in details}
    else:
        if len(inputs) != len(details):
            raise ValueError(f"signature {key!r} has {len(details)} inputs {list(details)}, "
                             f"got {len(inputs)} arrays")
        named = {name: np.asarray(v) for name, v in zip(details, inputs)}
    for name, value in named.items():
        _check_input_dtype(details[name], value)
        named[name] = value.astype(details[name]["dtype"], copy=False)
    outputs = runner(**named)
    return [np.asarray(outputs[name]) for name in runner.get_output_details()]


# The runtimes' words for a node no kernel runs (LiteRT, tflite_runtime and tf.lite alike): a
# custom op, or a TensorFlow (Flex) op where the interpreter has no Flex delegate.
_NO_KERNEL = ("Encountered unresolved custom op",
              "Select TensorFlow op(s), included in the given model, is(are) not supported")


# tflite_runtime's words where the default delegate (XNNPack) it applies at the first
# allocate_tensors() failed.
_DEFAULT_DELEGATE_FAILED = "Failed to apply the default TensorFlow Lite delegate"


def allocate_primary_subgraph(interp) -> None:
    """``interp.allocate_tensors()``, which prepares the primary subgraph, the same in both
    runtimes: tflite_runtime 2.14 first applies XNNPack to every subgraph, which prepares them
    all at the converter's shapes, so another signature's kernel refusing those shapes (ids
    [-1, -1] against weights [-1, 3]) failed it, where LiteRT and the signature runners run the
    model. It applies XNNPack once (the primary subgraph keeps it): the retry prepares the
    primary subgraph alone, and a refusal of that one fails the retry too."""
    try:
        interp.allocate_tensors()
    except RuntimeError as e:
        if _DEFAULT_DELEGATE_FAILED not in str(e):
            raise
        interp.allocate_tensors()


def allocate_signature_subgraphs(interp, keys=None, missing_kernels=None) -> str:
    """Prepares the subgraph of every signature of an interpreter whose ``allocate_tensors()``
    has run (that prepares the primary subgraph only): a node without a kernel (a custom op
    neither the runtime nor the delegate has, a Flex op without the Flex delegate) in another
    signature's subgraph went unnoticed until that signature's first call; it is a RuntimeError
    naming the signature. Any other refusal is left to the calls: a subgraph is prepared at the
    converter's shapes (1 for each dynamic dimension), which its kernels may refuse where the
    calls' shapes are fine (ids [-1, -1] and weights [-1, 3] are [1, 1] and [1, 3]). The
    runtimes have no public call for it: this is the one their signature runner makes before
    each run. Returns the text of the last refusal left to the calls ("" if none): the Python
    runtimes' error text is every message reported so far, so it is what later errors start
    with, not part of them. keys: the signatures to prepare (None: all). missing_kernels: None,
    or a list that each such RuntimeError's text is appended to instead of raised."""
    reported = ""
    for key in interp.get_signature_list() if keys is None else keys:
        runner = interp.get_signature_runner(key)
        wrapper = getattr(runner, "_interpreter_wrapper", None)
        index = getattr(runner, "_subgraph_index", None)
        if wrapper is None or index is None:   # a runtime laid out otherwise: its first call tells
            continue
        try:
            wrapper.AllocateTensors(index)
        except RuntimeError as e:
            text = str(e)
            new = text[len(reported):] if text.startswith(reported) else text
            if any(words in new for words in _NO_KERNEL):
                if missing_kernels is None:
                    raise RuntimeError(f"signature {key!r} (subgraph {index}): {new}") from None
                missing_kernels.append(f"signature {key!r} (subgraph {index}): {new}")
            reported = text
    return reported


def _signature_inputs(interp, details) -> Dict[str, List[Dict[str, Any]]]:
    """{signature input name: [input details]} of the signatures whose inputs
    are the interpreter's (subgraph 0) inputs; empty where the runtime has no
    signature runners or the model no signatures."""
    by_index = {int(d["index"]): d for d in details}
    aliases: Dict[str, List[Dict[str, Any]]] = {}
    try:
        keys = list(interp.get_signature_list())
        runners = [interp.get_signature_runner(key) for key in keys]
        sig_details = [runner.get_input_details() for runner in runners]
    except (AttributeError, ValueError, RuntimeError, KeyError):
        return aliases
    for inputs in sig_details:
        for name, d in inputs.items():
            mine = by_index.get(int(d["index"]))
            # The same index and tensor name: the same tensor (another signature's
            # subgraph numbers its tensors on its own).
            if mine is not None and mine["name"] == d["name"] and \
                    all(m is not mine for m in aliases.get(name, [])):
                aliases.setdefault(name, []).append(mine)
    return aliases


def _named_inputs(interp, details, inputs: Mapping[str, Any]):
    """[(input detail, array)] for a {name: array} of tensor or signature input names."""
    by_name = {d["name"]: d for d in details}
    aliases = _signature_inputs(interp, details)
    accepted = (f"tensor names {sorted(by_name)}" +
                (f" or signature input names {sorted(aliases)}" if aliases else ""))
    pairs, seen, unknown = [], {}, []
    for name, value in inputs.items():
        if name in by_name:
            d = by_name[name]
        elif len(aliases.get(name, ())) == 1:
            d = aliases[name][0]
        elif name in aliases:
            raise ValueError(f"input name {name!r} is an input of several signatures "
                             f"({sorted(a['name'] for a in aliases[name])}): pass the tensor name")
        else:
            unknown.append(name)
            continue
        if d["name"] in seen:
            raise ValueError(f"inputs {seen[d['name']]!r} and {name!r} are the same input "
                             f"tensor {d['name']!r}")
        seen[d["name"]] = name
        pairs.append((d, np.asarray(value)))
    missing = sorted(set(by_name) - set(seen))
    if unknown or missing:
        alias_of = {a["name"]: n for n, ds in aliases.items() for a in ds if len(ds) == 1}
        missing = [f"{m!r} (signature name {alias_of[m]!r})" if m in alias_of else repr(m)
                   for m in missing]
        raise ValueError(f"model inputs are {accepted}; unknown {sorted(unknown)}, "
                         f"missing [{', '.join(missing)}]{_other_signature_hint(interp, unknown)}")
    return pairs


def _other_signature_hint(interp, unknown) -> str:
    """Where the unknown names are another signature's inputs: how to run that one."""
    try:
        signatures = interp.get_signature_list()
    except (AttributeError, ValueError, RuntimeError):
        return ""
    takers = [key for key, sig in signatures.items() if unknown and set(unknown) <= set(sig["inputs"])]
    return (f" (signature(s) {takers} take {sorted(unknown)}: run one with signature_key=, the "
            "primary subgraph runs without it)") if takers else ""


if __name__ == "__main__":   # `python -m pkm_serve.tflite MODEL`: pkm-serve tflite (tflite_cli.py)
    import runpy
    runpy.run_module("pkm_serve.tflite_cli", run_name="__main__", alter_sys=True)
