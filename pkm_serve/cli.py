"""`pkm-serve` command line: one sub-command per part of the project.

Sub-commands are imported lazily so that `pkm-serve --help` is instant and a
missing optional dependency only affects the command that needs it. A command
whose runner imports TensorFlow names a TF-free parser too: `--help` and usage
errors are answered from it before TensorFlow is imported.

Errors are one line, `pkm-serve <command>: error: ...`, exit status 1;
`--verbose` (before or after the command) shows the traceback instead. Before a command
hands control to TensorFlow it says so on stderr ("importing TensorFlow", "loading the op
library from ..."), so a process that aborts in native code is never silent.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import tempfile

# name -> (module whose main(argv) runs it, module whose build_parser() is TF-free or None,
#          whether it imports TensorFlow, one-line help)
COMMANDS = {
    "demo": ("pkm_serve.demo", "pkm_serve.demo", True,
             "run the whole path end to end: export, serve, TFLite, compare"),
    "export": ("pkm_serve.export.exporter", "pkm_serve.export.arguments", True,
               "fuse composite gather-sum sites of a SavedModel into the op"),
    "serve": ("pkm_serve.serving.server", "pkm_serve.serving.config", True,
              "serve SavedModels over TF Serving's gRPC and REST APIs"),
    "tflite": ("pkm_serve.tflite_cli", None, False,
               "run a .tflite with the pkm_serve delegate; show which ops it claimed"),
}

VERBOSE_FLAGS = ("-v", "--verbose")
_verbose = False


def verbose() -> bool:
    """Whether --verbose was given: runners that print their own one-line errors
    re-raise (export) or print the traceback (serve) instead."""
    return _verbose

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
              "  --version      print pkm_serve's version and exit",
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


def progress(command: str, text: str) -> None:
    """A status line on stderr, flushed: printed before each step that hands control to
    TensorFlow's native code, so that a process that aborts there still names the step."""
    print(f"pkm-serve {command}: {text}", file=sys.stderr, flush=True)


def import_tensorflow_quietly(announce=None):
    """Imports TensorFlow and lists its devices with their start-up lines (oneDNN
    notice, CUDA probing) held back: TF writes them to fd 2 before its logging is configured, so
    TF_CPP_MIN_LOG_LEVEL cannot hide them. They go to a log file, replayed and removed if the
    import raises, removed if it succeeds, and left behind if the process dies in native code
    (``announce(path)`` is called first, to name it). A fatal signal meanwhile prints the
    Python stack to the real stderr (faulthandler)."""
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved_fd = os.dup(2)
    log_fd, log_path = tempfile.mkstemp(prefix="pkm-serve-tensorflow-import-", suffix=".log")
    if announce is not None:
        announce(log_path)
    faulthandler.enable(file=saved_fd)
    os.dup2(log_fd, 2)
    try:
        import tensorflow

        # Device probing ("failed call to cuInit" on a machine without a GPU) happens at the
        # first device query, not at import: done here, its lines are held back too.
        tensorflow.config.list_physical_devices()
    except KeyboardInterrupt:   # Ctrl-C: "interrupted", without TF's start-up lines replayed
        raise
    except BaseException:
        os.dup2(saved_fd, 2)
        os.lseek(log_fd, 0, os.SEEK_SET)
        sys.stderr.write(os.read(log_fd, 1 << 20).decode(errors="replace"))
        raise
    finally:
        os.dup2(saved_fd, 2)
        faulthandler.enable(file=sys.stderr)
        os.close(saved_fd)
        os.close(log_fd)
        os.unlink(log_path)


def prepare_tensorflow(command: str, quiet: bool) -> None:
    """Imports TensorFlow, then loads the op library (pkm_serve's registration, held back
    until TF's import is done), each announced on stderr first."""
    if "tensorflow" in sys.modules:
        return
    import pkm_serve
    lib = os.environ.get("PKM_SERVE_OPS_LIB") or os.path.join(
        os.path.dirname(os.path.abspath(pkm_serve.__file__)), "lib")
    with pkm_serve._registration_deferred(
            before_registering=lambda: progress(command, f"loading the op library from {lib}")):
        if quiet:
            import_tensorflow_quietly(lambda log: progress(
                command, f"importing TensorFlow (its start-up messages go to {log}, "
                         "removed once the import succeeds)"))
        else:
            progress(command, "importing TensorFlow")
            import tensorflow  # noqa: F401


def run_command(name: str, argv, verbose: bool = False) -> int:
    """Runs one sub-command; an error becomes one line on stderr and status 1."""
    global _verbose
    _verbose = verbose
    runner, parser_module, imports_tensorflow, _ = COMMANDS[name]
    try:
        if parser_module is not None:
            # Exits with argparse's usage error or the help text, without TensorFlow.
            importlib.import_module(parser_module).build_parser().parse_args(argv)
        if imports_tensorflow and not any(a in ("-h", "--help") for a in argv):
            faulthandler.enable()  # a native crash prints the Python stack
            prepare_tensorflow(name, quiet=not verbose)
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
    if argv[0] == "--version":  # as `tensorflow_model_server --version`
        from pkm_serve import __version__

        print(f"pkm-serve {__version__}")
        return 0
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
