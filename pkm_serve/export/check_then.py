"""PkmCheckThen(condition, value, message) back to Identity(value) after Assert(condition, [message]).

The op library's PkmCheckThen is a run-time check XLA keeps (pkm_serve._xla.checked_when_compiled); a
SavedModel traced from a jit_compile function carries it. No TFLite runtime has it: the .tflite
is converted from a copy with each one written as before the op existed (the converter drops the
Assert, as it drops every Assert)."""
from __future__ import annotations

import contextlib
import os
import tempfile

from tensorflow.core.framework import types_pb2

from pkm_serve.export.files import FINGERPRINT_PB, SAVED_MODEL_PB
from pkm_serve.export.saved_model_io import read_saved_model, record_new_ops
from pkm_serve.export.segment_ids import ROOM_FOR_BAGS

CHECK_THEN = "PkmCheckThen"


def _unfold(nodes, taken: set, ref_format: str) -> int:
    """Rewrites the PkmCheckThen nodes of one node list in place; returns how many."""
    count = 0
    for node in list(nodes):
        if node.op != CHECK_THEN:
            continue
        condition, value = node.input[0], node.input[1]
        controls = [i for i in node.input[2:] if i.startswith("^")]
        base = name = node.name + "/pkm_check"
        suffix = 0
        while name in taken:
            suffix += 1
            name = f"{base}_{suffix}"
        taken.update((name, name + "/message"))
        message = nodes.add(name=name + "/message", op="Const")
        message.attr["dtype"].type = types_pb2.DT_STRING
        message.attr["value"].tensor.dtype = types_pb2.DT_STRING
        message.attr["value"].tensor.string_val.append(node.attr["message"].s)
        message.input.extend(controls)
        check = nodes.add(name=name, op="Assert")
        check.input.extend([condition, ref_format.format(name + "/message")] + controls)
        check.attr["T"].list.type.append(types_pb2.DT_STRING)
        check.attr["summarize"].i = 3
        for attr in ("_device", "device"):
            if attr in node.attr:
                check.attr[attr].CopyFrom(node.attr[attr])
        # Identity's output is named `output` like PkmCheckThen's: every reader's ref stays valid.
        node.op = "Identity"
        del node.attr["message"]
        del node.input[:]
        node.input.extend([value, "^" + name] + controls)
        count += 1
    return count


def _drop_room_for_bags(nodes) -> int:
    """The fused segment sites' Empty [bags, D] allocations (segment_ids.with_room_for_bags) as NoOp: no
    TFLite runtime has Empty, and a .tflite's UNSORTED_SEGMENT_SUM allocates as it runs."""
    count = 0
    for node in nodes:
        if node.op == "Empty" and ROOM_FOR_BAGS in node.name:
            controls = [i if i.startswith("^") else "^" + i.split(":")[0] for i in node.input]
            node.op = "NoOp"
            node.attr.clear()
            del node.input[:]
            node.input.extend(dict.fromkeys(controls))
            count += 1
    return count


def unfold_check_then(meta_graph) -> int:
    """Every PkmCheckThen of the MetaGraph (its graph and its functions) as Identity after an Assert, and
    every fused site's room-for-bags allocation as NoOp; returns how many were rewritten."""
    graph = meta_graph.graph_def
    count = _unfold(graph.node, {n.name for n in graph.node}, "{}") + _drop_room_for_bags(graph.node)
    for fdef in graph.library.function:
        count += _unfold(fdef.node_def, {n.name for n in fdef.node_def}, "{}:output:0")
        count += _drop_room_for_bags(fdef.node_def)
    return count


@contextlib.contextmanager
def without_check_then(saved_model_dir: str):
    """The SavedModel directory to convert to TFLite: itself, or where it holds PkmCheckThen a
    temporary copy (its variables and assets linked) with each written as Assert + Identity.
    The SavedModel served keeps PkmCheckThen: under XLA an Assert is dropped, the check with it."""
    proto = read_saved_model(saved_model_dir)
    unfolded = 0
    for meta_graph in proto.meta_graphs:
        here = unfold_check_then(meta_graph)
        if here:
            record_new_ops(meta_graph)
        unfolded += here
    if not unfolded:
        yield saved_model_dir
        return
    with tempfile.TemporaryDirectory(prefix=".pkm-tflite-") as copy:
        for name in os.listdir(saved_model_dir):
            if name not in (SAVED_MODEL_PB, FINGERPRINT_PB):
                os.symlink(os.path.join(os.path.abspath(saved_model_dir), name), os.path.join(copy, name))
        with open(os.path.join(copy, SAVED_MODEL_PB), "wb") as f:
            f.write(proto.SerializeToString(deterministic=True))
        yield copy
