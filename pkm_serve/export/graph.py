"""A small editable view of one FunctionDef of a SavedModel.

The export rewrites function bodies in place (same function names, same
signatures, same variables), so it works on FunctionDef protos directly rather
than re-tracing: tensors are named "node:output_arg:index" there, and this
module translates between that form and (node, flat output index).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry, tensor_shape, tensor_util


@dataclasses.dataclass(frozen=True)
class Ref:
    """One tensor inside a function: `node` is a node name or a function arg."""

    node: str
    index: int = 0


def output_arg_counts(node: node_def_pb2.NodeDef, library_sigs: Dict[str, object]):
    """[(output_arg_name, count)] of a node, from its OpDef or library function."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        sig = library_sigs.get(node.op)
        if sig is None:
            raise KeyError(f"op {node.op!r} of node {node.name!r} is not registered")
        return [(arg.name, 1) for arg in sig.output_arg]
    counts = []
    for arg in op_def.output_arg:
        if arg.number_attr:
            counts.append((arg.name, node.attr[arg.number_attr].i))
        elif arg.type_list_attr:
            counts.append((arg.name, len(node.attr[arg.type_list_attr].list.type)))
        else:
            counts.append((arg.name, 1))
    return counts


class FunctionGraph:
    """Indexes a FunctionDef: producers, consumers, static shapes, constants."""

    def __init__(self, fdef, library_sigs: Dict[str, object]):
        self.fdef = fdef
        self.library_sigs = library_sigs
        self.reindex()

    # ---- indexing -----------------------------------------------------------
    def reindex(self) -> None:
        fdef = self.fdef
        self.nodes: Dict[str, node_def_pb2.NodeDef] = {n.name: n for n in fdef.node_def}
        self.args = {a.name: (i, a) for i, a in enumerate(fdef.signature.input_arg)}
        self._out_counts = {}
        self._inputs_cache: Dict[str, Tuple[Tuple[str, ...], List[Ref]]] = {}
        self.data_consumers: Dict[Ref, List[Tuple[str, int]]] = {}
        self.control_consumers: Dict[str, List[str]] = {}
        for node in fdef.node_def:
            self._link(node)
        self.returned = {self.parse(v) for v in fdef.ret.values()}
        self.control_returned = set(fdef.control_ret.values())

    # The edits below keep these indexes current themselves: re-indexing after
    # each edit made an export quadratic in the model's node count.
    def _link(self, node: node_def_pb2.NodeDef) -> None:
        """Adds the edges into `node` to the consumer indexes."""
        for pos, text in enumerate(node.input):
            if text.startswith("^"):
                self.control_consumers.setdefault(text[1:], []).append(node.name)
            else:
                self.data_consumers.setdefault(self.parse(text), []).append((node.name, pos))

    def _unlink(self, node: node_def_pb2.NodeDef) -> List[str]:
        """Removes the edges into `node` from the consumer indexes; returns the
        names they came from."""
        producers = []
        for pos, text in enumerate(node.input):
            if text.startswith("^"):
                producers.append(text[1:])
                self.control_consumers[text[1:]].remove(node.name)
            else:
                ref = self.parse(text)
                producers.append(ref.node)
                self.data_consumers[ref].remove((node.name, pos))
        return producers

    def _counts(self, node_name: str):
        if node_name not in self._out_counts:
            self._out_counts[node_name] = output_arg_counts(
                self.nodes[node_name], self.library_sigs)
        return self._out_counts[node_name]

    # ---- tensor names -------------------------------------------------------
    def parse(self, text: str) -> Ref:
        """'node:arg:i' or 'func_arg' -> Ref with a flat output index."""
        parts = text.split(":")
        if len(parts) == 1:
            return Ref(parts[0], 0)
        if len(parts) == 2:  # 'func_arg:i' (rare but legal)
            return Ref(parts[0], int(parts[1]))
        name, arg_name, idx = parts[0], parts[1], int(parts[2])
        flat = 0
        for out_name, count in self._counts(name):
            if out_name == arg_name:
                return Ref(name, flat + idx)
            flat += count
        raise KeyError(f"node {name!r} has no output {arg_name!r}")

    def render(self, ref: Ref) -> str:
        """Ref -> the FunctionDef input string."""
        if ref.node in self.args and ref.node not in self.nodes:
            return ref.node
        flat = ref.index
        for out_name, count in self._counts(ref.node):
            if flat < count:
                return f"{ref.node}:{out_name}:{flat}"
            flat -= count
        raise KeyError(f"node {ref.node!r} has no output #{ref.index}")

    # ---- queries ------------------------------------------------------------
    def producer(self, ref: Ref) -> Optional[node_def_pb2.NodeDef]:
        return self.nodes.get(ref.node)

    def inputs(self, node: node_def_pb2.NodeDef) -> List[Ref]:
        # Cached per node while its input text is unchanged: site finding asks
        # again for the inputs of a wide consumer (an AddN of every bag) per site.
        texts = tuple(node.input)
        cached = self._inputs_cache.get(node.name)
        if cached is None or cached[0] != texts:
            cached = (texts, [self.parse(t) for t in texts if not t.startswith("^")])
            self._inputs_cache[node.name] = cached
        return list(cached[1])

    def control_inputs(self, node: node_def_pb2.NodeDef) -> List[str]:
        return [t[1:] for t in node.input if t.startswith("^")]

    def consumers(self, ref: Ref) -> List[Tuple[str, int]]:
        return self.data_consumers.get(ref, [])

    def shape(self, ref: Ref) -> tensor_shape.TensorShape:
        """Static shape as recorded at save time (unknown if not recorded)."""
        node = self.nodes.get(ref.node)
        if node is None:
            if ref.node not in self.args:
                return tensor_shape.TensorShape(None)
            i, arg = self.args[ref.node]
            if arg.type == types_pb2.DT_RESOURCE:
                return tensor_shape.TensorShape(None)
            shapes = self.fdef.attr.get("_input_shapes")
            if shapes is not None and i < len(shapes.list.shape):
                return tensor_shape.TensorShape(shapes.list.shape[i])
            return tensor_shape.TensorShape(None)
        shapes = node.attr.get("_output_shapes")
        if shapes is not None and ref.index < len(shapes.list.shape):
            return tensor_shape.TensorShape(shapes.list.shape[ref.index])
        return tensor_shape.TensorShape(None)

    def variable_shape_dtype(self, ref: Ref):
        """(shape, dtype enum) of the variable behind a resource function arg."""
        if ref.node in self.nodes or ref.node not in self.args:
            return None
        _, arg = self.args[ref.node]
        if arg.type != types_pb2.DT_RESOURCE or not arg.handle_data:
            return None
        data = arg.handle_data[0]
        return tensor_shape.TensorShape(data.shape), data.dtype

    def const_value(self, ref: Ref) -> Optional[np.ndarray]:
        node = self.nodes.get(ref.node)
        if node is None or node.op != "Const":
            return None
        return tensor_util.MakeNdarray(node.attr["value"].tensor)

    # ---- edits --------------------------------------------------------------
    def unique_name(self, base: str) -> str:
        name, i = base, 1
        while name in self.nodes or name in self.args:
            name = f"{base}_{i}"
            i += 1
        return name

    def add_node(self, node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
        self.fdef.node_def.append(node)
        added = self.fdef.node_def[-1]
        self.nodes[added.name] = added
        self._link(added)
        return added

    def add_const(self, base: str, value: np.ndarray, shapes: bool = True) -> Ref:
        node = node_def_pb2.NodeDef(name=self.unique_name(base), op="Const")
        node.attr["dtype"].type = tensor_util.make_tensor_proto(value).dtype
        node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value))
        if shapes:
            set_output_shapes(node, [np.shape(value)])
        self.add_node(node)
        return Ref(node.name, 0)

    def add_op(self, base: str, op: str, inputs: Iterable[Ref], attrs: dict,
               shapes: Optional[list] = None, control: Iterable[str] = ()) -> Ref:
        node = node_def_pb2.NodeDef(name=self.unique_name(base), op=op)
        node.input.extend([self.render(r) for r in inputs])
        node.input.extend(["^" + c for c in control])
        for key, value in attrs.items():
            node.attr[key].CopyFrom(attr(value))
        if shapes is not None:
            set_output_shapes(node, shapes)
        self.add_node(node)
        return Ref(node.name, 0)

    def replace_node(self, name: str, op: str, inputs: Iterable[Ref], attrs: dict,
                     control: Iterable[str] = ()) -> None:
        """Turns node `name` into a single-output `op`, keeping its name (so every
        consumer and the function's ret still point at it) and its output shape."""
        old = self.nodes[name]
        shapes = old.attr.get("_output_shapes")
        if shapes is not None:
            shapes = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                shape=list(shapes.list.shape[:1])))
        new_inputs = [self.render(r) for r in inputs] + ["^" + c for c in control]
        old_outputs = sum(count for _, count in self._counts(name))
        readers = [c for i in range(old_outputs)
                   for c in self.data_consumers.pop(Ref(name, i), [])]
        self._unlink(old)
        old.op = op
        del old.input[:]
        old.input.extend(new_inputs)
        old.ClearField("attr")
        for key, value in attrs.items():
            old.attr[key].CopyFrom(attr(value))
        if shapes is not None:
            old.attr["_output_shapes"].CopyFrom(shapes)
        self._out_counts.pop(name, None)
        self._link(old)
        # Output arg names differ between ops (Mul 'z', Sum 'output'...): every
        # reader of any old output reads the new single output.
        new_ref = Ref(name, 0)
        new_text = self.render(new_ref)
        for reader, pos in readers:
            self.nodes[reader].input[pos] = new_text
            self._inputs_cache.pop(reader, None)  # the same text may now mean another index
        self.data_consumers.setdefault(new_ref, []).extend(readers)
        if any(r.node == name for r in self.returned):
            for key, text in list(self.fdef.ret.items()):
                if text.split(":")[0] == name:
                    self.fdef.ret[key] = new_text
            self.returned = {r for r in self.returned if r.node != name} | {new_ref}

    def redirect(self, old: Ref, new: Ref) -> None:
        """Points every data input (and function output) reading `old` at `new`."""
        new_text = self.render(new)
        readers = self.data_consumers.pop(old, [])
        for reader, pos in readers:
            self.nodes[reader].input[pos] = new_text
        self.data_consumers.setdefault(new, []).extend(readers)
        if old in self.returned:
            for key, text in list(self.fdef.ret.items()):
                if self.parse(text) == old:
                    self.fdef.ret[key] = new_text
            self.returned = (self.returned - {old}) | {new}

    def redirect_control(self, old: str, new: str) -> None:
        """Points every control input on `old` (and control output) at `new`."""
        for reader in dict.fromkeys(self.control_consumers.get(old, [])):
            if reader == new:
                continue
            # Only the control edges change: re-linking the reader would parse
            # every data input again (a wide reader is met once per site).
            node = self.nodes[reader]
            for pos, text in enumerate(node.input):
                if text == "^" + old:
                    node.input[pos] = "^" + new
                    self.control_consumers[old].remove(reader)
                    self.control_consumers.setdefault(new, []).append(reader)
            before = list(node.input)
            _dedupe_inputs(node)
            if len(node.input) != len(before):
                dropped = collections.Counter(before) - collections.Counter(node.input)
                for text, count in dropped.items():
                    for _ in range(count):
                        self.control_consumers[text[1:]].remove(reader)
        if old in self.control_returned:
            already = new in self.control_returned  # two reads of one site's table: one control output
            for key, value in list(self.fdef.control_ret.items()):
                if value == old and already:
                    del self.fdef.control_ret[key]
                    outputs = [o for o in self.fdef.signature.control_output if o != key]
                    del self.fdef.signature.control_output[:]
                    self.fdef.signature.control_output.extend(outputs)
                elif value == old:
                    self.fdef.control_ret[key] = new
                    already = True
            self.control_returned = (self.control_returned - {old}) | {new}

    def unused_stateless(self) -> List[str]:
        """Side-effect-free nodes whose outputs nothing reads."""
        self.reindex()
        read = {r.node for r in self.data_consumers} | set(self.control_consumers) | \
            {r.node for r in self.returned} | self.control_returned
        unused = []
        for node in self.fdef.node_def:
            op_def = op_def_registry.get(node.op)
            if node.name not in read and op_def is not None and not op_def.is_stateful:
                unused.append(node.name)
        return unused

    def remove_dead(self, seeds: Iterable[str]) -> List[str]:
        """Removes `seeds` and then any side-effect-free node left without
        consumers. Returns the removed names."""
        self.reindex()
        removed: List[str] = []
        candidates = list(seeds)
        seeds = set(candidates)
        returned_nodes = {r.node for r in self.returned}
        while candidates:
            name = candidates.pop()
            node = self.nodes.get(name)
            if node is None or name in self.control_returned or name in returned_nodes:
                continue
            if self.control_consumers.get(name):
                continue
            if any(self.data_consumers.get(Ref(name, i)) for i in
                   range(sum(c for _, c in self._counts(name)))):
                continue
            op_def = op_def_registry.get(node.op)
            if name not in seeds and (op_def is None or op_def.is_stateful):
                continue
            # The indexes lose this node's edges here and the FunctionDef loses
            # the removed nodes once at the end: re-indexing after each removal
            # made a large model's export quadratic in its node count.
            producers = self._unlink(node)
            del self.nodes[name]
            removed.append(name)
            candidates.extend(p for p in producers if p in self.nodes)
        if removed:
            gone = set(removed)
            for pos in reversed(range(len(self.fdef.node_def))):
                if self.fdef.node_def[pos].name in gone:
                    del self.fdef.node_def[pos]
            self.reindex()
        return removed


def _dedupe_inputs(node) -> None:
    seen, keep = set(), []
    for text in node.input:
        if text.startswith("^"):
            if text in seen:
                continue
            seen.add(text)
        keep.append(text)
    if len(keep) != len(node.input):
        del node.input[:]
        node.input.extend(keep)


def attr(value) -> attr_value_pb2.AttrValue:
    """Python value -> AttrValue (bool, int, str, DType, AttrValue)."""
    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    if isinstance(value, int):
        return attr_value_pb2.AttrValue(i=value)
    if isinstance(value, str):
        return attr_value_pb2.AttrValue(s=value.encode())
    if isinstance(value, DType):
        return attr_value_pb2.AttrValue(type=value.enum)
    raise TypeError(f"unsupported attr value {value!r}")


@dataclasses.dataclass(frozen=True)
class DType:
    enum: int


def set_output_shapes(node, shapes) -> None:
    lst = attr_value_pb2.AttrValue.ListValue()
    for shape in shapes:
        lst.shape.add().CopyFrom(tensor_shape.TensorShape(shape).as_proto())
    node.attr["_output_shapes"].CopyFrom(attr_value_pb2.AttrValue(list=lst))
