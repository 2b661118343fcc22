"""The `pkm-serve export` argument parser, apart from the exporter so that
`--help` and usage errors need no TensorFlow import."""
import argparse


class _ExportParser(argparse.ArgumentParser):
    """Checks that span options, as usage errors (exit 2) before TensorFlow loads."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if parsed.quantize_tolerance is not None and parsed.quantize_table is None:
            self.error("--quantize-tolerance applies to --quantize-table int8 only: pass "
                       "--quantize-table int8 too, or drop --quantize-tolerance")
        return parsed, rest


def build_parser() -> argparse.ArgumentParser:
    p = _ExportParser(
        prog="pkm-serve export",
        description="Fuse composite gather-sum sites of a TF2 SavedModel into "
                    "PkmEmbeddingBag ops and write DST/<version>/ for serving.")
    p.add_argument("src", metavar="SRC", help="SavedModel directory")
    p.add_argument("dst", metavar="DST", help="model base directory; the result goes "
                   "to DST/<version>/")
    p.add_argument("--version", type=int, default=None,
                   help="version number (default: one above the highest in DST)")
    p.add_argument("--signatures", nargs="+", default=None, metavar="NAME",
                   help="signatures to verify and convert (default: all); every "
                        "function of the model is rewritten either way")
    p.add_argument("--tflite", metavar="FILE", help="also write a .tflite with the "
                   "PkmEmbeddingBag custom op")
    p.add_argument("--quantize-table", choices=["int8"], default=None,
                   help="store fused tables as row-wise int8, in the SavedModel and the .tflite")
    p.add_argument("--quantize-tolerance", type=float, default=None, metavar="REL",
                   help="refuse --quantize-table when an output differs from the float model by "
                        "more than REL of its scale (max |output|) (default 1e-2)")
    p.add_argument("--report", metavar="FILE", help="write the report as JSON")
    p.add_argument("--sample-inputs", metavar="FILE", help=".npz of signature inputs to verify "
                   "on instead of generated ones: key NAME feeds input NAME of every signature, "
                   "SIG/NAME input NAME of signature SIG only (needed where the signatures' "
                   "inputs differ, e.g. serving_default/ids)")
    p.add_argument("--batch-size", type=int, default=4096,
                   help="batch size for the bytes-saved figures (default 4096)")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of verification (default by dtype)")
    p.add_argument("--warmup-requests", type=int, default=None, metavar="N",
                   help="write N TF Serving warmup requests per signature (PredictionLog records "
                        "built from the verification inputs) to DST/<version>/assets.extra/"
                        "tf_serving_warmup_requests, which the server replays before serving "
                        "(default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p

