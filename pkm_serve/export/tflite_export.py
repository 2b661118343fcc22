"""`--tflite FILE`: convert the exported SavedModel to TFLite and verify it.

The converter keeps `PkmEmbeddingBag` / `PkmRaggedEmbeddingBag` as custom
ops (attrs in a flexbuffer map, `allow_custom_ops=True`); `libpkm_tflite.so`
(pkm_serve.tflite) runs them. Every other op must be a TFLite builtin: a
.tflite that would need any other custom (or Flex) op is refused, naming it.
TFLite stores tables as constants inside the FlatBuffer, which cannot exceed
2 GB: bigger models are refused up front with an explanation (int8
quantisation happens after conversion, so it cannot rescue them).
"""
from __future__ import annotations

import os
import re
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pkm_serve import tflite as pkm_tflite
from pkm_serve.export import verify as V
from pkm_serve.export.check_then import without_check_then
from pkm_serve.export.errors import ExportError
from pkm_serve.export.files import current_umask
from pkm_serve.export.progress import Progress

FLATBUFFER_LIMIT = 2 ** 31 - 1
# Graph, signatures and FlatBuffer bookkeeping besides the tables.
_HEADROOM = 64 * 2 ** 20
SUPPORTED_CUSTOM_OPS = pkm_tflite.CUSTOM_OP_NAMES


def variable_bytes(saved_model_dir: str, signatures: Optional[Sequence[str]] = None) -> int:
    """Bytes of the variables `signatures` read, each once: what the converter makes
    constants of. A checkpoint can hold more: Keras 3's export saves every variable
    twice (under variables/ and _all_variables/), tf_keras the optimizer's slots. Where
    the SavedModel does not say which variables a signature captures (TF1), all of them."""
    import tensorflow as tf
    prefix = os.path.join(saved_model_dir, "variables", "variables")
    if not os.path.exists(prefix + ".index"):
        return 0
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    keys = _captured_variable_keys(saved_model_dir, reader, signatures) if signatures else None
    total = 0
    for name, shape in shapes.items():
        if dtypes[name] == tf.string or (keys is not None and name not in keys):
            continue
        total += int(np.prod(shape, dtype=np.int64)) * dtypes[name].size
    return total


def _captured_variable_keys(saved_model_dir: str, reader, signatures: Sequence[str]):
    """Checkpoint keys of the variables the signatures' functions capture, or None
    where a signature's function or a capture's key cannot be found."""
    from pkm_serve.export import saved_model_io
    from pkm_serve.export.quantize import _key_by_node

    try:
        graph = saved_model_io.read_saved_model(saved_model_dir).meta_graphs[0].object_graph_def
    except ExportError:   # a TF1 SavedModel (no functions)
        return None
    if not graph.nodes:
        return None
    by_name = {c.local_name: c.node_id for c in graph.nodes[0].children}
    signature_fns = {c.local_name: c.node_id for c in graph.nodes[by_name["signatures"]].children} \
        if "signatures" in by_name else {}
    key_by_node = _key_by_node(reader)
    keys = set()
    for key in signatures:
        if key not in signature_fns:
            return None
        node = graph.nodes[signature_fns[key]]
        names = ([node.bare_concrete_function.concrete_function_name] if node.HasField("bare_concrete_function")
                 else list(node.function.concrete_functions))
        for name in names:
            if name not in graph.concrete_functions:
                return None
            for node_id in graph.concrete_functions[name].bound_inputs:
                if graph.nodes[node_id].WhichOneof("kind") == "variable":
                    if node_id not in key_by_node:
                        return None
                    keys.add(key_by_node[node_id])
    return keys


def check_size(saved_model_dir: str, signatures: Optional[Sequence[str]] = None) -> int:
    size = variable_bytes(saved_model_dir, signatures)
    if size + _HEADROOM > FLATBUFFER_LIMIT:
        raise ExportError(
            f"the variables the converted signatures read take {size / 2**30:.2f} GiB: a .tflite FlatBuffer "
            "holds its tables as constants and cannot exceed 2 GB (int8 quantisation "
            "runs after conversion, so it cannot bring it under). Serve the SavedModel "
            "(pkm-serve serve) instead, or split the table across smaller models.")
    return size


def convert(saved_model_dir: str, signatures: Sequence[str], not_fused: Sequence = ()
            ) -> bytes:
    import tensorflow as tf

    try:
        with without_check_then(saved_model_dir) as convertible:
            converter = tf.lite.TFLiteConverter.from_saved_model(convertible, signature_keys=list(signatures))
            converter.allow_custom_ops = True
            return converter.convert()
    except Exception as e:  # noqa: BLE001 - the converter raises many types
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        # The converter names each op it cannot lower as tf.OpName.
        ops = sorted(set(re.findall(r"\btf\.([A-Z][A-Za-z0-9]+)", str(e))))
        detail = f"ops with no TFLite builtin: {ops}; " if ops else ""
        raise ExportError(
            f"TFLite conversion of signatures {list(signatures)} failed: {detail}"
            f"{' / '.join(lines[:4])} (pick convertible signatures with --signatures)"
            + _not_fused_note(not_fused)) from None


def _not_fused_note(not_fused: Sequence) -> str:
    """The skipped sites, whose composite ops stayed in the graph."""
    if not not_fused:
        return ""
    return "; sites left composite: " + "; ".join(
        f"{s.root} ({s.reason})" for s in not_fused[:4]) + (
        f" and {len(not_fused) - 4} more" if len(not_fused) > 4 else "")


# The model's own input preprocessing, not an embedding site.
_PREPROCESSING_OPS = ("ParseExample", "ParseExampleV2", "ParseSingleExample",
                      "StringSplit", "StringSplitV2", "StringToHashBucketFast",
                      "StringLower", "StaticRegexReplace", "RegexReplace")


def _preprocessing_note(unsupported: Sequence[str]) -> str:
    own = [op for op in unsupported if op in _PREPROCESSING_OPS]
    if not own:
        return ""
    return (f"; {own} parse or split the model's inputs (no embedding site): serve "
            "that signature from the exported SavedModel, or convert only signatures "
            "that take parsed features (--signatures)")


def _model(model: bytes):
    schema = pkm_tflite.flatbuffer_schema()
    return schema.Model.GetRootAsModel(bytearray(model), 0)


def custom_ops(model: bytes) -> List[str]:
    """Names of the custom ops a .tflite uses."""
    root = _model(model)
    names = set()
    for i in range(root.OperatorCodesLength()):
        code = root.OperatorCodes(i).CustomCode()
        if code:
            names.add(code.decode() if isinstance(code, bytes) else code)
    return sorted(names)


def _tflite_signatures(model: bytes) -> List[str]:
    root = _model(model)
    keys = [root.SignatureDefs(i).SignatureKey() for i in range(root.SignatureDefsLength())]
    return [k.decode() if isinstance(k, bytes) else k for k in keys]


def _refuse_non_finite_mismatch(name: str, key: str, want: np.ndarray, got: np.ndarray) -> None:
    """VerificationError where the int8 .tflite differs from the float model at an inf/NaN of the float
    model's (a masked max's -inf comes out of the converter as the float32 lowest): no scale measures that."""
    if want.dtype.kind not in "fc" or want.shape != got.shape:
        return
    w, g = want.astype(np.float64), got.astype(np.float64)
    lost = ~np.isfinite(w) & ~((np.isnan(w) & np.isnan(g)) | (w == g))
    if lost.any():
        at = tuple(int(i) for i in np.argwhere(lost)[0])
        raise V.VerificationError(
            f"signature {name!r} output {key!r} of the int8 .tflite differs from the float model at "
            f"{int(lost.sum())} of {w.size} elements where the float model gives inf/NaN (at {list(at)}: "
            f"{w[at]} in the float model, {g[at]} in the .tflite)")


def _int8_rows(name: str, want: dict, got: dict, tolerance: float) -> Tuple[List[dict], float]:
    """The int8 .tflite against the original model, by the measure --quantize-tolerance
    bounds for the int8 SavedModel (pkm_serve.export.quantize.relative_error): rows
    shaped as the float ones (|err| <= atol = tolerance * the output's scale, rtol 0)
    and the worst relative error; VerificationError past the tolerance."""
    from pkm_serve.export.quantize import relative_error

    if set(want) != set(got):
        raise V.VerificationError(f"signature {name!r}: outputs differ: {sorted(want)} vs {sorted(got)}")
    rows, worst = [], 0.0
    for key in sorted(want):
        w, g = np.asarray(want[key]), np.asarray(got[key])
        if w.shape != g.shape:
            raise V.VerificationError(f"signature {name!r} output {key!r}: shape {list(g.shape)} != "
                                      f"original {list(w.shape)}")
        _refuse_non_finite_mismatch(name, key, w, g)
        err, scale, relative = relative_error(w, g)
        if not relative <= tolerance:  # also refuses NaN
            raise V.VerificationError(
                f"signature {name!r} output {key!r} of the int8 .tflite differs from the float model "
                f"by {err:.3g} = {relative:.3g} of its scale {scale:.3g}, over --quantize-tolerance "
                f"{tolerance:g}")
        worst = max(worst, relative)
        rows.append({"signature": name, "output": key, "shape": list(w.shape), "max_abs_err": err,
                     "rtol": 0.0, "atol": tolerance * scale})
    return rows, worst


def verify_tflite(model: bytes, saved_model_dir: str, signatures: Sequence[str],
                  index_limit: int, samples: Optional[Dict[str, np.ndarray]],
                  batch_size: int, quantized: bool, precision: Optional[str] = None,
                  feeds: Optional[dict] = None, original_dir: Optional[str] = None,
                  tolerance: Optional[float] = None) -> Tuple[str, List[dict], Optional[float]]:
    """Runs each signature in the TFLite interpreter with the pkm delegate and
    compares with the exported SavedModel; with int8 tables, with the original
    model (`original_dir`, else the exported one) within --quantize-tolerance
    (`tolerance`), as the int8 SavedModel is. Returns (status, rows, worst
    relative error of an int8 .tflite or None). Where the
    .tflite gives inf/NaN that the SavedModel does not, the error says so and
    whether the stock converter's .tflite of `original_dir` (the unfused
    model) does the same."""
    import tensorflow as tf

    from pkm_serve.export.quantize import tolerance_or_default

    if not os.path.exists(pkm_tflite.delegate_path()):
        return (f"not verified: the delegate {pkm_tflite.delegate_path()} is not built "
                "(make build)"), [], None
    interp = pkm_tflite.make_interpreter(model)
    loaded = tf.saved_model.load(saved_model_dir)
    original = tf.saved_model.load(original_dir) if quantized and original_dir else None
    tolerance = tolerance_or_default(tolerance) if quantized else None
    rows, worst = [], None
    # The converter keeps one signature per function: aliases such as Keras'
    # 'serve' / 'serving_default' come out as one.
    present = [name for name in signatures if name in interp.get_signature_list()]
    for name in present:
        fn = loaded.signatures[name]
        specs = V.signature_input_specs(fn)
        inputs = (V.sample_inputs_for(name, specs, samples) if samples is not None
                  else V.generate_inputs(specs, index_limit, batch_size,
                                         feeds=(feeds or {}).get(name)))
        try:   # (where nothing was fused, the SavedModel was not run before)
            want = {k: v.numpy() for k, v in fn(**inputs).items()}
        except tf.errors.OpError as e:
            raise V.inputs_refused(name, samples, e) from None
        got = interp.get_signature_runner(name)(**inputs)
        try:
            if quantized:
                reference = want if original is None else {
                    k: v.numpy() for k, v in original.signatures[name](**inputs).items()}
                int8_rows, int8_worst = _int8_rows(name, reference, got, tolerance)
                rows.extend(int8_rows)
                worst = max(worst or 0.0, int8_worst)
            else:
                rows.extend(V.compare_outputs(name, want, got, precision=precision))
        except V.VerificationError as e:
            bad = _non_finite_outputs(want, got)
            if not bad and quantized:
                raise
            raise V.VerificationError(
                _mismatch_message(name, e, bad, original_dir, inputs, want)) from None
    return "verified with the pkm delegate", rows, worst


def tables_note(info: dict) -> str:
    """The report's word on the .tflite's tables: float, or int8 and its worst error."""
    if not info.get("quantize_table"):
        return "float"
    if info.get("worst_relative_err") is None:
        return info["quantize_table"]
    return (f"{info['quantize_table']} (worst output error {info['worst_relative_err']:.3g} of the output "
            f"scale, tolerance {info['tolerance']:g})")


def _non_finite_outputs(want: dict, got: dict) -> Dict[str, Tuple[int, int]]:
    """{output: (elements, of them non-finite in the .tflite and finite in the SavedModel)}."""
    bad = {}
    for key in sorted(want):
        w, g = np.asarray(want[key]), np.asarray(got.get(key))
        if w.shape != g.shape or not (np.issubdtype(w.dtype, np.floating) or w.dtype.name == "bfloat16"):
            continue
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        count = int(np.sum(np.isfinite(w64) & ~np.isfinite(g64)))
        if count:
            bad[key] = (int(w.size), count)
    return bad


def _as_tflite_comparison(message: str, differs: str) -> str:
    """verify.compare_outputs' message of a SavedModel (expected) and a .tflite (actual) in those words."""
    return message.replace("fused differs from original", differs).replace(
        "NaN in the original alone", "NaN in the SavedModel alone").replace(
        "NaN in the fused model alone", "NaN in the .tflite alone")


def _mismatch_message(name: str, error: Exception, bad: Dict[str, Tuple[int, int]],
                      original_dir: Optional[str], inputs: Dict[str, np.ndarray], want: dict) -> str:
    """The float .tflite does not match the SavedModel (inf/NaN where the SavedModel is
    finite: `bad`; or other values): say so, and whether the stock TFLiteConverter's
    .tflite of the original (unfused) model, which has no pkm op at all, also fails to
    match the SavedModel on the same inputs (its wrong values need not be the same
    ones: a mis-converted model can read garbage, finite or not, run to run)."""
    if bad:
        where = ", ".join(f"{key!r} ({n} of {size} elements)" for key, (size, n) in bad.items())
        head = (f"signature {name!r}: the .tflite gives non-finite values (inf/NaN) where the "
                f"SavedModel's outputs are finite: {where}. ")
    else:
        head = _as_tflite_comparison(str(error), "the .tflite differs from the SavedModel") + ". "
    if original_dir is None:
        return head + ("Convert the original model with the stock tf.lite.TFLiteConverter and "
                       "run it on the same inputs to see whether the converter does that without "
                       "the fused op.")
    try:
        stock = convert(original_dir, [name])
        runner = pkm_tflite.make_interpreter(stock, use_delegate=False).get_signature_runner(name)
        theirs = runner(**inputs)
    except Exception as e:  # noqa: BLE001 - the converter and runtimes raise many types
        first = (pkm_tflite.runtime_messages(str(e)) or [type(e).__name__])[0]
        return head + (f"The original model could not be checked the same way (stock conversion "
                       f"of {original_dir}: {first[:300]}); the fused op is not known to be at fault.")
    try:
        V.compare_outputs(name, want, theirs)
    except V.VerificationError as e:
        stock_bad = _non_finite_outputs(want, theirs)
        how = ("non-finite values for " + ", ".join(f"{k!r} ({n} of {size} elements)"
                                                      for k, (size, n) in stock_bad.items())
               if stock_bad else _as_tflite_comparison(str(e), "differs from the SavedModel"))
        return head + (f"The stock tf.lite.TFLiteConverter's .tflite of the ORIGINAL model "
                       f"({original_dir}, unfused, no pkm op) is wrong on the same inputs too "
                       f"({how}): the converter's lowering of the rest of the model does this, "
                       "not the fused op. Serve the exported SavedModel, or make the model "
                       "convertible (a Keras model saved with model.export() rather than "
                       "tf.saved_model.save, for one) and export again.")
    return head + (f"The stock tf.lite.TFLiteConverter's .tflite of the original model "
                   f"({original_dir}, unfused) matches the SavedModel on the same inputs: the "
                   "fused .tflite is at fault; please report it with the model.")


def _check_custom_ops(model: bytes, not_fused: Sequence = ()) -> List[str]:
    found = custom_ops(model)
    unsupported = [op for op in found if op not in SUPPORTED_CUSTOM_OPS]
    if unsupported:
        raise ExportError(f"the .tflite would need custom ops {unsupported} that no TFLite "
                          "runtime here provides (only builtins and "
                          f"{list(SUPPORTED_CUSTOM_OPS)} run with the pkm delegate)"
                          + (_int8_bags_note(unsupported) or _not_fused_note(not_fused)
                             or _preprocessing_note(unsupported)))
    return found


def _int8_bags_note(unsupported) -> str:
    """Where the .tflite would run int8 bags (an int8 export's): what to export instead."""
    from pkm_serve.export.quantize import QUANTIZED_OPS

    if not any(op in QUANTIZED_OPS for op in unsupported):
        return ""
    return (". This model's tables already are int8 (the output of --quantize-table int8): export the float "
            "model it came from with --quantize-table int8 --tflite FILE for an int8 .tflite")


def _signature_interfaces(export_dir: str) -> Dict[str, tuple]:
    """Each SavedModel signature's method and input/output keys, dtypes and
    shapes: Keras' 'serve' and 'serving_default' are one function under two
    names (same interface, other tensor names), which the converter writes once."""
    from tensorflow.python.saved_model import loader_impl

    def specs(tensors):
        return sorted((k, v.dtype, v.tensor_shape.SerializeToString(deterministic=True)) for k, v in tensors.items())

    defs = loader_impl.parse_saved_model(export_dir).meta_graphs[0].signature_def
    return {key: (d.method_name, specs(d.inputs), specs(d.outputs)) for key, d in defs.items()}


def check_signatures_kept(model: bytes, export_dir: str, signatures: Sequence[str]) -> None:
    """The converter can leave a requested signature out of the .tflite without an
    error; a signature missing that is not another name of one kept (the same
    interface: a different function with the same one would pass unnoticed) is refused."""
    kept = _tflite_signatures(model)
    interfaces = _signature_interfaces(export_dir)
    dropped = [name for name in signatures if name not in kept and
               not any(interfaces.get(name) == interfaces.get(other) for other in kept)]
    if dropped:
        raise ExportError(f"the TFLite converter left signature(s) {', '.join(map(repr, dropped))} out of the "
                          f".tflite (it kept {', '.join(map(repr, kept)) or 'none'}); convert them in a .tflite of "
                          "their own with --signatures")


def defaults_not_carried(export_dir: str, kept: Sequence[str]) -> Dict[str, List[str]]:
    """{signature: its inputs with SignatureDef defaults (tf.function default arguments)} of
    the signatures the .tflite holds: a TFLite SignatureDef has no defaults (the converter
    drops them, and TF Serving's TFLite servable has none), so a .tflite version needs those
    inputs in every request, where the SavedModel version feeds the defaults."""
    from tensorflow.python.saved_model import loader_impl
    defs = loader_impl.parse_saved_model(export_dir).meta_graphs[0].signature_def
    return {key: sorted(defs[key].defaults) for key in kept if key in defs and defs[key].defaults}


def _defaults_note(dropped: Dict[str, List[str]]) -> str:
    return "".join(f"; signature {key!r} input(s) {inputs} have defaults, which a .tflite cannot hold: "
                   "a TFLite version (--prefer_tflite_model) needs them in every request"
                   for key, inputs in dropped.items())


def convert_and_verify(export_dir: str, signatures: Sequence[str], out_path: str,
                       quantize: Optional[str], src: str, index_limit: int,
                       samples, batch_size: int, progress: Optional[Progress] = None,
                       precision: Optional[str] = None, feeds: Optional[dict] = None,
                       not_fused: Sequence = (), tolerance: Optional[float] = None):
    """Writes the .tflite to a temporary file beside out_path (renamed by the
    caller once everything passed). Returns (tmp_path, report dict).
    `tolerance`: --quantize-tolerance, for int8 tables."""
    progress = progress or Progress(quiet=True)
    if quantize == "int8":
        from pkm_serve.export.quantize import tolerance_or_default
        tolerance = tolerance_or_default(tolerance)  # refused before converting
    size = check_size(export_dir, signatures)
    with progress.phase(f"converting to TFLite ({size / 2**20:.1f} MiB of variables)"):
        model = convert(export_dir, signatures, not_fused)
    if quantize == "int8":
        with progress.phase("quantising tables to per-row int8"):
            try:
                model = pkm_tflite.quantize_table_int8(model)
            except ValueError as e:
                raise ExportError(f"--quantize-table int8: {e}") from None
    check_signatures_kept(model, export_dir, signatures)
    found_ops = _check_custom_ops(model, not_fused)
    if len(model) > FLATBUFFER_LIMIT:
        raise ExportError(f"the .tflite would be {len(model)} bytes, over the 2 GB "
                          "FlatBuffer limit")
    with progress.phase("verifying the .tflite through the pkm delegate"):
        try:
            status, rows, worst = verify_tflite(model, export_dir, signatures, index_limit,
                                                samples, batch_size, quantize == "int8", precision,
                                                feeds, original_dir=src, tolerance=tolerance)
        except V.VerificationError as e:
            raise ExportError(f"TFLite verification failed: {e}") from None
        except (RuntimeError, ValueError) as e:
            # (the runtime's messages each on its own: they came glued, "...padding)Node number 1")
            raise ExportError(f"the .tflite does not run in the interpreter with the pkm delegate: "
                              f"{'; '.join(pkm_tflite.runtime_messages(str(e))) or type(e).__name__}") from None
    out_dir = os.path.dirname(out_path) or "."
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".tflite", dir=out_dir)
    with os.fdopen(fd, "wb") as f:
        f.write(model)
    os.chmod(tmp, 0o666 & ~current_umask())
    info = {"file": out_path, "bytes": len(model), "table_bytes_in_savedmodel": size,
            "custom_ops": found_ops, "signatures": _tflite_signatures(model),
            "quantize_table": quantize, "status": status, "verification": rows,
            "tolerance": tolerance if quantize == "int8" else None, "worst_relative_err": worst}
    info["status"] += _defaults_note(defaults_not_carried(export_dir, info["signatures"]))
    return tmp, info
