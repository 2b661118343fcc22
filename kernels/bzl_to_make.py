"""Writes the lists of kernels/sources.bzl as make variables, for the Makefile.

    python3 kernels/bzl_to_make.py kernels/sources.bzl > build/sources.mk

Starlark list literals are Python list literals, so the standard library's
`ast` reads them; anything but `NAME = ["...", ...]` is refused with its line,
so the Bazel builds and the Makefile cannot silently read different lists.
"""
import ast
import sys


def read_lists(path):
    """{name: [str, ...]} of every top-level assignment in the .bzl file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        ok = (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.List)
              and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.value.elts))
        if not ok:
            raise SystemExit(f"{path}:{node.lineno}: only NAME = [\"string\", ...] is allowed here "
                             "(the Makefile reads this file too)")
        name = node.targets[0].id
        values = [e.value for e in node.value.elts]
        bad = [v for v in values if not v or any(c.isspace() or c in "$#\\" for c in v)]
        if bad:
            raise SystemExit(f"{path}:{node.lineno}: {name}: entry {bad[0]!r} has a space or a make "
                             "special character")
        if name in lists:
            raise SystemExit(f"{path}:{node.lineno}: {name} is assigned twice")
        lists[name] = values
    return lists


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: bzl_to_make.py SOURCES.bzl")
    print(f"# Generated from {argv[1]} by kernels/bzl_to_make.py; edit that file instead.")
    for name, values in read_lists(argv[1]).items():
        print(f"{name} := {' '.join(values)}")


if __name__ == "__main__":
    main(sys.argv)
