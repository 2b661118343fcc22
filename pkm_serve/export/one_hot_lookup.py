"""A lookup written as a one-hot matmul: tf.matmul(tf.one_hot(ids, N), table) (tf-models' OnDeviceEmbedding
with use_one_hot=True, on reshape(ids, [-1]), reshaped back) is tf.gather(table, ids) for ids in [0, N); an id
outside it gets a zero row, where the gather refuses it. A sum of such rows is the bag of the ids with those
ids as padding (Site.negative_ids_padding / ids_past_rows_padding, as one_hot counts fuse them); a reduce_mean
is that sum divided by K (dense.match_reduce). A max, or a mean the op would divide by the ids it reads,
would leave the zero rows out: reported (check_one_hot_combiner)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import TABLE_DTYPES, Site, Skip, through_identity


def _table_shape(fg: FunctionGraph, table: Ref):
    read = fg.producer(table)
    if read is not None and read.op == "ReadVariableOp":
        found = fg.variable_shape_dtype(fg.inputs(read)[0])
        if found is not None:
            return found[0]
    return fg.shape(table)


_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def _lookup_einsum(node) -> Optional[int]:
    """The one-hot operand's position of Einsum('...n,nd->...d') (a row per one-hot; any labels), else None."""
    equation = node.attr["equation"].s.decode().replace(" ", "")
    if "->" not in equation or equation.count(",") != 1:
        return None
    (first, second), out = equation.split("->")[0].split(","), equation.split("->")[1]
    for position, (hot, table) in enumerate(((first, second), (second, first))):
        if len(table) == 2 and len(set(table)) == 2 and hot.endswith(table[0]) and \
                table[1] not in hot and out == hot[:-1] + table[1] and table[0] not in hot[:-1] + out and \
                len(set(hot.replace("...", ""))) == len(hot.replace("...", "")):
            return position
    return None


def lookup_operands(fg: FunctionGraph, node):
    """(one-hot, table) refs of a matmul or einsum that may be a one-hot lookup, else None: MatMul or a
    batch matmul (neither adjoint, operand types alike: BatchMatMulV3's Tout too) of the one-hot first, or
    Einsum('...n,nd->...d') of the one-hot either side. A batch matmul broadcasts the [N, D] table."""
    if node is None:
        return None
    if node.op == "Einsum":
        position = _lookup_einsum(node) if len(fg.inputs(node)) == 2 else None
        return None if position is None else (fg.inputs(node)[position], fg.inputs(node)[1 - position])
    adjoints = ("transpose_a", "transpose_b") if node.op == "MatMul" else ("adj_x", "adj_y")
    if node.op not in ("MatMul",) + _BATCH_MATMULS or any(k in node.attr and node.attr[k].b for k in adjoints):
        return None
    if node.op == "BatchMatMulV3" and len({node.attr[a].type for a in ("Ta", "Tb", "Tout")}) != 1:
        return None
    return tuple(fg.inputs(node)[:2])


def one_hot_lookup(fg: FunctionGraph, node) -> Optional[Ref]:
    """The ids of a lookup (lookup_operands) of OneHot(ids, N, on 1, off 0, axis -1) in table [N, D], else None."""
    operands = lookup_operands(fg, node)
    return None if operands is None else _one_hot_ids(fg, operands[0], operands[1], _value_type(node))


def _one_hot_ids(fg: FunctionGraph, one_hot_ref: Ref, table: Ref, value_type: int,
                 readers: Optional[int] = None) -> Optional[Ref]:
    """The ids of `one_hot_ref` = OneHot(ids, N, on 1, off 0, axis -1), read by one node only (`readers`: that
    many of its consumers counted), N the rows of the [N, D] `table`, else None."""
    one_hot = fg.producer(one_hot_ref)
    # axis -1 is the attr's default, which a SavedModel may leave out
    if one_hot is None or one_hot.op != "OneHot" or ("axis" in one_hot.attr and int(one_hot.attr["axis"].i) != -1) or \
            value_type not in TABLE_DTYPES:
        return None
    ids, depth, on, off = fg.inputs(one_hot)
    depth, on, off = fg.const_value(depth), fg.const_value(on), fg.const_value(off)
    shape = _table_shape(fg, table)
    if depth is None or on is None or off is None or float(on) != 1.0 or float(off) != 0.0 or \
            shape.rank != 2 or shape[0] != int(depth) or \
            (len(fg.consumers(one_hot_ref)) if readers is None else readers) != 1:
        return None
    return ids


def flattened_one_hot_lookup(fg: FunctionGraph, node) -> Optional[Tuple[Ref, List[str]]]:
    """(ids, [the steps down to the OneHot, it last]) of MatMul(Reshape([Transpose](OneHot(ids, N)), [M, N]),
    table [N, D]), the lookup tf.tensordot(one_hot, table, 1) and keras.ops.matmul write: a reshape of
    [..., N] to [M, N] (N: the MatMul allows no other width) only stacks the one-hot rows in the ids' order (a transpose must keep every axis), so
    row m is table[flat ids[m]] (a zero row for an id outside [0, N)). Else None. The one-hot may also be
    read by Shape ops (tensordot's target shapes), which read no data."""
    if node is None or node.op != "MatMul" or any(node.attr[k].b for k in ("transpose_a", "transpose_b")
                                                  if k in node.attr):
        return None
    steps: List[str] = []
    ref = through_identity(fg, fg.inputs(node)[0], steps)
    reshape = fg.producer(ref)
    if reshape is None or reshape.op != "Reshape" or fg.shape(ref).rank != 2:
        return None
    steps.append(reshape.name)
    one_hot_ref = through_identity(fg, fg.inputs(reshape)[0], steps)
    transpose = fg.producer(one_hot_ref)
    if transpose is not None and transpose.op == "Transpose":
        perm = _concatenated_constant(fg, fg.inputs(transpose)[1])
        if perm is None or perm.tolist() != list(range(perm.size)):
            return None
        steps.append(transpose.name)
        one_hot_ref = through_identity(fg, fg.inputs(transpose)[0], steps)
    one_hot = fg.producer(one_hot_ref)
    # the MatMul refuses a reshape to [M, X] unless X is the table's N rows, the one-hot's depth (checked below)
    if one_hot is None or one_hot.op != "OneHot" or \
            any(fg.nodes[c].op != "Shape" for c, _ in fg.consumers(one_hot_ref) if c not in steps):
        return None
    data_readers = [c for c, _ in fg.consumers(one_hot_ref) if fg.nodes[c].op != "Shape"]
    ids = _one_hot_ids(fg, one_hot_ref, fg.inputs(node)[1], node.attr["T"].type, readers=len(data_readers))
    return None if ids is None else (ids, steps + [one_hot.name])


def _concatenated_constant(fg: FunctionGraph, ref: Ref) -> Optional[np.ndarray]:
    """A constant, or ConcatV2 of constants (tensordot's permutation), as a flat array; else None."""
    value = fg.const_value(ref)
    if value is not None:
        return np.ravel(value)
    node = fg.producer(ref)
    if node is None or node.op != "ConcatV2":
        return None
    parts = [fg.const_value(r) for r in fg.inputs(node)[:-1]]
    return None if any(p is None for p in parts) else np.concatenate([np.ravel(p) for p in parts])


def pooled_one_hot_einsum(fg: FunctionGraph, node, gather_class):
    """(Gather, rows' labels) of Einsum('bkn,nd->bd') (any labels: the one-hot's ...n, the table's nd, either
    side; the output the rows' labels ...d less some axes): the one-hot rows of the ids, reduced in the same
    einsum. The Gather's output is the one-hot (the site's private input); None where it is no such einsum."""
    ins = fg.inputs(node)
    equation = node.attr["equation"].s.decode().replace(" ", "")
    if len(ins) != 2 or "->" not in equation or "." in equation or equation.count(",") != 1:
        return None
    terms, out = equation.split("->")[0].split(","), equation.split("->")[1]
    for position in (0, 1):
        hot, table = terms[position], terms[1 - position]
        if len(table) != 2 or not hot.endswith(table[0]) or table[1] in hot or table[0] in hot[:-1] or \
                len(out) >= len(hot):  # the same labels: a lookup (one_hot_lookup), reduced elsewhere if at all
            continue
        ids = _one_hot_ids(fg, ins[position], ins[1 - position], node.attr["T"].type)
        if ids is None:
            continue
        one_hot = fg.producer(ins[position])
        index_dtype = one_hot.attr["TI"].type if "TI" in one_hot.attr else types_pb2.DT_INT64
        gathered = gather_class(ins[position], ins[1 - position], False, ids, [one_hot.name],
                                _table_shape(fg, ins[1 - position]), node.attr["T"].type, index_dtype)
        gathered.one_hot = True
        return gathered, hot[:-1] + table[1]
    return None


def _value_type(node) -> int:
    return node.attr["Ta"].type if node.op == "BatchMatMulV3" else node.attr["T"].type


def check_one_hot_combiner(site: Site) -> None:
    """A one-hot lookup's zero rows (ids outside [0, N)) count in the composite's max and mean; padding does not."""
    if site.ids_past_rows_padding and site.combiner != "sum":
        raise Skip(f"a {site.combiner} of rows looked up by a one-hot matmul: an id outside [0, N) is a zero row "
                   "that counts in the composite's " + site.combiner + ", and padding in the fused op: not fused")


def one_hot_gather(fg: FunctionGraph, ref: Ref, gather_class, nodes, flattened: bool = False):
    """The Gather of a one-hot lookup at `ref` (nodes: Identities before it), else None. `flattened`: rows a
    reshape gives back the ids' shape, so a lookup of the one-hot flattened to [-1, N] is taken too (its
    Gather's indices are the ids as one-hot encoded, not flattened: the caller reads them so)."""
    node = fg.producer(ref)
    ids = one_hot_lookup(fg, node)
    flat = flattened_one_hot_lookup(fg, node) if ids is None and flattened else None
    if ids is None and flat is None:
        return None
    one_hot_ref, table = lookup_operands(fg, node)
    steps = [fg.producer(one_hot_ref).name]
    if flat is not None:
        ids, steps = flat
    one_hot = fg.nodes[steps[-1]]
    index_dtype = one_hot.attr["TI"].type if "TI" in one_hot.attr else types_pb2.DT_INT64  # TI's default: left out
    gathered = gather_class(ref, table, False, ids, nodes + [node.name] + steps, _table_shape(fg, table),
                            _value_type(node), index_dtype)
    gathered.one_hot = True
    return gathered

