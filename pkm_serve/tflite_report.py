"""What a TFLite interpreter reports, read for pkm_serve.tflite (which re-exports these): the
execution plan (which nodes a delegate runs) and the messages of the runtimes' error text.
Needs no TensorFlow."""

from __future__ import annotations

import re
from typing import Any, Dict, List


def ops_in_plan(interp) -> List[str]:
    """Op names of the nodes that run (see execution_plan)."""
    return [op["op_name"] for op in execution_plan(interp) if op["replaced_by"] is None]


def execution_plan(interp) -> List[Dict[str, Any]]:
    """The interpreter's nodes with, for each, ``replaced_by``: the index of
    the DELEGATE node that runs it instead, or None if it runs itself.

    The Python interpreters list every node, including those a delegate
    replaced, and do not expose the plan; a node is replaced when a delegate
    node writes one of its outputs, or when all readers of its outputs are
    replaced nodes (and its outputs are no model outputs).
    """
    ops = [dict(op) for op in interp._get_ops_details()]  # pylint: disable=protected-access
    model_outputs = {d["index"] for d in interp.get_output_details()}
    delegate_of = {}
    for op in ops:
        op["inputs"] = [int(i) for i in op["inputs"]]
        op["outputs"] = [int(o) for o in op["outputs"]]
        op["replaced_by"] = None
        if op["op_name"] == "DELEGATE":
            for t in op["outputs"]:
                delegate_of[t] = op["index"]
    readers: Dict[int, List[Dict[str, Any]]] = {}
    for op in ops:
        for t in op["inputs"]:
            readers.setdefault(t, []).append(op)
    for op in ops:
        if op["op_name"] != "DELEGATE":
            hits = [delegate_of[t] for t in op["outputs"] if t in delegate_of]
            if hits:
                op["replaced_by"] = hits[0]
    changed = True
    while changed:
        changed = False
        for op in ops:
            if op["replaced_by"] is not None or op["op_name"] == "DELEGATE" or not op["outputs"]:
                continue
            owners = set()
            for t in op["outputs"]:
                rs = readers.get(t, [])
                if t in model_outputs or not rs or any(r["replaced_by"] is None for r in rs):
                    owners = None
                    break
                owners.update(r["replaced_by"] for r in rs)
            if owners and len(owners) == 1:
                op["replaced_by"] = owners.pop()
                changed = True
    return ops


# Where one of the runtime's messages starts inside another. TFLite's messages (its kernels',
# ours, "Node number 1 (PkmDelegate) failed to invoke.") end without a newline, as its C++ and
# Java reporters add one; the Python runtimes join them as they come ("...padding)Node number 1").
# Besides before "Node number" and our prefixes (the fused chain's "PkmEmbeddingBag (fused
# GATHER/MUL/SUM): " too: it ran into a strict resize's "...identified by -1."): after the runtime's "failed to invoke." /
# "failed to prepare." and TF_LITE_ENSURE's "... was not true." (a negative GATHER index gives
# "...was not true.gather index out of bounds"; a reused interpreter's text, "...failed to
# invoke./tensorflow/tensorflow/lite/kernels/reshape.cc:92 ...").
_GLUED_MESSAGE = re.compile(
    r"(?<=\S)(?=Node number \d+ \(|PkmEmbeddingBag: |PkmEmbeddingBag \(fused [A-Z/]+\): "
    r"|PkmRaggedEmbeddingBag: |PkmDelegate: )"
    r"|(?:(?<=failed to invoke\.)|(?<=failed to prepare\.)|(?<=was not true\.))(?=\S)")


# pkm_serve's ops that a .tflite can hold (the converter keeps any op as a custom op with
# allow_custom_ops) but that no TFLite kernel runs (the quantized ops), or only the delegate
# (PkmCheckThen, a check the user may not know the model holds): the runtime's words name only
# the op.
_NO_TFLITE_KERNEL_HINTS = {
    re.compile(r"unresolved custom op: PkmQuantized(?:Ragged)?EmbeddingBag\b"):
        " (pkm_serve.quantized's op, which int8 SavedModels use, has no TFLite kernel: convert the float "
        "model and quantize the .tflite's tables with pkm_serve.tflite.quantize_table_int8, or export "
        "the float SavedModel with --quantize-table int8 --tflite)",
    re.compile(r"unresolved custom op: PkmCheckThen\b"):
        " (the run-time check pkm_serve adds where XLA may compile a function for the CPU, jit_compile=True "
        "or auto-clustering: its kernel is in pkm_serve's delegate, libpkm_tflite.so, which a libpkm_tflite.so "
        "built before the check lacks; pass load_delegate(pkm_serve.tflite.delegate_path()), or in C++ "
        "resolver.AddCustom(\"PkmCheckThen\", PkmCheckThenRegistration()))",
}


def runtime_messages(text: str) -> List[str]:
    """The messages of a Python TFLite runtime's error text, each on its own (whitespace runs
    made one space)."""
    messages = [" ".join(part.split()) for line in text.splitlines()
                for part in _GLUED_MESSAGE.split(line) if part.strip()]
    return [m + "".join(hint for words, hint in _NO_TFLITE_KERNEL_HINTS.items() if words.search(m))
            for m in messages]
