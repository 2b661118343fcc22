"""`pkm-serve tflite MODEL` (also `python -m pkm_serve.tflite` and the device wheel's
`pkm-serve-tflite`): load a .tflite in a TFLite interpreter with the pkm_serve delegate, prepare
it as a server's load does, and print the execution plan. Needs no TensorFlow."""

from __future__ import annotations

import os
import sys

from pkm_serve.tflite import (INTERPRETERS, MAX_DELEGATE_THREADS, SIGNATURE_DEFS_METADATA,
                              allocate_primary_subgraph, allocate_signature_subgraphs,
                              delegate_path, execution_plan, make_interpreter, runtime_messages,
                              signature_defs_metadata_size)


def build_parser():
    import argparse
    parser = argparse.ArgumentParser(
        prog="pkm-serve tflite",
        description="Load a .tflite model in a TFLite interpreter with the pkm_serve delegate "
                    "and print the execution plan: which nodes the delegate claimed and which "
                    "run in the interpreter. Needs no TensorFlow (LiteRT or tflite_runtime do).")
    parser.add_argument("model", metavar="MODEL", help="path of the .tflite file")
    parser.add_argument("--interpreter", default="auto", choices=("auto",) + INTERPRETERS,
                        help="TFLite runtime to use (default: the first installed of "
                             f"{', '.join(INTERPRETERS)})")
    parser.add_argument("--num-threads", type=int, default=1, metavar="N",
                        help="threads of the interpreter and of the delegate's kernel (default 1)")
    parser.add_argument("--fuse-composites", action="store_true",
                        help="let the delegate also claim stock GATHER -> MUL -> SUM chains "
                             "(models converted without the custom op)")
    return parser


def main(argv=None) -> int:
    """`pkm-serve tflite MODEL [--fuse-composites]` (also `python -m
    pkm_serve.tflite`): print the delegate path and the execution plan."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isfile(args.model):
        what = "is a directory, not a .tflite file" if os.path.isdir(args.model) else "no such file"
        print(f"{parser.prog}: error: {args.model}: {what}", file=sys.stderr)
        return 1
    if not 1 <= args.num_threads <= MAX_DELEGATE_THREADS:
        parser.error(f"--num-threads must be in [1, {MAX_DELEGATE_THREADS}], got {args.num_threads}")
    # A server serves a model's signature_defs_metadata alone, on the primary subgraph, and
    # prepares that one only: a node without a kernel in another signature does not fail it.
    # (An empty one is none, as upstream: the server then serves the signature runners.)
    unserved = [] if _file_signature_defs(args.model) else None
    try:
        interp = make_interpreter(args.model, args.interpreter, args.num_threads,
                                  args.fuse_composites)
        # Prepares every node: one without a kernel (a custom op neither the runtime nor the
        # delegate has) was listed as "runs", and the model then failed wherever it was loaded.
        allocate_primary_subgraph(interp)
        allocate_signature_subgraphs(interp, missing_kernels=unserved)
    except RuntimeError as e:   # a refusal: its first message is the CLI's one line
        raise RuntimeError("\n".join(runtime_messages(str(e))) or str(e)) from None
    for text in unserved or ():
        print(f"{parser.prog}: note: {(runtime_messages(text) or [text])[0]} (a server loads the model: "
              f"it serves its {SIGNATURE_DEFS_METADATA}, on the primary subgraph)", file=sys.stderr)
    print("delegate:", delegate_path())
    for op in execution_plan(interp):
        where = (f"claimed by node {op['replaced_by']}" if op["replaced_by"] is not None
                 else "runs")
        print(f"  {op['index']:3d} {op['op_name']:<24} inputs={op['inputs']} "
              f"outputs={op['outputs']}  {where}")
    return 0


def _file_signature_defs(path) -> int:
    """signature_defs_metadata_size of a model file (0 without the entry), mapped rather than
    read (a table may be gigabytes)."""
    import mmap
    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):   # (an empty file cannot be mapped: make_interpreter says so)
        return 0
    with data:   # an unreadable entry: a ValueError, the CLI's one line, as the server's load refuses it
        return signature_defs_metadata_size(data) or 0


def console_main(argv=None) -> int:
    """The device wheel's `pkm-serve-tflite` (no `pkm-serve` CLI, which does the same
    with --verbose): a model the runtime refuses is one line, not a traceback."""
    try:
        return main(argv)
    except (ValueError, RuntimeError, ImportError) as e:  # not a model, one the runtime refuses, no runtime
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{build_parser().prog}: error: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(console_main())
