"""`pkm-serve` command line: one sub-command per part of the project.

Sub-commands are imported lazily so that `pkm-serve --help` is instant and a
missing optional dependency only affects the command that needs it.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module whose main(argv) runs it, one-line help)
COMMANDS = {
    "demo": ("pkm_serve.demo", "run the whole path end to end: export, serve, TFLite, compare"),
    "export": ("pkm_serve.export", "fuse composite gather-sum sites of a SavedModel into the op"),
    "serve": ("pkm_serve.serving", "serve SavedModels over TF Serving's gRPC and REST APIs"),
    "tflite": ("pkm_serve.tflite", "run a .tflite with the pkm_serve delegate; show which ops it claimed"),
}


def _usage() -> str:
    lines = ["usage: pkm-serve <command> [args...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`pkm-serve <command> --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pkm-serve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
