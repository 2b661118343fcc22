"""`pkm-serve` command line: one sub-command per part of the project.

Sub-commands are imported lazily so that `pkm-serve --help` is instant and a
missing optional dependency only affects the command that needs it. A command
whose runner imports TensorFlow names a TF-free parser too: `--help` and usage
errors are answered from it before TensorFlow is imported.

Errors are one line, `pkm-serve <command>: error: ...`, exit status 1;
`--verbose` (before or after the command) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

# name -> (module whose main(argv) runs it, module whose build_parser() is TF-free or None,
#          whether it imports TensorFlow, one-line help)
COMMANDS = {
    "demo": ("pkm_serve.demo", None, True,
             "run the whole path end to end: export, serve, TFLite, compare"),
    "export": ("pkm_serve.export.exporter", "pkm_serve.export.arguments", True,
               "fuse composite gather-sum sites of a SavedModel into the op"),
    "serve": ("pkm_serve.serving.server", None, True,
              "serve SavedModels over TF Serving's gRPC and REST APIs"),
    "tflite": ("pkm_serve.tflite", None, False,
               "run a .tflite with the pkm_serve delegate; show which ops it claimed"),
}

VERBOSE_FLAGS = ("-v", "--verbose")

# Python module -> the pip extra that installs it (for "not installed" errors).
_EXTRA_OF_MODULE = {
    "grpc": "serving", "grpc_health": "serving", "grpc_reflection": "serving",
    "aiohttp": "serving", "prometheus_client": "serving", "tensorflow_serving": "serving",
    "ai_edge_litert": "tflite",
}


def _usage() -> str:
    lines = ["usage: pkm-serve [--verbose] <command> [args...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, _, help_) in COMMANDS.items()]
    lines += ["", "options:",
              "  -v, --verbose  show the full traceback of an error (default: one line)",
              "", "`pkm-serve <command> --help` describes a command's arguments."]
    return "\n".join(lines)


def _missing_module_message(err: ModuleNotFoundError) -> str:
    top = (err.name or "").split(".")[0]
    if top == "tensorflow":
        return ("this command needs TensorFlow, which is not installed here (the device wheel "
                "has only the TFLite part); install the pkm_serve TF wheel")
    extra = _EXTRA_OF_MODULE.get(top)
    hint = f" (pip install 'pkm_serve[{extra}]')" if extra else ""
    return f"this command needs the Python module {top!r}, which is not installed{hint}"


def one_line(err: BaseException) -> str:
    """The first line of an error's message (TF's errors carry the graph's
    traceback after it), with the exception type where the message alone is
    unclear."""
    if isinstance(err, ModuleNotFoundError):
        return _missing_module_message(err)
    text = str(getattr(err, "message", None) or err).strip()
    first = text.splitlines()[0] if text else ""
    if not first:
        return type(err).__name__
    if isinstance(err, (KeyError, IndexError, AttributeError, TypeError, AssertionError)):
        return f"{type(err).__name__}: {first}"
    return first


def import_tensorflow_quietly():
    """Imports TensorFlow with its start-up lines (oneDNN notice, CUDA probing)
    held back: TF writes them to fd 2 before its logging is configured, so
    TF_CPP_MIN_LOG_LEVEL cannot hide them. They are replayed if the import fails."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except BaseException:
            os.dup2(saved_fd, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def run_command(name: str, argv, verbose: bool = False) -> int:
    """Runs one sub-command; an error becomes one line on stderr and status 1."""
    runner, parser_module, imports_tensorflow, _ = COMMANDS[name]
    try:
        if parser_module is not None:
            # Exits with argparse's usage error or the help text, without TensorFlow.
            importlib.import_module(parser_module).build_parser().parse_args(argv)
        if imports_tensorflow and not verbose and not any(a in ("-h", "--help") for a in argv):
            import_tensorflow_quietly()
        return int(importlib.import_module(runner).main(argv) or 0)
    except KeyboardInterrupt:
        print(f"pkm-serve {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - every error becomes one line unless --verbose
        if verbose:
            raise
        print(f"pkm-serve {name}: error: {one_line(err)} (--verbose shows the traceback)",
              file=sys.stderr)
        return 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while argv and argv[0] in VERBOSE_FLAGS:
        verbose = True
        argv.pop(0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pkm-serve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if "--verbose" in rest:  # also accepted after the command: no sub-command defines it
        verbose = True
        rest = [a for a in rest if a != "--verbose"]
    return run_command(name, rest, verbose)


if __name__ == "__main__":
    sys.exit(main())
