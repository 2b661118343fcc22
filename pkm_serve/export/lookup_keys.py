"""Integer keys of a SavedModel's lookup tables (IntegerLookup, StaticHashTable
of int64 ids), so that verification feeds integer inputs that are raw ids (item
ids 1001..1050 looked up into rows 2..51) with ids the tables know: drawn from
[0, rows), nearly all of them would be out of vocabulary, one row for all."""
from __future__ import annotations

from typing import List

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

TABLE_INIT_OPS = ("LookupTableImportV2", "InitializeTableV2")
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
INT_TYPES = (types_pb2.DT_INT64, types_pb2.DT_INT32)
_MAX_KEYS = 2000


def _int_values(node) -> List[int]:
    if node is None or node.op != "Const" or node.attr["dtype"].type not in INT_TYPES:
        return []
    return [int(v) for v in tensor_util.MakeNdarray(node.attr["value"].tensor).ravel()]


def model_int_keys(meta_graph) -> List[int]:
    """Sorted integer keys that initialise the model's lookup tables: constants
    in the initializer function, or passed to it by the top-level call (how
    Keras and tf.saved_model.save write a StaticHashTable's initializer)."""
    graph_def = meta_graph.graph_def
    top = {n.name: n for n in graph_def.node}
    keys: List[int] = []
    for fdef in graph_def.library.function:
        nodes = {n.name: n for n in fdef.node_def}
        args = [a.name for a in fdef.signature.input_arg]
        for init in (n for n in fdef.node_def if n.op in TABLE_INIT_OPS and len(n.input) > 1):
            source = init.input[1].split(":")[0]
            keys += _int_values(nodes.get(source))
            if source not in args:
                continue
            position = args.index(source)
            for call in graph_def.node:
                if call.op in CALL_OPS and call.attr["f"].func.name == fdef.signature.name \
                        and position < len(call.input):
                    keys += _int_values(top.get(call.input[position].split(":")[0]))
        if len(keys) >= _MAX_KEYS:
            break
    return sorted(set(keys))[:_MAX_KEYS]
