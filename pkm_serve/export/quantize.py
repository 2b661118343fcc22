"""`pkm-serve export --quantize-table int8` for the SavedModel: every fused
site's table becomes a row-wise int8 variable read by PkmQuantizedEmbeddingBag.

What changes in DST/<version> (after fusion and its verification):
  - the table variable keeps its place (object-graph node, checkpoint key,
    every handle and capture) but holds int8 [N, D]: the float table is gone
    from variables/;
  - its per-row scales and biases (float32 [N] each, 8 bytes a row, i.e. 8/D of
    the int8 table) are constants of one new library function per table, which
    each function holding a fused site (or a gather, below) calls: saved_model.pb
    holds them once, and no existing function signature, capture list or loader
    path changes, so
    `tf.saved_model.load`, the Session loader (TF Serving, `pkm-serve serve`)
    and a linked tensorflow_model_server all load it as they loaded the float one;
  - the fused ops become PkmQuantizedEmbeddingBag / PkmQuantizedRaggedEmbeddingBag;
  - a ResourceGather of the table outside a fused site (tf_keras' model.save()
    keeps each layer's call function) gathers int8 rows and dequantizes them.
The result is verified against the original SavedModel on the verification
inputs: the worst error relative to each output's scale (max |original|) must
stay within --quantize-tolerance (default 1e-2), else the export is refused.
The int8 .tflite (--tflite) is held to the same measure and tolerance
(pkm_serve.export.tflite_export).

For a trained Keras model: `pkm_serve.export.quantize_tables(model, dst)` exports it, fuses it
and quantizes it in one call.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List, Optional

import numpy as np

from pkm_serve.export import files
from pkm_serve.export import quantize_graph as QG
from pkm_serve.export import verify as V
from pkm_serve.export.errors import ExportError
from pkm_serve.export.files import SAVED_MODEL_PB

DEFAULT_TOLERANCE = 1e-2
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def _variables_prefix(export_dir: str) -> str:
    return os.path.join(export_dir, "variables", "variables")


def _variables_bytes(export_dir: str) -> int:
    return files.tree_bytes(os.path.join(export_dir, "variables"), skip=())


def _key_by_node(reader) -> Dict[int, str]:
    """Object-graph node id -> checkpoint key of its variable value (the
    checkpoint's object graph numbers nodes as the SavedModel's does)."""
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH_KEY))
    return {i: a.checkpoint_key for i, node in enumerate(graph.nodes) for a in node.attributes
            if a.name == "VARIABLE_VALUE"}


def _rewrite_checkpoint(export_dir: str, reader, new_values: Dict[str, np.ndarray]) -> None:
    """Writes variables/ again with `new_values` in place of those keys' tensors."""
    import tensorflow as tf

    names = sorted(reader.get_variable_to_dtype_map())
    tensors = [new_values[n] if n in new_values else reader.get_tensor(n) for n in names]
    tmp = tempfile.mkdtemp(prefix=".quantize-", dir=export_dir)
    try:
        tf.raw_ops.SaveV2(prefix=os.path.join(tmp, "variables"), tensor_names=names,
                          shape_and_slices=[""] * len(names), tensors=tensors)
        var_dir = os.path.join(export_dir, "variables")
        for name in os.listdir(var_dir):
            if name.startswith("variables."):
                os.remove(os.path.join(var_dir, name))
        for name in os.listdir(tmp):
            shutil.move(os.path.join(tmp, name), os.path.join(var_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_float(dtype) -> bool:
    """float32/float16/float64, and bfloat16 (ml_dtypes', which numpy does not
    count as np.floating): quantize_rows reads each as float64."""
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


def quantize_export_dir(export_dir: str) -> List[dict]:
    """Rewrites export_dir (a fused SavedModel) in place; returns one row per
    quantized table. ExportError (nothing changed) when a fused table cannot be."""
    import tensorflow as tf

    from pkm_serve import quantized
    from pkm_serve.export import saved_model_io

    path = os.path.join(export_dir, SAVED_MODEL_PB)
    proto = saved_model_io.read_saved_model(export_dir)
    reader = tf.train.load_checkpoint(_variables_prefix(export_dir))
    key_by_node = _key_by_node(reader)
    planned = [(mg, *QG.quantize_graph(mg, key_by_node)) for mg in proto.meta_graphs]
    if not any(plans for _, plans, _ in planned):
        raise ExportError("--quantize-table int8: no fused site reads a table variable, nothing to quantize")
    new_values, rows = {}, []
    for meta_graph, plans, all_bodies in planned:
        for key, plan in plans.items():
            if key not in new_values:
                table = reader.get_tensor(key)
                if table.ndim != 2 or not _is_float(table.dtype):
                    raise ExportError(f"cannot quantize table {key!r}: it is {table.dtype} {list(table.shape)}, "
                                      "not a float32, float16 or bfloat16 [N, D] matrix")
                try:
                    values, scales, biases = quantized.quantize_rows(table)
                except ValueError as err:
                    raise ExportError(f"cannot quantize table {key!r} ({table.dtype} {list(table.shape)}): "
                                      f"{err}") from None
                new_values[key] = (values, scales, biases)
                rows.append({"table": key, "copy_of": plan.copy_of, "shape": list(table.shape),
                             "dtype": str(table.dtype),
                             "float_bytes": int(table.nbytes), "int8_bytes": int(values.nbytes),
                             "row_param_bytes": int(scales.nbytes + biases.nbytes),
                             "sites": [f"{b}/{n}" for b, n in plan.sites]})
            values, scales, biases = new_values[key]
            row_params = QG.add_row_params_function(meta_graph.graph_def.library, key, scales, biases) \
                if plan.sites or plan.gathers else ""
            QG.rewrite(all_bodies, plan, row_params, rows=int(values.shape[0]))
            for node in QG.variable_nodes(meta_graph, key_by_node, key):
                node.variable.dtype = tf.int8.as_datatype_enum
        saved_model_io.record_new_ops(meta_graph)
    _rewrite_checkpoint(export_dir, reader, {k: v[0] for k, v in new_values.items()})
    with open(path, "wb") as f:
        f.write(proto.SerializeToString(deterministic=True))
    saved_model_io.write_fingerprint(export_dir)
    return rows


QUANTIZED_OPS = ("PkmQuantizedEmbeddingBag", "PkmQuantizedRaggedEmbeddingBag")


def check_not_quantized_yet(proto, quantize_table: str) -> None:
    """ExportError where SRC holds int8 bags (an int8 export) and this export, having found no
    float site to fuse, is asked to quantize it (its float tables are gone)."""
    graphs = [mg.graph_def for mg in proto.meta_graphs]
    nodes = [n for g in graphs for n in list(g.node) + [n for f in g.library.function for n in f.node_def]]
    found = sorted({n.op for n in nodes if n.op in QUANTIZED_OPS})
    if found:
        raise ExportError(f"--quantize-table {quantize_table}: this model's tables already are int8 (its bags "
                          f"run {', '.join(found)}, as the output of --quantize-table int8 does); export it "
                          "without --quantize-table to serve it as it is")


def _run(fn, inputs, what: str, name: str) -> dict:
    import tensorflow as tf

    try:
        return {k: v.numpy() for k, v in fn(**inputs).items()}
    except tf.errors.OpError as e:
        raise ExportError(f"--quantize-table int8: the {what} signature {name!r} fails on the "
                          f"verification inputs: {V.error_line(e.message)}") from None


def tolerance_or_default(tolerance: Optional[float]) -> float:
    """--quantize-tolerance, checked (> 0), or its default."""
    tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
    if not tolerance > 0:
        raise ExportError(f"--quantize-tolerance must be > 0, got {tolerance}")
    return tolerance


def relative_error(want, got):
    """(max |want - got|, scale = max |want|, their ratio): the measure --quantize-tolerance
    bounds, for the int8 SavedModel and the int8 .tflite alike. NaN where the float
    model has NaN, and an inf where it has the same inf, count as equal; a new NaN makes the error NaN (over
    any tolerance).
    A string output of numbers (tf.strings.as_string) is compared as those numbers; one of
    other text (a class name) has no scale: its error is the fraction of elements that
    differ (scale 1)."""
    w, g = np.asarray(want), np.asarray(got)
    if w.dtype.kind in "SUO":
        try:
            w, g = w.astype(np.float64), g.astype(np.float64)
        except (TypeError, ValueError):
            differ = float(np.mean(w != g)) if w.size else 0.0
            return differ, 1.0, differ
    w, g = w.astype(np.float64), g.astype(np.float64)
    # NaN and +-inf where the float model has the same count as equal (an all-masked bag's -inf): inf - inf
    # would be NaN, and an inf scale would hide every other error.
    same = (np.isnan(w) & np.isnan(g)) | (np.isinf(w) & (w == g))
    w, g = np.where(same, 0.0, w), np.where(same, 0.0, g)
    scale = float(np.max(np.abs(w))) if w.size else 0.0
    err = float(np.max(np.abs(w - g))) if w.size else 0.0
    return err, scale, (err / scale if scale > 0 else err)


def verify_quantized(src: str, quantized_dir: str, signatures, index_limit: int, samples,
                     batch_size: int, tolerance: float, feeds: Optional[dict] = None) -> List[dict]:
    """Worst error of every output of the quantized model against the original,
    relative to the output's scale; ExportError past `tolerance`. Inputs are
    those of the float verification (`feeds`: pkm_serve.export.feeds)."""
    import tensorflow as tf

    original, quantized = tf.saved_model.load(src), tf.saved_model.load(quantized_dir)
    rows = []
    for name in signatures:
        fn_orig, fn_q = original.signatures[name], quantized.signatures[name]
        specs = V.signature_input_specs(fn_orig)
        inputs = (V.sample_inputs_for(name, specs, samples) if samples is not None
                  else V.generate_inputs(specs, index_limit, batch_size, feeds=(feeds or {}).get(name)))
        want = _run(fn_orig, inputs, "original", name)
        got = _run(fn_q, inputs, "quantized", name)
        for key in sorted(want):
            err, scale, relative = relative_error(want[key], got[key])
            rows.append({"signature": name, "output": key, "max_abs_err": err, "output_scale": scale,
                         "relative_err": relative})
            if not relative <= tolerance:  # also refuses NaN
                raise ExportError(f"--quantize-table int8: signature {name!r} output {key!r} differs from the "
                                  f"float model by {err:.3g} = {relative:.3g} of its scale {scale:.3g}, over "
                                  f"--quantize-tolerance {tolerance:g}")
    return rows


def quantize_version(tmp_dir: str, src: str, signatures, index_limit: int, samples, batch_size: int,
                     tolerance: Optional[float], feeds: Optional[dict] = None) -> dict:
    """The exporter's hook: quantizes tmp_dir, verifies it, reports sizes and errors."""
    tolerance = tolerance_or_default(tolerance)
    before = _variables_bytes(tmp_dir)
    tables = quantize_export_dir(tmp_dir)
    after = _variables_bytes(tmp_dir)
    verification = verify_quantized(src, tmp_dir, signatures, index_limit, samples, batch_size, tolerance,
                                    feeds)
    return {"tables": tables, "variables_bytes_before": before, "variables_bytes_after": after,
            "tolerance": tolerance, "worst_relative_err": max((r["relative_err"] for r in verification),
                                                              default=0.0),
            "verification": verification}


def format_quantization(q: dict) -> List[str]:
    lines = [f"int8 tables: variables {q['variables_bytes_before']} -> {q['variables_bytes_after']} bytes "
             f"({q['variables_bytes_after'] / max(q['variables_bytes_before'], 1):.2f}x); worst output error "
             f"{q['worst_relative_err']:.3g} of the output scale (tolerance {q['tolerance']:g})"]
    for t in q["tables"]:
        copy = f" (the saved copy of {t['copy_of']})" if t.get("copy_of") else ""
        lines.append(f"  quantized {t['table']}{copy} {t['shape']} {t['dtype']}: {t['float_bytes']} -> "
                     f"{t['int8_bytes']} bytes (+ {t['row_param_bytes']} of row scales/biases in saved_model.pb)")
    return lines
