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

from pkm_serve.export import files, keras_saved_model, tflite_export, warmup
from pkm_serve.export import quantize as Q
from pkm_serve.export import inputs as SI
from pkm_serve.export.saved_model_io import read_saved_model
from pkm_serve.export.saved_model_io import record_new_ops as _record_new_ops
from pkm_serve.export.saved_model_io import write_fingerprint as _write_fingerprint
from pkm_serve.export import verify as V
from pkm_serve.export.verify import error_line as _error_line
from pkm_serve.export.arguments import build_parser
from pkm_serve.export.errors import ExportError
from pkm_serve.export.files import FINGERPRINT_PB, SAVED_MODEL_PB
from pkm_serve.export.patterns import Site, rewrite_function
from pkm_serve.export.progress import Progress

__all__ = ["ExportError", "ExportResult", "build_parser", "export_saved_model",
           "format_report", "main", "read_saved_model", "verify_signatures"]

# Version of the --report JSON layout (bumped when a key changes).
REPORT_SCHEMA_VERSION = 3


@dataclasses.dataclass
class ExportResult:
    src: str
    dst: str                      # DST/<version>
    version: int
    sites: List[Site]
    batch_size: int
    verification: List[dict] = dataclasses.field(default_factory=list)
    tflite: Optional[dict] = None
    quantization: Optional[dict] = None   # --quantize-table int8 (export/quantize.py)
    warmup_requests: int = 0              # --warmup-requests: records written (export/warmup.py)
    warmup_skipped: Dict[str, list] = dataclasses.field(default_factory=dict)  # signature: state writers
    warmup_not_in_tflite: List[str] = dataclasses.field(default_factory=list)  # (another key of its function)
    message: str = ""
    feeds: Dict[str, dict] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def fused(self) -> List[Site]:
        return [s for s in self.sites if s.status == "fused"]

    @property
    def skipped(self) -> List[Site]:
        return [s for s in self.sites if s.status != "fused"]

    def to_json(self) -> dict:
        saved = [s.saved_bytes_at_batch for s in self.fused if s.saved_bytes_at_batch]
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "src": self.src, "dst": self.dst, "version": self.version,
            "batch_size": self.batch_size, "message": self.message,
            "sites_found": len(self.sites), "sites_fused": len(self.fused),
            "sites_skipped": len(self.skipped),
            "saved_bytes_at_batch": int(sum(saved)),
            "sites": [s.to_json() for s in self.sites],
            "verification": self.verification, "tflite": self.tflite,
            "quantization": self.quantization,
        }




def fuse_saved_model_proto(proto, batch_size: int, fuse: bool = True,
                           progress: Optional[Progress] = None) -> List[Site]:
    """Rewrites every function of every MetaGraph in place; returns the sites.
    The MetaGraph's op list is only touched where a site was fused, so a
    model without one keeps its exact graph (and its convertibility)."""
    progress = progress or Progress(quiet=True)
    sites: List[Site] = []
    total = sum(len(mg.graph_def.library.function) for mg in proto.meta_graphs)
    with progress.phase("rewriting functions", total=total, unit="functions") as phase:
        for meta_graph in proto.meta_graphs:
            library = meta_graph.graph_def.library
            sigs = {f.signature.name: f.signature for f in library.function}
            fused_here = False
            for fdef in library.function:
                found = rewrite_function(fdef, sigs, batch_size, fuse_sites=fuse)
                fused_here |= any(s.status == "fused" for s in found)
                sites.extend(found)
                phase.advance()
            if fuse and fused_here:
                _record_new_ops(meta_graph)
    return sites




def _serving_signatures(proto) -> List[str]:
    return sorted(k for k in proto.meta_graphs[0].signature_def
                  if not k.startswith("__"))




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


def verify_signatures(src: str, fused_dir: str, signatures: Sequence[str],
                      index_limit: int, samples: Optional[Dict[str, np.ndarray]],
                      batch_size: int, progress: Progress, rtol: Optional[float] = None,
                      precision: Optional[str] = None,
                      feeds: Optional[dict] = None) -> List[dict]:
    """Runs every signature of the original and the fused model on the same
    inputs; raises VerificationError past tolerance. `precision` (a dtype
    name) widens the tolerance where a fused site computes in half precision."""
    import tensorflow as tf

    rows = []
    with progress.phase("verifying signatures", total=len(signatures),
                        unit="signatures") as phase:
        original = tf.saved_model.load(src)
        try:
            fused = tf.saved_model.load(fused_dir)
        except Exception as e:  # noqa: BLE001 - any load failure means a bad rewrite
            raise V.VerificationError(f"the fused SavedModel does not load: {e}") from None
        for name in signatures:
            rows.extend(_verify_one(original, fused, name, index_limit, samples,
                                    batch_size, rtol, precision, (feeds or {}).get(name)))
            phase.advance()
    return rows


def _verify_one(original, fused, name: str, index_limit: int, samples, batch_size: int,
                rtol: Optional[float], precision: Optional[str], feeds=None) -> List[dict]:
    """Runs one signature of both models on the same inputs and compares."""
    import tensorflow as tf

    fn_orig, fn_fused = original.signatures[name], fused.signatures[name]
    specs = V.signature_input_specs(fn_orig)
    if samples is not None:
        inputs = V.sample_inputs_for(name, specs, samples)
    else:
        inputs = V.generate_inputs(specs, index_limit, batch_size, feeds=feeds)
    try:
        want = {k: v.numpy() for k, v in fn_orig(**inputs).items()}
    except tf.errors.OpError as e:
        raise V.inputs_refused(name, samples, e) from None
    try:
        got = {k: v.numpy() for k, v in fn_fused(**inputs).items()}
    except tf.errors.OpError as e:
        raise V.VerificationError(f"the fused signature {name!r} fails where the original runs: "
                                  f"{_error_line(e.message)}{V.wrapped_count_note(e.message, want)}") from None
    return V.compare_outputs(name, want, got, rtol, precision=precision)


def _check_arguments(src: str, dst: str, batch_size: int, quantize_table: Optional[str],
                     tflite: Optional[str], report: Optional[str] = None) -> None:
    if dst == src or dst.startswith(src + os.sep):
        raise ExportError(f"DST {dst} must not be SRC or inside it")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ExportError(f"DST {dst} exists and is not a directory")
    if os.path.exists(os.path.join(dst, SAVED_MODEL_PB)):
        # DST/<version>/ would be a SavedModel nested in this one (no server sees it), and
        # inside a served version directory.
        raise ExportError(f"DST {dst} is a SavedModel (a version directory?): DST is the model base "
                          f"directory, the export goes to DST/<version>/; pass {os.path.dirname(dst)}")
    if batch_size < 1:
        raise ExportError(f"--batch-size must be >= 1, got {batch_size}")
    if quantize_table not in (None, "int8"):
        raise ExportError(f"--quantize-table supports only 'int8', got {quantize_table!r}")
    _check_output_file("--tflite", tflite)
    _check_output_file("--report", report)


def _check_output_file(option: str, path: Optional[str]) -> None:
    """An output file that cannot be written is refused before the export: --report was
    written after DST/<version> (an OSError naming no option, exit 1, the version in place),
    --tflite after the whole conversion."""
    if not path:
        return
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ExportError(f"{option} {path} is a directory: name the file to write")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):   # --tflite's missing directories are created
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or (option == "--report" and parent != os.path.dirname(path)):
        raise ExportError(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"{option} {path}: cannot write into {parent}")


def _choose_signatures(proto, src: str, signatures: Optional[Sequence[str]]) -> List[str]:
    available = _serving_signatures(proto)
    # Accept "--signatures a b" and "--signatures a,b".
    chosen = [n for s in (signatures or []) for n in s.split(",") if n] or available
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise ExportError(f"unknown signature(s) {unknown}; {src} has {available}")
    return chosen


def _final_dir(dst: str, version: Optional[int]) -> tuple:
    if version is None:
        version = files.next_version(dst)
    if version < 0:
        raise ExportError(f"--version must be >= 0, got {version}")
    final_dir = os.path.join(dst, str(version))
    if os.path.exists(final_dir):
        raise ExportError(f"{final_dir} already exists: pick another --version "
                          "(versions are never overwritten: a server may be serving it)")
    return version, final_dir


def _lowest_fused_precision(sites: Sequence[Site]) -> Optional[str]:
    """float16/bfloat16 if a fused site computes in it (its outputs then carry
    half-precision rounding even where the signature returns float32)."""
    halves = {s.dtype for s in sites if s.status == "fused"} | {  # rounded_to: a skipped half rounding
        t for s in sites if s.status == "fused" for t in (s.cast_to, s.rounded_to) if t}
    for name in ("bfloat16", "float16"):
        if name in halves:
            return name
    return None


def _uses_project_ops(proto) -> bool:
    """Whether the SavedModel's graphs already hold one of the project's bag ops."""
    graph = proto.meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return any(n.op.startswith("Pkm") for n in nodes)


def _no_site_message(sites: Sequence[Site]) -> str:
    if sites:
        return "no composite gather-sum site could be fused: the model is exported unchanged"
    return "no composite gather-sum sites found: the model is exported unchanged"


def _check_tflite_version(tflite: Optional[str], dst: str, version: int) -> None:
    """A .tflite in another version of DST: a bare model.tflite no server can load."""
    if not tflite:
        return
    inside = os.path.relpath(os.path.abspath(tflite), os.path.abspath(dst)).split(os.sep)
    if len(inside) > 1 and inside[0].isdigit() and int(inside[0]) != version:
        raise ExportError(f"--tflite {tflite} is inside version {int(inside[0])} of DST, but this export "
                          f"writes version {version}: pass --version {int(inside[0])} or --tflite "
                          f"{os.path.join(dst, str(version), *inside[1:])}")


def export_saved_model(src: str, dst: str, version: Optional[int] = None,
                       signatures: Optional[Sequence[str]] = None,
                       tflite: Optional[str] = None, quantize_table: Optional[str] = None,
                       sample_inputs: Optional[str] = None, batch_size: int = 4096,
                       verify_batch_size: int = 8, rtol: Optional[float] = None,
                       quiet: bool = False, report: Optional[str] = None,
                       progress: Optional[Progress] = None,
                       quantize_tolerance: Optional[float] = None,
                       warmup_requests: Optional[int] = None) -> ExportResult:
    """Fuses SRC into DST/<version>/ (and optionally a .tflite). See module doc."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    _check_arguments(src, dst, batch_size, quantize_table, tflite, report)
    warmup.check_request_count(src, warmup_requests)
    if rtol is not None and not 0 <= rtol < float("inf"):   # inf (or NaN) would pass any output
        raise ExportError(f"--rtol must be a finite number >= 0, got {rtol}")
    progress = progress or Progress(quiet=quiet)
    progress.note(f"loading {src}")
    proto = read_saved_model(src)
    chosen = _choose_signatures(proto, src, signatures)
    samples = SI.read_samples(sample_inputs)
    SI.check_sample_keys(proto, chosen, samples)
    feeds = SI.signature_feeds(proto, chosen, samples, os.path.join(src, "assets"))
    version, final_dir = _final_dir(dst, version)
    _check_tflite_version(tflite, dst, version)

    _load_op_library()
    sites = fuse_saved_model_proto(proto, batch_size, progress=progress)
    result = ExportResult(src=src, dst=final_dir, version=version, sites=sites,
                          batch_size=batch_size)
    result.feeds = feeds
    if not result.fused:
        result.message = _no_site_message(sites)
    if quantize_table and not result.fused:
        Q.check_not_quantized_yet(proto, quantize_table)  # the int8 export of before, say so
        hint = ""
        if _uses_project_ops(proto):
            hint = ("; its bags already run the pkm_serve op (its layers), whose tables this does not quantize: "
                    "convert the model to .tflite and quantize that (pkm_serve.tflite.quantize_table_int8)")
        raise ExportError(f"--quantize-table {quantize_table}: {result.message}, so no table to quantize{hint}")
    _write_version(result, proto, chosen, samples, tflite, quantize_table,
                   verify_batch_size, rtol, progress, quantize_tolerance, warmup_requests)
    if report:
        try:
            with open(report, "w") as f:
                json.dump(result.to_json(), f, indent=2)
        except OSError as e:
            raise ExportError(f"{result.dst} was written, but not --report {report}: "
                              f"{e.strerror or e}") from None
    return result


def _write_version(result: ExportResult, proto, chosen: List[str], samples, tflite,
                   quantize_table, verify_batch_size: int, rtol, progress: Progress,
                   quantize_tolerance: Optional[float] = None, warmup_requests: Optional[int] = None) -> None:
    """Writes DST/<version> (and the .tflite) through temporaries renamed into
    place only once everything has been verified; on any error nothing is
    left behind."""
    src, dst, final_dir = result.src, os.path.dirname(result.dst), result.dst
    created_dst = not os.path.exists(dst)
    os.makedirs(dst, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{result.version}.tmp-", dir=dst)
    tmp_tflite = None
    index_limit = _index_limit(result.sites, proto)
    try:
        with progress.phase("copying variables and assets", total=files.tree_bytes(src),
                            unit="B") as phase:
            files.copy_tree(src, tmp_dir, on_bytes=phase.advance)
        if result.fused:
            with open(os.path.join(tmp_dir, SAVED_MODEL_PB), "wb") as f:
                f.write(proto.SerializeToString(deterministic=True))
            _write_fingerprint(tmp_dir)
        else:
            # Nothing fused: the source's own bytes, so the copy converts and
            # loads exactly as the source does.
            for name in (SAVED_MODEL_PB, FINGERPRINT_PB):
                if os.path.exists(os.path.join(src, name)):
                    shutil.copy2(os.path.join(src, name), os.path.join(tmp_dir, name))
        if result.fused or samples is not None:
            try:
                result.verification = verify_signatures(
                    src, tmp_dir, chosen, index_limit, samples, verify_batch_size, progress,
                    rtol, precision=_lowest_fused_precision(result.sites),
                    feeds=result.feeds)
            except V.VerificationError as e:
                raise ExportError(f"verification failed: {e}") from None
        if tflite:
            # A .tflite inside DST/<version> (where --prefer_tflite_model serves it from) is
            # written into the temporary version directory, so it arrives with the rename.
            inside = os.path.relpath(os.path.abspath(tflite), os.path.abspath(final_dir))
            tflite_target = (os.path.join(tmp_dir, inside) if not inside.startswith(os.pardir)
                             else os.path.abspath(tflite))
            os.makedirs(os.path.dirname(tflite_target), exist_ok=True)
            tmp_tflite, result.tflite = tflite_export.convert_and_verify(
                tmp_dir, chosen, tflite_target, quantize_table, src,
                index_limit, samples, verify_batch_size, progress,
                precision=_lowest_fused_precision(result.sites), feeds=result.feeds,
                not_fused=result.skipped, tolerance=quantize_tolerance)
            result.tflite["file"] = os.path.abspath(tflite)
        if quantize_table:  # after the .tflite, which converts the float graph
            from pkm_serve.export import quantize
            with progress.phase("quantizing tables to int8", total=1, unit="models") as phase:
                result.quantization = quantize.quantize_version(
                    tmp_dir, src, chosen, index_limit, samples, verify_batch_size,
                    quantize_tolerance, feeds=result.feeds)
                phase.advance()
        if warmup_requests:  # last: the requests run on the model as it is written
            # (One file serves both SavedModel and .tflite: keys the .tflite lacks fail its load.)
            warm = [n for n in chosen if n in result.tflite["signatures"]] if tflite else chosen
            result.warmup_not_in_tflite = [n for n in chosen if n not in warm]
            with progress.phase("writing warmup requests"):
                result.warmup_requests, result.warmup_skipped = warmup.write_warmup_requests(
                    tmp_dir, warm, warmup_requests, index_limit, samples, verify_batch_size,
                    result.feeds, os.path.basename(dst))
        # mkdtemp makes the directory owner-only; a model server may run as
        # another user.
        os.chmod(tmp_dir, 0o777 & ~files.current_umask())
        if tmp_tflite:
            os.replace(tmp_tflite, tflite_target)
            tmp_tflite = None
        os.rename(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if tmp_tflite and os.path.exists(tmp_tflite):
            os.remove(tmp_tflite)
        if created_dst and os.path.isdir(dst) and not os.listdir(dst):
            os.rmdir(dst)
        raise


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
            lines.append(f"  fused    {s.pattern:<24} {s.computes:<13} "
                         f"{'weighted' if s.weighted else 'unweighted':<10}"
                         f"{s.report_steps()} table {s.table} {s.table_shape} {s.dtype}; "
                         f"no longer materialised: {saved}  [{where}]")
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
                     f"{tflite_export.tables_note(t)}; {t['status']}")
        for row in t["verification"]:
            lines.append(f"  verified tflite {row['signature']}:{row['output']} max |err| "
                         f"{row['max_abs_err']:.3g}")
    if result.quantization:
        from pkm_serve.export.quantize import format_quantization
        lines.extend(format_quantization(result.quantization))
    if result.warmup_requests:
        lines.append(f"warmup: {result.warmup_requests} PredictionLog records in "
                     f"{os.path.join(result.dst, warmup.WARMUP_FILE)}")
    for name, writers in result.warmup_skipped.items():
        lines.append(f"warmup: no requests for signature {name!r}: it writes state ({', '.join(writers)}), "
                     "which a replay at every load would change")
    lines.extend(f"warmup: no requests for signature {name!r}: the .tflite does not hold it (the "
                 "converter wrote its function under another key)" for name in result.warmup_not_in_tflite)
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = export_saved_model(
            args.src, args.dst, version=args.version, signatures=args.signatures,
            tflite=args.tflite, quantize_table=args.quantize_table,
            sample_inputs=args.sample_inputs, batch_size=args.batch_size,
            rtol=args.rtol, quiet=args.quiet, report=args.report,
            quantize_tolerance=args.quantize_tolerance, warmup_requests=args.warmup_requests)
    except ExportError as e:
        from pkm_serve import cli

        if cli.verbose():
            raise
        print(f"pkm-serve export: error: {e}", file=sys.stderr)
        return 1
    print(format_report(result))
    return 0


def quantize_tables(model, dst: str, version: Optional[int] = None, tolerance: Optional[float] = None,
                    **export_kwargs):
    """A trained Keras model -> DST/<version>/, fused and with int8 tables.

    Exports the model as a SavedModel (`model.export`), then runs
    `export_saved_model(..., quantize_table="int8")` on it; returns its
    ExportResult (result.quantization holds sizes and errors).
    """
    with tempfile.TemporaryDirectory(prefix="pkm-quantize-") as tmp:
        saved = os.path.join(tmp, "saved_model")
        keras_saved_model.write_inference_saved_model(model, saved)
        return export_saved_model(saved, dst, version=version, quantize_table="int8",
                                  quantize_tolerance=tolerance, **export_kwargs)
