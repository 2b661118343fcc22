"""Integer keys of a SavedModel's lookup tables (IntegerLookup, StaticHashTable
of int64 ids), so that verification feeds integer inputs that are raw ids (item
ids 1001..1050 looked up into rows 2..51) with ids the tables know: drawn from
[0, rows), nearly all of them would be out of vocabulary, one row for all."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

TABLE_INIT_OPS = ("LookupTableImportV2", "InitializeTableV2")
TEXT_FILE_INIT_OPS = ("InitializeTableFromTextFileV2", "InitializeTableFromTextFile")
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
INT_TYPES = (types_pb2.DT_INT64, types_pb2.DT_INT32)
_MAX_KEYS = 2000


def _key_values(node, dtypes) -> np.ndarray:
    if node is None or node.op != "Const" or node.attr["dtype"].type not in dtypes:
        return np.zeros([0], np.int64)
    tensor = node.attr["value"].tensor
    if tensor.dtype == types_pb2.DT_STRING:
        # Only the first words are kept: decoding a 1M-word vocabulary whole, then sorting it, took 1-3 s.
        return np.array(first_strings(tensor, 8 * _MAX_KEYS), dtype=object)
    return tensor_util.MakeNdarray(tensor).ravel().astype(np.int64)


def first_strings(tensor, count: int) -> list:
    """The first `count` values of a DT_STRING TensorProto, without decoding the rest."""
    if tensor.string_val and len(tensor.string_val) == 1 and tensor.tensor_shape.dim:
        return list(tensor.string_val) * min(count, int(np.prod([d.size for d in tensor.tensor_shape.dim])))
    return list(tensor.string_val[:count])


def table_int_keys(meta_graph) -> Dict[str, List[int]]:
    """{top-level table node ("" where the initializer's caller does not say):
    the integer keys that initialise it} (table_keys)."""
    return table_keys(meta_graph, INT_TYPES)


def table_words(meta_graph) -> Dict[str, List[bytes]]:
    """{top-level table node: its string keys} of up to 64 bytes (table_keys)."""
    words = table_keys(meta_graph, (types_pb2.DT_STRING,))
    return {table: [w for w in keys if 0 < len(w) <= 64] for table, keys in words.items()}


def table_file_words(meta_graph, assets_dir: str) -> Dict[str, List[bytes]]:
    """{top-level table node: the first words of the vocabulary file that
    initialises it} (StringLookup(vocabulary=PATH): the file is an asset of
    the SavedModel, its path a variable Keras assigns from the asset's
    placeholder, or the placeholder itself)."""
    graph_def = meta_graph.graph_def
    top = {n.name: n for n in graph_def.node}
    assets = {a.tensor_info.name.split(":")[0]: a.filename for a in meta_graph.asset_file_def}
    assigned = {n.input[0].split(":")[0]: n.input[1].split(":")[0] for n in graph_def.node
                if n.op == "AssignVariableOp" and len(n.input) > 1}
    words: Dict[str, List[bytes]] = {}
    for fdef in graph_def.library.function:
        args = [a.name for a in fdef.signature.input_arg]
        for init in (n for n in fdef.node_def if n.op in TEXT_FILE_INIT_OPS and len(n.input) > 1):
            if "key_index" in init.attr and init.attr["key_index"].i != -2:
                continue  # keys are a column of each line, or line numbers
            table_arg, path_arg = (init.input[i].split(":")[0] for i in (0, 1))
            for call in (c for c in graph_def.node
                         if c.op in CALL_OPS and c.attr["f"].func.name == fdef.signature.name):
                table, source = _call_input(call, args, table_arg), _call_input(call, args, path_arg)
                node = top.get(source or "")
                if node is not None and node.op == "ReadVariableOp":
                    source = assigned.get(node.input[0].split(":")[0])
                if table and source in assets:
                    words[table] = _first_lines(os.path.join(assets_dir, assets[source]))
    return words


def _first_lines(path: str) -> List[bytes]:
    try:
        with open(path, "rb") as f:
            lines = [f.readline().rstrip(b"\r\n") for _ in range(_MAX_KEYS)]
    except OSError:
        return []
    return [w for w in lines if 0 < len(w) <= 64]


def table_keys(meta_graph, dtypes) -> Dict[str, list]:
    """{top-level table node: the keys of `dtypes` that initialise it}: constants in the initializer
    function, or passed to it by the top-level call (how Keras and
    tf.saved_model.save write a StaticHashTable's initializer)."""
    graph_def = meta_graph.graph_def
    top = {n.name: n for n in graph_def.node}
    keys: Dict[str, list] = {}
    for fdef in graph_def.library.function:
        inits = [n for n in fdef.node_def if n.op in TABLE_INIT_OPS and len(n.input) > 1]
        if not inits:
            continue
        nodes = {n.name: n for n in fdef.node_def}
        args = [a.name for a in fdef.signature.input_arg]
        calls = [c for c in graph_def.node
                 if c.op in CALL_OPS and c.attr["f"].func.name == fdef.signature.name]
        for init in inits:
            table_arg, source = (init.input[i].split(":")[0] for i in (0, 1))
            inside = _key_values(nodes.get(source), dtypes)
            for call in calls or [None]:
                table = _call_input(call, args, table_arg) or ""
                passed = _key_values(top.get(_call_input(call, args, source) or ""), dtypes)
                if inside.size or passed.size:
                    keys.setdefault(table, []).append(inside if inside.size else passed)
    return {table: _first_distinct(k) if k[0].dtype == object else _smallest_distinct(np.concatenate(k))
            for table, k in keys.items()}


def _first_distinct(words: list) -> list:
    """The first _MAX_KEYS distinct words, in table order."""
    return list(dict.fromkeys(w for part in words for w in part.tolist()))[:_MAX_KEYS]


def _smallest_distinct(keys: np.ndarray) -> list:
    """The _MAX_KEYS smallest distinct keys (a sort: np.unique took 2 s on 1M keys)."""
    ordered = np.sort(keys)
    return ordered[np.concatenate([[True], ordered[1:] != ordered[:-1]])][:_MAX_KEYS].tolist()


def _call_input(call, args: List[str], arg: str) -> Optional[str]:
    if call is None or arg not in args or args.index(arg) >= len(call.input):
        return None
    return call.input[args.index(arg)].split(":")[0]


def model_int_keys(keys_of_table: Dict[str, List[int]]) -> List[int]:
    """Sorted integer keys of all the model's lookup tables (table_int_keys),
    some of each."""
    share = _MAX_KEYS // max(len(keys_of_table), 1)
    return sorted({k for keys in keys_of_table.values() for k in keys[:share]})


def called_functions(node, library) -> List[Tuple[str, int]]:
    """(function, offset) for each library function `node` runs with its inputs from `offset` on as the
    function's args: a call op's f, an If/Case's branches (after the condition or branch index), a While's
    body and cond (a lookup inside tf.cond, tf.while_loop or tf.map_fn reads its table there)."""
    if node.op in CALL_OPS:
        names, offset = [node.attr["f"].func.name], 0
    elif node.op in ("If", "StatelessIf"):
        names, offset = [node.attr[b].func.name for b in ("then_branch", "else_branch")], 1
    elif node.op in ("Case", "StatelessCase"):
        names, offset = [f.name for f in node.attr["branches"].list.func], 1
    elif node.op in ("While", "StatelessWhile"):
        names, offset = [node.attr[b].func.name for b in ("body", "cond")], 0
    else:
        return []
    return [(name, offset) for name in names if name in library]


def resource_sources(meta_graph, depth: int = 8) -> Dict[Tuple[str, str], Set[str]]:
    """{(function, arg): top-level nodes passed to it}, through up to `depth`
    nested calls: which table a lookup inside a function reads."""
    graph_def = meta_graph.graph_def
    library = {f.signature.name: f for f in graph_def.library.function}
    sources: Dict[Tuple[str, str], Set[str]] = {}

    def pass_on(caller, nodes):
        for node in nodes:
            for callee, offset in called_functions(node, library):
                inputs = [t for t in node.input if not t.startswith("^")][offset:]
                for arg, text in zip(library[callee].signature.input_arg, inputs):
                    name = text.split(":")[0]
                    passed = {name} if caller is None else sources.get((caller, name), set())
                    if passed:
                        sources.setdefault((callee, arg.name), set()).update(passed)

    pass_on(None, graph_def.node)
    for _ in range(depth):
        before = sum(len(v) for v in sources.values())
        for fname in {f for f, _ in sources}:
            pass_on(fname, library[fname].node_def)
        if sum(len(v) for v in sources.values()) == before:
            break
    return sources
