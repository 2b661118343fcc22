"""No import circle anywhere in pkm_serve: every import statement of every
module, at module level or inside a function (a function-level import only
hides a circle), makes an edge; the graph must have no cycle. (A module's
implicit import of its own package's __init__ is not an edge: it is how
Python imports any submodule.)"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "pkm_serve"


def modules():
    """{dotted module name: path} for every .py file of the package."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and d != "lib"]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].split(os.sep)
                found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(dirpath, name)
    return found


def imports_of(module, path, known):
    """Package modules that `module` imports, resolved the way Python does."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from a import b`: the submodule a.b when there is one, else a itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` imports a.b.c (its nearest module)
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.add(target)
    return edges


def cycles(graph):
    """Every elementary cycle found by depth-first search, as frozensets of modules."""
    found, state = set(), {}

    def visit(node, stack):
        state[node] = "active"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "active":
                found.add(frozenset(stack[stack.index(nxt):]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_walker_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p import b\n")
    (pkg / "b.py").write_text("def f():\n    from p.a import x\n")
    known = {"p": str(pkg / "__init__.py"), "p.a": str(pkg / "a.py"), "p.b": str(pkg / "b.py")}
    graph = {m: imports_of(m, path, known) for m, path in known.items()}
    assert cycles(graph) == {frozenset({"p.a", "p.b"})}


def test_no_import_cycle_in_pkm_serve():
    known = modules()
    assert "pkm_serve.ops" in known and "pkm_serve._xla" in known
    graph = {m: imports_of(m, path, known) for m, path in known.items()}
    found = sorted(sorted(c) for c in cycles(graph))
    assert not found, f"import cycles: {found}"
