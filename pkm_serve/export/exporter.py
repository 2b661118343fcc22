"""`pkm-serve export`: fuse composite gather-sum sites of a SavedModel.

The rewrite edits the FunctionDefs inside saved_model.pb in place: function
names, signatures, the object graph and the variables/ directory stay exactly
as they were, so variables remain variables (a 1 GB table never becomes a
graph constant) and TF Serving loads the result like the original. Everything
is written into a temporary directory next to DST/<version> and renamed into
place only after the fused signatures have been verified.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np

from pkm_serve.export.arguments import build_parser
from pkm_serve.export.patterns import Site, rewrite_function

SAVED_MODEL_PB = "saved_model.pb"
FINGERPRINT_PB = "fingerprint.pb"


class ExportError(Exception):
    """A problem the user can fix; the message says what it is."""


@dataclasses.dataclass
class ExportResult:
    src: str
    dst: str                      # DST/<version>
    version: int
    sites: List[Site]
    batch_size: int
    verification: List[dict] = dataclasses.field(default_factory=list)
    tflite: Optional[dict] = None
    message: str = ""

    @property
    def fused(self) -> List[Site]:
        return [s for s in self.sites if s.status == "fused"]

    @property
    def skipped(self) -> List[Site]:
        return [s for s in self.sites if s.status != "fused"]

    def to_json(self) -> dict:
        saved = [s.saved_bytes_at_batch for s in self.fused if s.saved_bytes_at_batch]
        return {
            "src": self.src, "dst": self.dst, "version": self.version,
            "batch_size": self.batch_size, "message": self.message,
            "sites_found": len(self.sites), "sites_fused": len(self.fused),
            "sites_skipped": len(self.skipped),
            "saved_bytes_at_batch": int(sum(saved)),
            "sites": [s.to_json() for s in self.sites],
            "verification": self.verification, "tflite": self.tflite,
        }


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _progress(iterable, desc: str, quiet: bool, total: Optional[int] = None):
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, disable=quiet, leave=False,
                file=sys.stderr, unit="fn" if desc.startswith("rewrit") else "it")


def read_saved_model(src: str):
    """Parses SRC/saved_model.pb; clear errors for anything that is not a TF2
    SavedModel directory."""
    from tensorflow.core.protobuf import saved_model_pb2
    from google.protobuf.message import DecodeError

    if not os.path.isdir(src):
        raise ExportError(f"{src} is not a directory: SRC must be a SavedModel directory "
                          "(the one holding saved_model.pb and variables/)")
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


def fuse_saved_model_proto(proto, batch_size: int, quiet: bool = True,
                           fuse: bool = True) -> List[Site]:
    """Rewrites every function of every MetaGraph in place; returns the sites."""
    sites: List[Site] = []
    for meta_graph in proto.meta_graphs:
        library = meta_graph.graph_def.library
        sigs = {f.signature.name: f.signature for f in library.function}
        for fdef in _progress(library.function, "rewriting functions", quiet):
            sites.extend(rewrite_function(fdef, sigs, batch_size, fuse=fuse))
        _record_new_ops(meta_graph)
    return sites


def _record_new_ops(meta_graph) -> None:
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


def _serving_signatures(proto) -> List[str]:
    return sorted(k for k in proto.meta_graphs[0].signature_def
                  if not k.startswith("__"))


def _next_version(dst: str) -> int:
    if not os.path.isdir(dst):
        return 1
    versions = [int(d) for d in os.listdir(dst) if d.isdigit()]
    return max(versions) + 1 if versions else 1


def _copy_tree(src: str, dst: str) -> None:
    """Copies SRC except saved_model.pb and fingerprint.pb (both rewritten)."""
    os.makedirs(dst, exist_ok=True)
    for entry in os.listdir(src):
        if entry in (SAVED_MODEL_PB, FINGERPRINT_PB):
            continue
        from_path, to_path = os.path.join(src, entry), os.path.join(dst, entry)
        if os.path.isdir(from_path):
            shutil.copytree(from_path, to_path)
        else:
            shutil.copy2(from_path, to_path)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(path) for f in files)


def _write_fingerprint(export_dir: str) -> None:
    # The fingerprint hashes saved_model.pb: recompute it for the new graph.
    try:
        from tensorflow.python.saved_model import fingerprinting_utils
        fingerprinting_utils.write_fingerprint(export_dir)
    except Exception:  # noqa: BLE001 - an old-style SavedModel without one loads too
        path = os.path.join(export_dir, FINGERPRINT_PB)
        if os.path.exists(path):
            os.remove(path)


def _index_limit(sites: Sequence[Site], proto) -> int:
    """Largest id valid for every table the model gathers from (generated
    inputs must be valid ids for the original composite, which rejects others)."""
    rows = [s.table_shape[0] for s in sites if s.table_shape and s.table_shape[0]]
    return max(1, min(rows)) if rows else 1


def _load_op_library():
    try:
        from pkm_serve import ops
        return ops.load_library()
    except ImportError as e:
        raise ExportError(f"the pkm_serve op library is needed to fuse and verify: {e}") \
            from None


def verify(src: str, fused_dir: str, signatures: Sequence[str], index_limit: int,
           samples: Optional[Dict[str, np.ndarray]], batch_size: int, quiet: bool,
           rtol: Optional[float] = None) -> List[dict]:
    """Runs every signature of the original and the fused model on the same
    inputs; raises VerificationError past tolerance."""
    import tensorflow as tf
    from pkm_serve.export import verify as V

    original = tf.saved_model.load(src)
    try:
        fused = tf.saved_model.load(fused_dir)
    except Exception as e:  # noqa: BLE001 - any load failure means a bad rewrite
        raise V.VerificationError(f"the fused SavedModel does not load: {e}") from None
    rows = []
    for name in _progress(signatures, "verifying signatures", quiet):
        fn_orig, fn_fused = original.signatures[name], fused.signatures[name]
        specs = V.signature_input_specs(fn_orig)
        if samples is not None:
            inputs = V.sample_inputs_for(name, specs, samples)
        else:
            inputs = V.generate_inputs(specs, index_limit, batch_size)
        try:
            want = {k: v.numpy() for k, v in fn_orig(**inputs).items()}
        except tf.errors.OpError as e:
            raise V.VerificationError(
                f"the original model fails on the {'sample' if samples else 'generated'} "
                f"inputs of signature {name!r}: {e.message}") from None
        try:
            got = {k: v.numpy() for k, v in fn_fused(**inputs).items()}
        except tf.errors.OpError as e:
            raise V.VerificationError(f"the fused signature {name!r} fails where the "
                                      f"original runs: {e.message}") from None
        rows.extend(V.compare_outputs(name, want, got, rtol))
    return rows


def export_saved_model(src: str, dst: str, version: Optional[int] = None,
                       signatures: Optional[Sequence[str]] = None,
                       tflite: Optional[str] = None, quantize_table: Optional[str] = None,
                       sample_inputs: Optional[str] = None, batch_size: int = 4096,
                       verify_batch_size: int = 8, rtol: Optional[float] = None,
                       quiet: bool = False, report: Optional[str] = None) -> ExportResult:
    """Fuses SRC into DST/<version>/ (and optionally a .tflite). See module doc."""
    from pkm_serve.export import verify as V

    src = os.path.abspath(src)
    dst = os.path.abspath(dst)
    if dst == src or dst.startswith(src + os.sep):
        raise ExportError(f"DST {dst} must not be SRC or inside it")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ExportError(f"DST {dst} exists and is not a directory")
    if batch_size < 1:
        raise ExportError(f"--batch-size must be >= 1, got {batch_size}")
    if quantize_table not in (None, "int8"):
        raise ExportError(f"--quantize-table supports only 'int8', got {quantize_table!r}")
    if quantize_table and not tflite:
        raise ExportError("--quantize-table applies to the .tflite: pass --tflite FILE too")
    _log(f"loading {src}", quiet)
    proto = read_saved_model(src)
    available = _serving_signatures(proto)
    # Accept "--signatures a b" and "--signatures a,b".
    chosen = [n for s in (signatures or []) for n in s.split(",") if n] or available
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise ExportError(f"unknown signature(s) {unknown}; {src} has {available}")
    samples = None
    if sample_inputs is not None:
        try:
            with np.load(sample_inputs, allow_pickle=False) as npz:
                samples = {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as e:
            raise ExportError(f"--sample-inputs {sample_inputs} is not a readable .npz: "
                              f"{e}") from None
    if version is None:
        version = _next_version(dst)
    if version < 0:
        raise ExportError(f"--version must be >= 0, got {version}")
    final_dir = os.path.join(dst, str(version))
    if os.path.exists(final_dir):
        raise ExportError(f"{final_dir} already exists: pick another --version "
                          "(versions are never overwritten: a server may be serving it)")

    _load_op_library()
    _log("rewriting functions", quiet)
    sites = fuse_saved_model_proto(proto, batch_size, quiet=quiet)
    result = ExportResult(src=src, dst=final_dir, version=version, sites=sites,
                          batch_size=batch_size)
    if not result.fused:
        result.message = ("no composite gather-sum site could be fused: the model is "
                          "exported unchanged" if sites else
                          "no composite gather-sum sites found: the model is exported "
                          "unchanged")
    created_dst = not os.path.exists(dst)
    os.makedirs(dst, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{version}.tmp-", dir=dst)
    tmp_tflite = None
    try:
        _log(f"copying variables and assets ({_tree_bytes(src) / 2**20:.1f} MiB)", quiet)
        _copy_tree(src, tmp_dir)
        with open(os.path.join(tmp_dir, SAVED_MODEL_PB), "wb") as f:
            f.write(proto.SerializeToString(deterministic=True))
        _write_fingerprint(tmp_dir)
        if result.fused or samples is not None:
            _log(f"verifying {len(chosen)} signature(s) against the original", quiet)
            try:
                result.verification = verify(
                    src, tmp_dir, chosen, _index_limit(sites, proto), samples,
                    verify_batch_size, quiet, rtol)
            except V.VerificationError as e:
                raise ExportError(f"verification failed: {e}") from None
        if tflite:
            from pkm_serve.export import tflite_export
            _log(f"converting to TFLite: {tflite}", quiet)
            tmp_tflite, result.tflite = tflite_export.convert_and_verify(
                tmp_dir, chosen, os.path.abspath(tflite), quantize_table, src,
                _index_limit(sites, proto), samples, verify_batch_size, quiet)
        # mkdtemp makes the directory owner-only; a model server may run as
        # another user.
        os.chmod(tmp_dir, 0o777 & ~_umask())
        os.rename(tmp_dir, final_dir)
        if tmp_tflite:
            os.replace(tmp_tflite, os.path.abspath(tflite))
            tmp_tflite = None
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if tmp_tflite and os.path.exists(tmp_tflite):
            os.remove(tmp_tflite)
        if created_dst and os.path.isdir(dst) and not os.listdir(dst):
            os.rmdir(dst)
        raise
    if report:
        with open(report, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return result


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def format_report(result: ExportResult) -> str:
    lines = [f"exported {result.src}\n      -> {result.dst}"]
    if result.message:
        lines.append(result.message)
    lines.append(f"sites: {len(result.sites)} found, {len(result.fused)} fused, "
                 f"{len(result.skipped)} skipped")
    for s in result.sites:
        where = f"{s.function}/{s.root}"
        if s.status == "fused":
            saved = (f"{s.saved_bytes_at_batch / 2**20:.1f} MiB at batch "
                     f"{result.batch_size}" if s.saved_bytes_at_batch else
                     f"{s.bytes_per_index} B per looked-up id" if s.bytes_per_index
                     else "unknown")
            lines.append(f"  fused    {s.pattern:<24} {s.combiner:<5} "
                         f"{'weighted' if s.weighted else 'unweighted':<10} table "
                         f"{s.table} {s.table_shape} {s.dtype}; no longer materialised: "
                         f"{saved}  [{where}]")
        else:
            lines.append(f"  skipped  {s.pattern:<24} {s.reason}  [{where}]")
    total = result.to_json()["saved_bytes_at_batch"]
    if any(s.saved_bytes_at_batch for s in result.fused):
        sparse = [s for s in result.fused if s.saved_bytes_at_batch is None]
        lines.append(f"intermediate bytes no longer materialised per call at batch "
                     f"{result.batch_size}: {total / 2**20:.1f} MiB"
                     + (f" (+ {len(sparse)} site(s) counted per looked-up id)"
                        if sparse else ""))
    for row in result.verification:
        lines.append(f"  verified {row['signature']}:{row['output']} max |err| "
                     f"{row['max_abs_err']:.3g}")
    if result.tflite:
        t = result.tflite
        lines.append(f"tflite {t['file']}: {t['bytes']} bytes, custom ops "
                     f"{t['custom_ops']}, signatures {t['signatures']}, tables "
                     f"{t['quantize_table'] or 'float'}; {t['status']}")
        for row in t["verification"]:
            lines.append(f"  verified tflite {row['signature']}:{row['output']} max |err| "
                         f"{row['max_abs_err']:.3g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = export_saved_model(
            args.src, args.dst, version=args.version, signatures=args.signatures,
            tflite=args.tflite, quantize_table=args.quantize_table,
            sample_inputs=args.sample_inputs, batch_size=args.batch_size,
            rtol=args.rtol, quiet=args.quiet, report=args.report)
    except ExportError as e:
        print(f"pkm-serve export: error: {e}", file=sys.stderr)
        return 1
    print(format_report(result))
    return 0
