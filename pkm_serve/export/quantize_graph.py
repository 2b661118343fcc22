"""The graph half of `--quantize-table int8`: which resource handles in a
SavedModel are which checkpointed variable, and the in-place rewrite that makes
a fused site's table an int8 variable read by PkmQuantizedEmbeddingBag.

A variable's handle reaches the functions two ways, and both must agree after
the rewrite: the object graph binds captured arguments (TF2's
`tf.saved_model.load`), and the MetaGraph's own graph passes VarHandleOps to
the signature, save and restore functions (the Session loader that TF Serving
and `pkm-serve serve` use). Handles are followed through function calls from
both; the restore function maps them to checkpoint keys.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Set, Tuple

from tensorflow.core.framework import types_pb2

from pkm_serve.export.errors import ExportError

QUANTIZED_OPS = {"PkmEmbeddingBag": "PkmQuantizedEmbeddingBag",
                 "PkmRaggedEmbeddingBag": "PkmQuantizedRaggedEmbeddingBag"}
GRAPH = "<graph>"  # the MetaGraph's top-level GraphDef, as a pseudo function name
_CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")
# Ops that take a table handle and do not read it as a value.
_HANDLE_ONLY = ("VarIsInitializedOp", "DisableCopyOnRead", "VarHandleOp")


@dataclasses.dataclass
class Body:
    """A FunctionDef or the GraphDef: its nodes, and its args (functions)."""
    name: str
    nodes: list
    args: List[str]
    fdef: object = None

    def node(self, name: str):
        return self.by_name[name]

    def __post_init__(self):
        self.by_name = {n.name: n for n in self.nodes}
        self.consumers: Dict[str, List[Tuple[object, int]]] = {}
        for n in self.nodes:
            for i, ref in enumerate(n.input):
                if not ref.startswith("^"):
                    self.consumers.setdefault(producer(ref), []).append((n, i))


def producer(ref: str) -> str:
    return ref.split(":", 1)[0]


def output_index(ref: str) -> int:
    """Index of `ref` among its node's outputs (FunctionDef 'n:out:i' or GraphDef 'n:i')."""
    parts = ref.split(":")
    return int(parts[-1]) if len(parts) > 1 else 0


def place(body_name: str, ref: str) -> str:
    """How a handle is named in `handles`: an arg, or a GraphDef node (output 0)."""
    return producer(ref) if body_name == GRAPH and output_index(ref) == 0 else ref


def bodies(meta_graph) -> Dict[str, Body]:
    out = {GRAPH: Body(GRAPH, list(meta_graph.graph_def.node), [])}
    for f in meta_graph.graph_def.library.function:
        out[f.signature.name] = Body(f.signature.name, list(f.node_def),
                                     [a.name for a in f.signature.input_arg], f)
    return out


def _string_const(body: Body, ref: str) -> List[str]:
    node = body.node(producer(ref))
    if node.op != "Const":
        return []
    return [s.decode() for s in node.attr["value"].tensor.string_val]


def _handle_sources(all_bodies: Dict[str, Body]) -> Dict[Tuple[str, str], str]:
    """(body, arg or VarHandleOp name) -> a root id: the GraphDef's VarHandleOp
    name, followed through calls into every function it reaches."""
    handles = {(GRAPH, n.name): n.name for n in all_bodies[GRAPH].nodes if n.op == "VarHandleOp"}
    changed = True
    while changed:
        changed = False
        for body in all_bodies.values():
            for n in body.nodes:
                callee = all_bodies.get(n.attr["f"].func.name) if n.op in _CALL_OPS else None
                if callee is None:
                    continue
                for i, ref in enumerate(n.input):
                    root = handles.get((body.name, place(body.name, ref)))
                    if root is not None and i < len(callee.args) and (callee.name, callee.args[i]) not in handles:
                        handles[(callee.name, callee.args[i])] = root
                        changed = True
    return handles


def _key_of_restored(all_bodies: Dict[str, Body], handles) -> Dict[str, str]:
    """GraphDef VarHandleOp name -> checkpoint key, from the restore function:
    AssignVariableOp(handle, Identity*(RestoreV2:tensors:k)) with tensor_names[k]."""
    keys = {}
    for body in all_bodies.values():
        for n in body.nodes:
            if n.op != "AssignVariableOp" or (body.name, n.input[0]) not in handles:
                continue
            ref = n.input[1]
            while body.by_name.get(producer(ref)) is not None and body.node(producer(ref)).op == "Identity":
                ref = body.node(producer(ref)).input[0]
            src = body.by_name.get(producer(ref))
            if src is not None and src.op == "RestoreV2":
                names = _string_const(body, src.input[1])
                k = output_index(ref)
                if k < len(names):
                    keys[handles[(body.name, n.input[0])]] = names[k]
    return keys


def handle_keys(meta_graph, all_bodies: Dict[str, Body], key_by_node: Dict[int, str]):
    """(body, arg or node name) -> checkpoint key for every handle of a checkpointed variable."""
    handles = _handle_sources(all_bodies)
    restored = _key_of_restored(all_bodies, handles)
    out = {place: restored[root] for place, root in handles.items() if root in restored}
    # TF2's path: captured arguments are the last len(bound_inputs) of a concrete function.
    bound = meta_graph.object_graph_def.concrete_functions
    frontier = []
    for name, cf in bound.items():
        body = all_bodies.get(name)
        if body is None or not cf.bound_inputs:
            continue
        captured = body.args[len(body.args) - len(cf.bound_inputs):]
        for arg, node_id in zip(captured, cf.bound_inputs):
            if node_id in key_by_node and (name, arg) not in out:
                out[(name, arg)] = key_by_node[node_id]
                frontier.append((name, arg))
    while frontier:  # and on through the calls those functions make
        name, arg = frontier.pop()
        for n in all_bodies[name].nodes:
            callee = all_bodies.get(n.attr["f"].func.name) if n.op in _CALL_OPS else None
            if callee is None:
                continue
            for i, ref in enumerate(n.input):
                if ref == arg and i < len(callee.args) and (callee.name, callee.args[i]) not in out:
                    out[(callee.name, callee.args[i])] = out[(name, arg)]
                    frontier.append((callee.name, callee.args[i]))
    return out


@dataclasses.dataclass
class TablePlan:
    """Everything the rewrite changes for one table variable."""
    key: str
    sites: List[Tuple[str, str]] = dataclasses.field(default_factory=list)   # (body, fused node)
    reads: List[Tuple[str, str]] = dataclasses.field(default_factory=list)   # ReadVariableOp / Assign
    values: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # Identity nodes on the value
    saves: List[Tuple[str, str, int]] = dataclasses.field(default_factory=list)  # Save/RestoreV2, index
    gathers: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # ResourceGather outside sites
    handle_args: Set[Tuple[str, str]] = dataclasses.field(default_factory=set)
    graph_handles: Set[str] = dataclasses.field(default_factory=set)
    copy_of: Optional[str] = None  # an initializer copy of that fused table (no sites of its own)


def fused_tables(all_bodies: Dict[str, Body], keys) -> Dict[str, TablePlan]:
    """The tables of fused sites: params = ReadVariableOp(handle of a checkpointed variable)."""
    plans: Dict[str, TablePlan] = {}
    for body in all_bodies.values():
        for n in body.nodes:
            if n.op not in QUANTIZED_OPS:
                continue
            if "combiner" in n.attr and n.attr["combiner"].s == b"max":
                raise ExportError(f"--quantize-table int8: the fused site {body.name}/{n.name} is a max "
                                  "bag (reduce_max), which has no int8 kernel; export without "
                                  "--quantize-table, or quantize the .tflite (pkm_serve.tflite."
                                  "quantize_table_int8)")
            read = body.by_name.get(producer(n.input[0]))
            while read is not None and read.op == "Identity":  # tf.identity(table), table.read_value()
                read = body.by_name.get(producer(read.input[0]))
            key = keys.get((body.name, read.input[0])) if read is not None and read.op == "ReadVariableOp" else None
            if key is None:
                raise ExportError(f"cannot quantize the fused site {body.name}/{n.name}: its table is not "
                                  "read from a checkpointed variable")
            plans.setdefault(key, TablePlan(key)).sites.append((body.name, n.name))
    return plans


def add_initializer_copies(all_bodies: Dict[str, Body], keys, plans: Dict[str, TablePlan]) -> None:
    """Variables the GraphDef initialises from a fused table (Keras' export saves
    such a copy beside the layer's variable) become int8 with it: the copy is
    only saved and restored, and a float copy would keep the table's bytes."""
    graph = all_bodies[GRAPH]
    for n in graph.nodes:
        if n.op != "AssignVariableOp":
            continue
        src = graph.by_name.get(producer(n.input[1]))
        if src is None or src.op != "ReadVariableOp":
            continue
        source_key = keys.get((GRAPH, place(GRAPH, src.input[0])))
        copy_key = keys.get((GRAPH, place(GRAPH, n.input[0])))
        if source_key in plans and copy_key is not None and copy_key not in plans:
            plans[copy_key] = TablePlan(copy_key, copy_of=source_key)


def _same_table(plan: TablePlan, key: Optional[str], plans) -> bool:
    """`key` is the plan's table, its initializer copy, or what it copies."""
    other = plans.get(key) if key is not None else None
    return key == plan.key or key == plan.copy_of or (other is not None and other.copy_of == plan.key)


def _follow_value(body: Body, ref_node: str, plan: TablePlan, what: str, keys, plans) -> None:
    """The table's value from `ref_node` (a ReadVariableOp): through Identity to
    fused sites (input 0), Shape and SaveV2; anything else keeps it float."""
    for consumer, i in body.consumers.get(ref_node, []):
        if consumer.op == "Identity":
            plan.values.append((body.name, consumer.name))
            _follow_value(body, consumer.name, plan, what, keys, plans)
        elif consumer.op == "Shape":  # reads the shape only (ids clipped to the rows, say)
            plan.values.append((body.name, consumer.name))
        elif consumer.op in QUANTIZED_OPS and i == 0:
            continue
        elif consumer.op == "SaveV2" and i >= 3:
            plan.saves.append((body.name, consumer.name, i - 3))
        elif consumer.op == "AssignVariableOp" and i == 1 and \
                _same_table(plan, keys.get((body.name, place(body.name, consumer.input[0]))), plans):
            plan.reads.append((body.name, consumer.name))  # the table assigned to itself (an initializer)
        else:
            raise ExportError(f"cannot quantize table {plan.key!r}: {what} is also used by "
                              f"{body.name}/{consumer.name} ({consumer.op}), which needs the float table")


def _restored_value(body: Body, assign, plan: TablePlan, keys, plans) -> None:
    ref = assign.input[1]
    while body.node(producer(ref)).op == "Identity":
        plan.values.append((body.name, producer(ref)))
        ref = body.node(producer(ref)).input[0]
    src = body.node(producer(ref))
    if src.op == "ReadVariableOp" and _same_table(plan, keys.get((body.name, place(body.name, src.input[0]))), plans):
        return  # the table assigned to itself (an initializer); the read is rewritten as a read
    if src.op != "RestoreV2":
        raise ExportError(f"cannot quantize table {plan.key!r}: {body.name}/{assign.name} assigns it "
                          "a computed value (a training step?); export a serving-only model")
    plan.saves.append((body.name, src.name, output_index(ref)))


def plan_uses(all_bodies: Dict[str, Body], keys, plans: Dict[str, TablePlan]) -> None:
    """Fills each plan with every node that touches the table; refuses uses that need it as float."""
    for (body_name, place), key in keys.items():
        plan = plans.get(key)
        if plan is None:
            continue
        body = all_bodies[body_name]
        if body_name == GRAPH:
            plan.graph_handles.add(place)
        else:
            plan.handle_args.add((body_name, place))
        for consumer, i in body.consumers.get(place, []):
            if consumer.op in _CALL_OPS or consumer.op in _HANDLE_ONLY:
                continue
            if consumer.op == "ReadVariableOp":
                plan.reads.append((body_name, consumer.name))
                _follow_value(body, consumer.name, plan, f"its value read by {body_name}/{consumer.name}", keys,
                              plans)
            elif consumer.op == "AssignVariableOp" and i == 0:
                plan.reads.append((body_name, consumer.name))
                _restored_value(body, consumer, plan, keys, plans)
            elif consumer.op == "ResourceGather" and i == 0 and consumer.attr["batch_dims"].i == 0 and \
                    body_name != GRAPH:
                plan.gathers.append((body_name, consumer.name))  # e.g. a tf_keras layer's own call function
            else:
                raise ExportError(f"cannot quantize table {key!r}: {body_name}/{consumer.name} "
                                  f"({consumer.op}) uses it outside a fused site")


def _set_list_type(node, attr: str, index: int, dtype) -> None:
    types = node.attr[attr].list.type
    if index < len(types):
        types[index] = dtype


def add_row_params_function(library, key: str, scales, biases) -> str:
    """One FunctionDef of the library returning (scales, biases) of table `key`
    as constants; every function that needs them calls it, so saved_model.pb
    holds them once however many functions read the table (tf_keras saves
    several traces of each layer). Returns its name."""
    import tensorflow as tf

    taken = {f.signature.name for f in library.function}
    base = "pkm_int8_row_params_" + re.sub(r"[^A-Za-z0-9_]", "_", key.split("/.ATTRIBUTES")[0])
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    fdef = library.function.add()
    fdef.signature.name = name
    for suffix, value in (("row_scales", scales), ("row_biases", biases)):
        fdef.signature.output_arg.add(name=suffix, type=types_pb2.DT_FLOAT)
        node = _add_node(fdef, suffix, "Const", [], dtype=types_pb2.DT_FLOAT)
        fdef.node_def[-1].attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=tf.float32))
        fdef.ret[suffix] = f"{node}:output:0"
    return name


def _call_row_params(fdef, name: str, function: str, rows: Optional[int]) -> Tuple[str, str]:
    """A PartitionedCall of the row-params function; its (scales, biases) outputs."""
    node = fdef.node_def.add(name=name, op="PartitionedCall")
    node.attr["Tin"].list.SetInParent()
    node.attr["Tout"].list.type.extend([types_pb2.DT_FLOAT, types_pb2.DT_FLOAT])
    node.attr["f"].func.name = function
    for _ in range(2):
        shape = node.attr["_output_shapes"].list.shape.add()
        shape.dim.add(size=-1 if rows is None else rows)
    return f"{name}:output:0", f"{name}:output:1"


def rewrite(all_bodies: Dict[str, Body], plan: TablePlan, row_params: str, rows: Optional[int] = None) -> None:
    """Makes the table int8 everywhere the plan lists, and its fused sites
    PkmQuantizedEmbeddingBag reading the row scales/biases from `row_params`
    (add_row_params_function)."""
    int8 = types_pb2.DT_INT8
    for body_name, name in plan.reads:
        all_bodies[body_name].node(name).attr["dtype"].type = int8
    for body_name, name in plan.values:
        all_bodies[body_name].node(name).attr["T"].type = int8
    for body_name, name, index in plan.saves:
        _set_list_type(all_bodies[body_name].node(name), "dtypes", index, int8)
    for name in plan.graph_handles:
        all_bodies[GRAPH].node(name).attr["dtype"].type = int8
    for body_name, arg in plan.handle_args:
        body = all_bodies[body_name]
        attrs = body.fdef.arg_attr.get(body.args.index(arg))
        if attrs is not None and "_handle_dtypes" in attrs.attr:
            for i in range(len(attrs.attr["_handle_dtypes"].list.type)):
                attrs.attr["_handle_dtypes"].list.type[i] = int8
    for body_name, name in plan.sites:
        node = all_bodies[body_name].node(name)
        params = _call_row_params(all_bodies[body_name].fdef, f"{name}/pkm_row_params", row_params, rows)
        _quantize_site(node, params)
    for body_name, name in plan.gathers:
        node = all_bodies[body_name].node(name)
        params = _call_row_params(all_bodies[body_name].fdef, f"{name}/pkm_row_params", row_params, rows)
        _dequantize_gather(all_bodies[body_name], node, params)


def _add_node(fdef, name: str, op: str, inputs: List[str], **types) -> str:
    node = fdef.node_def.add()
    node.name, node.op = name, op
    node.input.extend(inputs)
    for key, value in types.items():
        node.attr[key].type = value
    return name


def _add_const(fdef, name: str, value, dtype: int) -> str:
    """A Const node of `value` as `dtype`; returns its output's name."""
    import tensorflow as tf

    _add_node(fdef, name, "Const", [], dtype=dtype)
    fdef.node_def[-1].attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=tf.as_dtype(dtype)))
    return f"{name}:output:0"


def _dequantize_gather(body: Body, node, row_params: Tuple[str, str]) -> None:
    """A gather of the table outside a fused site reads int8 rows and returns
    scales[ids, None] * rows + biases[ids, None] in the table's float dtype,
    under its old name (consumers read `name:output:0`, Identity's output)."""
    f32, fdef = types_pb2.DT_FLOAT, body.fdef
    dtype, name, ids = node.attr["dtype"].type, node.name, node.input[1]
    index_type = node.attr["Tindices"].type
    control = [r for r in node.input if r.startswith("^")]
    node.name = f"{name}/pkm_int8_rows"
    node.attr["dtype"].type = types_pb2.DT_INT8
    axis = _add_const(fdef, f"{name}/pkm_axis", 0, types_pb2.DT_INT32)
    last = _add_const(fdef, f"{name}/pkm_last", -1, types_pb2.DT_INT32)
    per_row = []
    for suffix, param in zip(("row_scales", "row_biases"), row_params):
        g = _add_node(fdef, f"{name}/pkm_{suffix}_of_ids", "GatherV2", [param, ids, axis] + control,
                      Tparams=f32, Tindices=index_type, Taxis=types_pb2.DT_INT32)
        e = _add_node(fdef, f"{g}/expand", "ExpandDims", [f"{g}:output:0", last], T=f32,
                      Tdim=types_pb2.DT_INT32)
        per_row.append(f"{e}:output:0")
    rows = _add_node(fdef, f"{name}/pkm_cast", "Cast", [f"{node.name}:output:0"], SrcT=types_pb2.DT_INT8, DstT=f32)
    scaled = _add_node(fdef, f"{name}/pkm_scaled", "Mul", [f"{rows}:y:0", per_row[0]], T=f32)
    value = _add_node(fdef, f"{name}/pkm_dequantized", "AddV2", [f"{scaled}:z:0", per_row[1]], T=f32)
    if dtype != f32:
        value = _add_node(fdef, f"{name}/pkm_cast_back", "Cast", [f"{value}:z:0"], SrcT=f32, DstT=dtype)
        out = f"{value}:y:0"
    else:
        out = f"{value}:z:0"
    _add_node(fdef, name, "Identity", [out], T=dtype)


def _quantize_site(node, row_params: Tuple[str, str]) -> None:
    inputs = list(node.input)
    data_inputs = [r for r in inputs if not r.startswith("^")]
    control = [r for r in inputs if r.startswith("^")]
    del node.input[:]
    node.input.extend([data_inputs[0]] + list(row_params) + data_inputs[1:] + control)
    node.op = QUANTIZED_OPS[node.op]
    node.attr["Tscale"].type = types_pb2.DT_FLOAT


def quantize_graph(meta_graph, key_by_node: Dict[int, str]) -> Tuple[Dict[str, TablePlan], Dict[str, Body]]:
    """Plans the rewrite of one MetaGraph (nothing changed yet); ExportError
    when a fused table is used in a way int8 cannot serve."""
    all_bodies = bodies(meta_graph)
    keys = handle_keys(meta_graph, all_bodies, key_by_node)
    plans = fused_tables(all_bodies, keys)
    add_initializer_copies(all_bodies, keys, plans)
    plan_uses(all_bodies, keys, plans)
    return plans, all_bodies


def variable_nodes(meta_graph, key_by_node: Dict[int, str], key: str) -> List[object]:
    """The object graph's variable nodes saved under checkpoint key `key`."""
    nodes = meta_graph.object_graph_def.nodes
    return [nodes[i] for i, k in key_by_node.items() if k == key and i < len(nodes)
            and nodes[i].WhichOneof("kind") == "variable"]


def first_fused_dtype(all_bodies: Dict[str, Body], plan: TablePlan) -> Optional[int]:
    body_name, name = plan.sites[0]
    return all_bodies[body_name].node(name).attr["T"].type
