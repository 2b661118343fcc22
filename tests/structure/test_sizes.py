"""No shipped source file over 500 lines and no shipped function over 80 lines
(tests, benchmarks, C++ test programs and the reference implementation aside).
Python functions are measured with `ast`; C++/CUDA function bodies by their
braces: a `{` that follows a parameter list's `)` at namespace or class level
opens a function, and its matching `}` closes it (comments and string literals
are blanked first)."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = ("pkm_serve", "kernels", "tflite_delegate", "serving")
NOT_SHIPPED = re.compile(r"(_test\.cc$|/tests?/|/reference\.cc$|/lib/|__pycache__)")
C_SOURCES = (".cc", ".cu", ".h", ".cuh")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80

_FUNCTION_HEAD = re.compile(r"\)\s*(?:const|noexcept|override|final|mutable|\s)*(?:->\s*[\w:<>,\s*&]+)?$")
_CONTROL_HEAD = re.compile(r"\b(?:if|for|while|switch|catch)\s*\([^;{}]*\)\s*$")


def shipped_sources():
    for top in SHIPPED:
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if name.endswith((".py",) + C_SOURCES) and not NOT_SHIPPED.search("/" + rel):
                    yield rel


def blank_comments_and_strings(text):
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    text = re.sub(r"/\*.*?\*/", keep_lines, text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def c_function_lengths(text):
    """[(lines, first line)] of the outermost function bodies in C++/CUDA text."""
    code, found, open_braces, line = blank_comments_and_strings(text), [], [], 1
    for i, ch in enumerate(code):
        if ch == "\n":
            line += 1
        elif ch == "{":
            head = code[max(0, i - 400):i].rstrip()
            opens_function = bool(_FUNCTION_HEAD.search(head)) and not _CONTROL_HEAD.search(head)
            open_braces.append((opens_function, line))
        elif ch == "}" and open_braces:
            is_function, first = open_braces.pop()
            if is_function and not any(f for f, _ in open_braces):
                found.append((line - first + 1, first))
    return found


def python_function_lengths(text, path):
    return [(n.end_lineno - n.lineno + 1, n.lineno) for n in ast.walk(ast.parse(text, path))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_brace_walk_measures_functions():
    text = "namespace a {\nint f(int x) {\n  if (x) {\n    return 1;\n  }\n  return 0;\n}\n}  // a\n" \
           "struct S {\n  void g() const { h(\"}\"); }\n};\n"
    assert sorted(c_function_lengths(text)) == [(1, 10), (6, 2)]


@pytest.mark.parametrize("rel", sorted(shipped_sources()))
def test_shipped_source_sizes(rel):
    text = open(os.path.join(ROOT, rel), errors="replace").read()
    assert text.count("\n") <= MAX_FILE_LINES, f"{rel}: {text.count(chr(10))} lines"
    lengths = python_function_lengths(text, rel) if rel.endswith(".py") else c_function_lengths(text)
    long_ones = [f"{rel}:{first} ({n} lines)" for n, first in lengths if n > MAX_FUNCTION_LINES]
    assert not long_ones, "functions over 80 lines: " + ", ".join(long_ones)
