"""What a site computes, for the report: sum, mean, sqrtn, masked mean,
weighted mean or max.

The fused op's combiner says what the op does; the label says what the model
does with it. A bag sum that the graph then divides by the sum of the same
per-index multiplier is a mean however it is written: `x / s`, `div_no_nan(x,
s)`, `x * (1 / s)`, `x * reciprocal(s)`, with `s` a reduce_sum (or segment sum)
of the multiplier, expanded, cast or not. The multiplier is a mask when it is
a boolean (cast to a number, or a tf.where), weights otherwise; a multiply by
ones, or a division by the bag size, makes it a plain mean. Divided by
sqrt(sum(w^2)) it is sqrtn.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Site

_DIVISIONS = ("RealDiv", "DivNoNan", "Div")
_REDUCTIONS = ("Sum", "UnsortedSegmentSum", "SegmentSum")
_PASS = ("Identity", "ExpandDims", "Reshape", "Squeeze", "StridedSlice", "GatherV2",
         "Tile", "BroadcastTo")


def _base(fg: FunctionGraph, ref: Ref) -> Ref:
    """The tensor `ref` was broadcast, expanded, re-gathered or cast from."""
    node = fg.producer(ref)
    while node is not None and (node.op in _PASS or node.op == "Cast"):
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    return ref


def _same_value(fg: FunctionGraph, a: Ref, b: Ref, depth: int = 16) -> bool:
    """a and b hold the same value: one tensor, or the same stateless ops on the same inputs
    (a mask computed twice, once for the rows and once for its count), constants by value."""
    if a == b:
        return True
    x, y = fg.producer(a), fg.producer(b)
    if x is None or y is None or depth == 0 or a.index != b.index or x.op != y.op:
        return False
    if x.op == "Const":
        u, v = fg.const_value(a), fg.const_value(b)
        return u is not None and v is not None and u.dtype == v.dtype and np.array_equal(u, v)
    op_def = op_def_registry.get(x.op)
    # A variable read twice in one call reads one value (serving assigns nothing in between).
    if op_def is None or (op_def.is_stateful and x.op != "ReadVariableOp"):
        return False
    attrs = [{k: v.SerializeToString() for k, v in n.attr.items() if not k.startswith("_")} for n in (x, y)]
    ins = fg.inputs(x), fg.inputs(y)
    return attrs[0] == attrs[1] and len(ins[0]) == len(ins[1]) and \
        all(_same_value(fg, p, q, depth - 1) for p, q in zip(*ins))


def _is_mask(fg: FunctionGraph, ref: Ref) -> bool:
    node = fg.producer(ref)
    while node is not None and node.op in _PASS:
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    return node is not None and node.op == "Cast" and "SrcT" in node.attr and \
        node.attr["SrcT"].type == types_pb2.DT_BOOL


def _divisor(fg: FunctionGraph, root: str) -> Optional[Ref]:
    """The tensor the bag is divided by, if its only use is a division."""
    consumers = fg.consumers(Ref(root, 0))
    if len(consumers) != 1:
        return None
    name, pos = consumers[0]
    node = fg.nodes[name]
    ins = fg.inputs(node)
    if node.op in _DIVISIONS and pos == 0:
        return ins[1]
    if node.op == "Mul":
        other = fg.producer(ins[1 - pos])
        if other is None:
            return None
        if other.op == "Reciprocal":
            return fg.inputs(other)[0]
        if other.op in _DIVISIONS:
            one = fg.const_value(fg.inputs(other)[0])
            if one is not None and np.all(one == 1):
                return fg.inputs(other)[1]
    return None


def _floor_of_empty_bags(fg: FunctionGraph, node) -> bool:
    """maximum(count, c) with a constant 0 < c <= 1: unsorted_segment_mean/sqrt_n's
    guard, which changes only an empty bag's count (whose sum is 0)."""
    if node.op != "Maximum":
        return False
    floor = fg.const_value(fg.inputs(node)[1])
    return floor is not None and floor.size == 1 and 0 < float(np.reshape(floor, [])) <= 1


def _adds_last_axis(fg: FunctionGraph, node) -> bool:
    """x[..., None] / x[:, None] (a StridedSlice adding a unit last axis)."""
    from pkm_serve.export.dense import adds_unit_axis  # dense imports sites, which labels needs
    return node.op == "StridedSlice" and adds_unit_axis(fg, node, fg.inputs(node), -1)


def _reduced(fg: FunctionGraph, ref: Ref) -> Optional[Ref]:
    """x of reduce_sum(x) / segment_sum(x), through casts, reshapes, x[..., None] and an empty-bag floor."""
    node = fg.producer(ref)
    while node is not None and (node.op in ("Identity", "Cast", "Reshape", "ExpandDims") or
                                _adds_last_axis(fg, node) or _floor_of_empty_bags(fg, node)):
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    if node is None or node.op not in _REDUCTIONS:
        return None
    return fg.inputs(node)[0]


def _bag_size_read(fg: FunctionGraph, ref: Ref, site: Site) -> bool:
    """`ref` is the ids' last dim read off their shape (tf.shape(ids)[-1], cast or not): the bag size
    of a dense site whatever width the ids are fed at (not of a bag over several axes: F * K)."""
    node = fg.producer(ref)
    while node is not None and node.op in ("Identity", "Cast", "Reshape", "ExpandDims"):
        node = fg.producer(fg.inputs(node)[0])
    if node is None or node.op != "StridedSlice" or site.indices is None or site.positions is not None or \
            site.flatten_bag_axes > 1 or \
            site.regathers or site.regroup_ids is not None or "ragged" in site.pattern or "sparse" in site.pattern:
        return False
    shape = fg.producer(fg.inputs(node)[0])
    rank = fg.shape(site.indices).rank
    index = fg.const_value(fg.inputs(node)[1])
    shrink = node.attr["shrink_axis_mask"].i if "shrink_axis_mask" in node.attr else 0
    return shape is not None and shape.op == "Shape" and fg.inputs(shape)[0] == site.indices and rank is not None \
        and shrink == 1 and index is not None and np.size(index) == 1 and int(np.ravel(index)[0]) in (-1, rank - 1)


def _squared_base(fg: FunctionGraph, ref: Ref) -> Optional[Ref]:
    node = fg.producer(ref)
    if node is None:
        return None
    ins = fg.inputs(node)
    if node.op == "Square":
        return _base(fg, ins[0])
    if node.op == "Mul" and _same_value(fg, _base(fg, ins[0]), _base(fg, ins[1])):
        return _base(fg, ins[0])
    if node.op == "Pow":
        exponent = fg.const_value(ins[1])
        if exponent is not None and float(exponent) == 2.0:
            return _base(fg, ins[0])
    return None


def _is_ones(fg: FunctionGraph, ref: Ref) -> bool:
    from pkm_serve.export.dense import is_ones  # dense imports sites, which labels needs
    return is_ones(fg, ref)


def computes(fg: FunctionGraph, site: Site) -> str:
    if site.combiner in ("max", "sqrtn"):
        return site.combiner
    if site.weight_factors:  # the weight is a product of factors: no division matches it (scales.py)
        return "mean" if site.divide_by_bag else "sum"
    if site.combiner == "mean" or site.divide_by_bag or site.divide_by_longest_bag:
        return "weighted mean" if (site.weights is not None and not site.divide_by_bag and
                                   "sparse" in site.pattern) else "mean"
    multiplier = site.weights if site.weights is not None else site.mask
    divisor = _divisor(fg, site.root) if site.root in fg.nodes else None
    if divisor is None:
        return "sum"
    divisor_node = fg.producer(divisor)
    if divisor_node is not None and divisor_node.op == "Sqrt":
        squared = _reduced(fg, fg.inputs(divisor_node)[0])
        base = None if squared is None else _squared_base(fg, squared)
        if base is not None and (_same_value(fg, base, _base(fg, multiplier)) if multiplier is not None
                                 else _is_ones(fg, base)):
            return "sqrtn"
        if multiplier is None and squared is not None and _is_ones(fg, squared):
            return "sqrtn"  # a count of ones is the sum of their squares
        return "sum"
    summed = _reduced(fg, divisor)
    if summed is None:
        value = fg.const_value(divisor)
        bag_dims = site.gathered_shape[-1 - site.flatten_bag_axes:-1] if site.gathered_shape else [None]
        bag = None if None in bag_dims else int(np.prod(bag_dims))  # F * K of a bag over [1, 2]
        if (value is not None and bag is not None and np.all(value == bag)) or _bag_size_read(fg, divisor, site):
            return "mean"
        return "sum"
    if _is_ones(fg, summed):  # divided by the bag size (a ragged reduce_mean counts ones), weighted or not
        return "mean"
    if multiplier is None:
        return "sum"
    if not _same_value(fg, _base(fg, summed), _base(fg, multiplier)):
        return "sum"
    if site.mask is not None or _is_mask(fg, summed) or _is_mask(fg, multiplier):
        return "masked mean"
    return "weighted mean"
