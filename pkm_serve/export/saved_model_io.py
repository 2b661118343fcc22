"""Reading and rewriting a SavedModel's files: saved_model.pb parsed with clear errors,
the OpDefs of new ops recorded in the MetaGraph, the fingerprint recomputed. Shared by
the exporter and the int8 quantization (which must not import each other)."""

from __future__ import annotations

import os

from pkm_serve.export.errors import ExportError
from pkm_serve.export.files import FINGERPRINT_PB, SAVED_MODEL_PB

def read_saved_model(src: str):
    """Parses SRC/saved_model.pb; clear errors for anything that is not a TF2
    SavedModel directory."""
    from tensorflow.core.protobuf import saved_model_pb2
    from google.protobuf.message import DecodeError

    if not os.path.isdir(src):
        hint = ""
        if os.path.isfile(src) and src.lower().endswith((".keras", ".h5", ".hdf5")):
            hint = ("; this is a Keras model file: write a SavedModel with model.export(DIR) (Keras 3) or "
                    "model.save(DIR) with no extension (tf_keras)")
        raise ExportError(f"{src} is not a directory: SRC must be a SavedModel directory "
                          f"(the one holding saved_model.pb and variables/){hint}")
    path = os.path.join(src, SAVED_MODEL_PB)
    if not os.path.isfile(path):
        hint = ""
        numeric = sorted(d for d in os.listdir(src) if d.isdigit())
        if numeric:
            hint = f" (did you mean the version directory {os.path.join(src, numeric[-1])}?)"
        raise ExportError(f"{src} is not a SavedModel: no {SAVED_MODEL_PB} in it{hint}")
    proto = saved_model_pb2.SavedModel()
    try:
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
    except DecodeError as e:
        raise ExportError(f"{path} is not a valid SavedModel protobuf: {e}") from None
    if not proto.meta_graphs:
        raise ExportError(f"{path} holds no MetaGraph")
    if not any(mg.graph_def.library.function for mg in proto.meta_graphs):
        raise ExportError(f"{src} has no TF2 functions: only TF2 SavedModels "
                          "(tf.saved_model.save, Keras model.export) can be fused")
    return proto


def record_new_ops(meta_graph) -> None:
    """Adds the OpDefs of ops the rewrite introduced to the MetaGraph's
    stripped_op_list, which loaders use to restore default attrs."""
    from tensorflow.python.framework import op_def_registry

    op_list = meta_graph.meta_info_def.stripped_op_list
    listed = {op.name for op in op_list.op}
    used = {n.op for f in meta_graph.graph_def.library.function for n in f.node_def}
    for name in sorted(used - listed):
        op_def = op_def_registry.get(name)
        if op_def is not None:
            op_list.op.add().CopyFrom(op_def)


def write_fingerprint(export_dir: str) -> None:
    # The fingerprint hashes saved_model.pb: recompute it for the new graph.
    try:
        from tensorflow.python.saved_model import fingerprinting_utils
        fingerprinting_utils.write_fingerprint(export_dir)
    except Exception:  # noqa: BLE001 - an old-style SavedModel without one loads too
        path = os.path.join(export_dir, FINGERPRINT_PB)
        if os.path.exists(path):
            os.remove(path)
