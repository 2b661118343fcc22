"""Where a signature input's values go: the ops a walk from its top-level placeholder reaches, through
Identity, function calls and (where asked) any op to outputs of the dtypes it follows, and which call path
reached each (feeds.py reads the model's lookup tables, parse ops and segment ops off them)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from tensorflow.core.framework import attr_value_pb2

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.lookup_keys import called_functions

PARSE_OPS = ("ParseExampleV2", "ParseExample", "ParseSingleExample")
# A walk never follows a gather's row ids nor an op that reads only its input's shape.
_GATHER_OPS = ("GatherV2", "Gather", "ResourceGather", "GatherNd", "ResourceGatherNd")
SHAPE_OPS = ("Shape", "ShapeN", "Size", "Rank")


def _output_dtypes(node, library_sigs) -> List[int]:
    """The DataType of each flat output of a node ([] for an op this process
    does not know: nothing to follow)."""
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(node.op)
    if op_def is None:
        sig = library_sigs.get(node.op)
        return [arg.type for arg in sig.output_arg] if sig is not None else []
    defaults = {a.name: a.default_value for a in op_def.attr}  # saved graphs drop default attrs

    def attr(name):
        return node.attr[name] if name in node.attr else defaults.get(name, attr_value_pb2.AttrValue())

    dtypes: List[int] = []
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            dtypes += list(attr(arg.type_list_attr).list.type)
            continue
        dtype = arg.type or attr(arg.type_attr).type
        dtypes += [dtype] * (attr(arg.number_attr).i if arg.number_attr else 1)
    return dtypes


def _flows_on(fg: FunctionGraph, node, pos: int, keep) -> List[Ref]:
    """The outputs of `node` that still carry the values fed at input `pos`:
    those of a dtype `keep` takes, unless the values are a gather's row ids or
    only lend their shape. Ids that pick embedding rows go on as float rows,
    and a top_k over their scores that reaches an inverted lookup (index ->
    title) is not the ids reaching that lookup's keys."""
    if (pos == 1 and node.op in _GATHER_OPS) or node.op in SHAPE_OPS:
        return []
    return [Ref(node.name, k) for k, dtype in enumerate(_output_dtypes(node, fg.library_sigs))
            if keep(dtype)]


class Reached(tuple):
    """(FunctionGraph, node) that a walk from a placeholder reached, with `bindings`: {arg of that function:
    the top-level nodes the call path that reached it passes there} (one call site's tables, where
    resource_sources pools every call site's)."""

    def __new__(cls, fg, node, bindings):
        reached = super().__new__(cls, (fg, node))
        reached.bindings = bindings
        return reached


def _bindings(node, callee, offset: int, library, caller: Optional[dict]) -> dict:
    """{arg of `callee`: top-level nodes} that the call `node` passes (`caller`: the caller's own, None at the
    top level, where each input is a top-level node)."""
    inputs = [t.split(":")[0] for t in node.input if not t.startswith("^")][offset:]
    args = library[callee].signature.input_arg
    if caller is None:
        return {arg.name: frozenset((name,)) for arg, name in zip(args, inputs)}
    return {arg.name: caller[name] for arg, name in zip(args, inputs) if name in caller}


def ops_fed_by(graph_def, placeholder: str, library, sigs, graphs, depth: int = 8,
                      accept=lambda node, pos: node.op in PARSE_OPS and pos == 0,
                      follow=None, through: Tuple[str, ...] = ()):
    """Parse ops (or the ops `accept` takes) reached from a top-level placeholder
    through Identity, the ops `through` names and function calls (with `follow`, a
    predicate on a DataType, through any op to its outputs of a dtype it takes):
    [Reached (FunctionGraph, node)]."""
    found = []
    frontier = []
    for node in graph_def.node:
        for pos, text in enumerate(i for i in node.input if not i.startswith("^")):
            if text.split(":")[0] == placeholder:
                frontier.append((node, pos))
    # Top-level consumers are call ops into the signature function.
    work = [(name, pos - offset, depth, _bindings(node, name, offset, library, None)) for node, pos in frontier
            for name, offset in called_functions(node, library) if pos >= offset]
    seen = set()
    while work:
        fname, pos, left, bindings = work.pop()
        key = (fname, pos, tuple(sorted(bindings.items())))
        if key in seen or left == 0:
            continue
        seen.add(key)
        if fname not in graphs:
            graphs[fname] = FunctionGraph(library[fname], sigs)
        fg = graphs[fname]
        args = library[fname].signature.input_arg
        if pos >= len(args):
            continue
        refs, visited = [Ref(args[pos].name, 0)], set()
        while refs:
            ref = refs.pop()
            if ref in visited:
                continue
            visited.add(ref)
            for consumer, cpos in fg.consumers(ref):
                node = fg.nodes[consumer]
                if accept(node, cpos):
                    found.append(Reached(fg, node, bindings))
                elif called_functions(node, library):
                    work.extend((name, cpos - offset, left - 1, _bindings(node, name, offset, library, bindings))
                                for name, offset in called_functions(node, library) if cpos >= offset)
                    if follow is not None:
                        # and out of it: items normalised in a map_fn or a nested tf.function, looked up after it
                        refs.extend(_flows_on(fg, node, cpos, follow))
                elif node.op in ("Identity", "IdentityN") + through:
                    refs.append(Ref(consumer, cpos if node.op == "IdentityN" else 0))
                elif follow is not None:
                    refs.extend(_flows_on(fg, node, cpos, follow))
    return found
