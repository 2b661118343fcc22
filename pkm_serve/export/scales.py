"""Rows scaled more than once, or by a negation or a division, on their way to a dense bag:

  rows * w[..., None] * mask[..., None],  -rows,  rows / K,  rows / d[..., None],  -(rows * w[..., None]) * 0.5

Each is one weighted bag: sum_k rows[b, k] * f1[b, k] * ... / d[b, k] * -1 = sum_k weight[b, k] * rows[b, k]
with weight = f1 * ... / d * -1. The first multiplier (dense.resolve_rows) is the site's weights; every
other step is a Factor here, per-index, shared by every bag or one value, checked as weights are. Before
the rewrite, fold_factors builds the one weight from them (Mul, RealDiv, Neg in float32 for half tables,
which TFLite has no half DIV for), broadcast as the composite's products broadcast, and the op takes it.
"""
from __future__ import annotations

import sys
from typing import List, NamedTuple, Optional, Set

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export import dense
from pkm_serve.export.dense import is_ones, is_scalar, leads_to_gather, strip_trailing_unit_axis
from pkm_serve.export.fuse import _cast, _squeeze_last
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import (GATHER_OPS, ND_GATHER_OPS, NotASite, Site, Skip, _fed_at_run_time, per_bag, same_dims,
                                    shared_by_bags, tensor_dtype)
from pkm_serve.export.position_slices import attr_value

SCALE_OPS = ("Mul", "RealDiv", "Neg")
HALF = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)


class Factor(NamedTuple):
    kind: str            # "mul" | "div" | "neg"
    ref: Optional[Ref]   # the multiplier or divisor (None for "neg")
    squeeze: bool        # it is [..., K, 1]: its last axis dropped
    scalar: bool         # one value for every row
    after_mask: bool = False  # it scales rows a tf.where has masked (found before the mask, walking down)


def match_reduce(fg: FunctionGraph, node, site: Site) -> Site:
    """dense.match_reduce, rows scaled by several factors included."""
    return dense.match_reduce(fg, node, site, scaling=sys.modules[__name__])


def match_reduce_max(fg: FunctionGraph, node, site: Site) -> Site:
    """dense.match_reduce_max: rows scaled by a factor are reported (max(-rows) is -min(rows))."""
    return dense.match_reduce_max(fg, node, site, scaling=sys.modules[__name__])


def resolve_scale(fg: FunctionGraph, node, ins: List[Ref], rows, site: Site, op: Optional[str] = None) -> Ref:
    """Records a Mul (the rows already have weights), RealDiv(rows, d) or Neg(rows) as a factor of the
    site's weight; returns the rows side. NotASite where neither side (or both) is the rows, or where the
    factor is computed from the gathered rows themselves (a row norm: embedding_lookup's max_norm clip).
    `op`: the node's op as a multiply of the rows (dense._multiply_op: multiply_no_nan(rows, f) is "Mul")."""
    op = op or node.op
    if op == "Neg":
        rows.factors.append(Factor("neg", None, False, False))
        site.weighted = True
        return ins[0]
    sides = [(ins[0], ins[1])] if op == "RealDiv" or node.op == "MulNoNan" else [(ins[0], ins[1]), (ins[1], ins[0])]
    found = [(r, f) for r, f in sides if leads_to_gather(fg, r) and not leads_to_gather(fg, f)]
    if not found and op == "RealDiv" and leads_to_gather(fg, ins[0]) and _width(fg, ins[1]) == 1 and \
            _width(fg, ins[0]) not in (None, 1):  # ragged broadcasting re-gathers a ragged divisor too
        found = [(ins[0], ins[1])]
    if not found:
        raise NotASite()
    rows_ref, factor_ref = found[0]
    if _gathers(fg, factor_ref) & _gathers(fg, rows_ref):
        raise NotASite()
    kind = "mul" if op == "Mul" else "div"
    if rows.ones is not None:  # a multiply by ones before: a factor like any other (it may broadcast)
        rows.factors.append(Factor("mul", rows.ones, rows.ones_squeeze, False))
        rows.ones = None
    site.weighted = True
    after_mask = rows.mask is None  # a mask found further down was applied before this factor
    if is_scalar(fg, factor_ref, fg.shape(rows_ref).rank):
        if not (kind == "mul" and is_ones(fg, factor_ref)):
            rows.factors.append(Factor(kind, factor_ref, False, True, after_mask))
        return rows_ref
    what = "multiplier" if kind == "mul" else "divisor"
    factor, nodes, squeeze = strip_trailing_unit_axis(fg, factor_ref, what)
    rows.nodes.extend(nodes)
    rows.factors.append(Factor(kind, factor, squeeze, False, after_mask))
    return rows_ref


def _width(fg: FunctionGraph, ref: Ref) -> Optional[int]:
    shape = fg.shape(ref)
    return shape[-1] if shape.rank else None


def check_factors(fg: FunctionGraph, site: Site, factors: List[Factor], ids_shape) -> None:
    """Each factor is per-index (the ids' shape), shared by every bag or one value; one fed at run time
    in a lower rank than the ids is refused as such weights are (sites.check_shared_weights_fixed);
    the shape of the rows between two factors is not read (it is the ids' broadcast against some of
    them only)."""
    for factor in factors:
        if factor.ref is None:
            continue
        shape = fg.shape(factor.ref)
        if factor.squeeze and shape.rank:
            shape = shape[:-1]
        if not factor.scalar and not same_dims(shape, ids_shape) and not shared_by_bags(shape, ids_shape) and \
                not per_bag(shape, ids_shape):
            raise Skip(f"a {factor.kind} factor of the rows is not per-index: shape {shape} does not match "
                       f"indices shape {ids_shape}")
        if shape.rank is not None and ids_shape.rank is not None and shape.rank < ids_shape.rank and \
                _fed_at_run_time(fg, factor.ref) and not _one_value_always(fg, factor.ref):
            raise Skip(f"a factor of the rows every bag shares ({fg.render(factor.ref)}) is fed at run time, in a "
                       "shape no check here ties to the one the original needs: not fused (fused where it is a "
                       "constant or a variable)")
    if site.shape_consumers:
        raise Skip("the shape of rows scaled by several factors is read")
    _check_masked_then_divided(fg, site, factors)
    if site.table_dtype == types_pb2.DT_HALF:
        _check_half_weight_fits(fg, site, factors)


def _check_masked_then_divided(fg: FunctionGraph, site: Site, factors: List[Factor]) -> None:
    """tf.where(mask, rows, 0) / d: a masked row divided by d == 0 is 0 / 0, NaN in the composite's bag,
    where the op's padding leaves the masked entry out. Fused only where d is never 0, or the division is
    tf.math.divide_no_nan's (0 where d is 0: its zeros are padding too). Rows of a one-hot lookup are so
    masked: an id outside [0, N) is a zero row there, padding in the op (a mean over the ids in range,
    rows / count[:, :, None], is NaN for a bag with none)."""
    if site.mask is None and not site.ids_past_rows_padding:
        return
    no_nan = {noted[0] for noted in site.no_nan_weights}
    for factor in factors:
        if factor.kind == "div" and (factor.after_mask or site.ids_past_rows_padding) and \
                factor.ref not in no_nan and not _never_zero(fg, factor.ref):
            rows = "masked rows" if site.mask is not None else \
                "rows looked up by a one-hot matmul (an id outside [0, N) a zero row)"
            raise Skip(f"{rows} divided by {fg.render(factor.ref)}, which may be 0: the composite's 0 / 0 "
                       "makes the bag NaN where the fused op's mask leaves the entry out")


def _never_zero(fg: FunctionGraph, ref: Ref) -> bool:
    """A constant without zeros, or the length of an axis read off a shape (0 only where there are no rows)."""
    value = fg.const_value(ref)
    if value is not None:
        return value.size > 0 and bool(np.all(value != 0))
    node = fg.producer(ref)
    if node is not None and node.op in ("Cast", "Identity"):
        return _never_zero(fg, fg.inputs(node)[0])
    return node is not None and node.op == "StridedSlice" and _one_value_always(fg, ref)


def _check_half_weight_fits(fg: FunctionGraph, site: Site, factors: List[Factor]) -> None:
    """A float16 table: the op takes the folded weight in float16, where the product of the factors may pass
    65504 (1 / d, w * m) although each step of the composite (rows / d, rows * w * m) stays finite. Fused
    where the weight is a constant float16 holds, or at most one tensor times constants of magnitude <= 1."""
    tensors, scale = 0, 1.0
    for kind, ref in [("mul", site.weights)] + [(f.kind, f.ref) for f in factors]:
        if ref is None or kind == "neg" or _zero_or_one(fg, ref):
            continue
        value = fg.const_value(ref)
        if value is None and kind == "mul":
            tensors += 1
        elif value is not None and value.size and (kind == "mul" or np.all(value != 0)):
            magnitude = np.abs(value.astype(np.float64))
            scale = scale * magnitude.max() if kind == "mul" else scale / magnitude.min()
        else:
            tensors, scale = 2, np.inf
    if (tensors == 0 and scale > np.finfo(np.float16).max) or (tensors == 1 and scale > 1) or tensors > 1:
        raise Skip("a float16 table whose rows are scaled by several factors: their product, the op's one "
                   "float16 weight, may pass 65504 where each step of the composite stays finite")


def _zero_or_one(fg: FunctionGraph, ref: Ref) -> bool:
    """A cast of a bool (a mask as 0/1): no factor of magnitude above 1."""
    node = fg.producer(ref)
    return node is not None and node.op == "Cast" and node.attr["SrcT"].type == types_pb2.DT_BOOL


def _gathers(fg: FunctionGraph, ref: Ref, limit: int = 400) -> Set[str]:
    """The gathers `ref` is computed from (the first `limit` nodes above it)."""
    seen, found, todo = set(), set(), [ref]
    while todo and len(seen) < limit:
        ref = todo.pop()
        node = fg.producer(ref)
        if node is None or ref.node in seen:
            continue
        seen.add(ref.node)
        if node.op in GATHER_OPS + ND_GATHER_OPS:
            found.add(node.name)
        todo.extend(fg.inputs(node))
    return found


_ONE_VALUE_UNARY = ("Cast", "Identity", "Neg", "Reciprocal", "Sqrt", "Rsqrt", "Square")
_ONE_VALUE_BINARY = ("Mul", "RealDiv", "AddV2", "Sub", "Maximum", "Minimum")


def _one_value_always(fg: FunctionGraph, ref: Ref, depth: int = 12) -> bool:
    """`ref` is a scalar at run time whatever shapes the inputs are fed in: a constant, a variable, a size
    or rank, an entry of a shape (tf.cast(tf.shape(ids)[-1], tf.float32)), or arithmetic of those."""
    node = fg.producer(ref)
    if node is None or depth == 0:
        return False
    ins = fg.inputs(node)
    if node.op in ("Const", "ReadVariableOp"):
        return fg.shape(ref).is_fully_defined()
    if node.op in ("Size", "Rank"):
        return True
    if node.op == "StridedSlice":
        source = fg.producer(ins[0])
        begin = fg.const_value(ins[1])
        return source is not None and source.op == "Shape" and begin is not None and np.size(begin) == 1 and \
            attr_value(node, "shrink_axis_mask", "i") == 1 and not attr_value(node, "new_axis_mask", "i") and \
            not attr_value(node, "ellipsis_mask", "i")
    if node.op in _ONE_VALUE_UNARY:
        return _one_value_always(fg, ins[0], depth - 1)
    if node.op in _ONE_VALUE_BINARY:
        return all(_one_value_always(fg, r, depth - 1) for r in ins[:2])
    return False


def _broadcast_dims(a, b):
    """The static shape of an elementwise op of shapes a and b (None where unknown)."""
    if a is None or b is None:
        return None
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + list(a), [1] * (rank - len(b)) + list(b)
    return [y if x == 1 else x if y == 1 else x if x == y else None for x, y in zip(a, b)]


def fold_factors(fg: FunctionGraph, site: Site) -> None:
    """Before fusing: site.weights becomes the one weight its factors multiply to."""
    if not site.weight_factors:
        return
    prefix = site.root + "/pkm_folded_weights"
    work = types_pb2.DT_FLOAT if site.table_dtype in HALF else site.table_dtype

    def prepared(i: int, ref: Ref, squeeze: bool, scalar: bool):
        src, shape = tensor_dtype(fg, ref), fg.shape(ref)
        dims = None if shape.rank is None else shape.as_list()
        if src != work:
            ref = _cast(fg, f"{prefix}/cast{i}", ref, src, work, dims)
        if squeeze:
            ref, dims = _squeeze_last(fg, f"{prefix}/squeezed{i}", ref, work), None if dims is None else dims[:-1]
        if scalar:
            ref, dims = fg.add_op(f"{prefix}/scalar{i}", "Reshape", [ref, fg.add_const(
                f"{prefix}/scalar{i}/shape", np.zeros([0], np.int32))], {"T": DType(work), "Tshape": DType(
                    types_pb2.DT_INT32)}, shapes=[[]]), []
        return ref, dims

    weight, dims = (None, []) if site.weights is None else prepared(
        0, site.weights, site.weights_squeeze, site.weights_scalar)
    for i, factor in enumerate(site.weight_factors, 1):
        if factor.kind == "neg":
            weight = fg.add_const(f"{prefix}/minus_one", np.array(-1, np.float32).astype(
                _numpy_dtype(work))) if weight is None else fg.add_op(
                    f"{prefix}/neg{i}", "Neg", [weight], {"T": DType(work)}, shapes=[dims])
            continue
        ref, ref_dims = prepared(i, factor.ref, factor.squeeze, factor.scalar)
        if weight is None:
            weight = fg.add_const(f"{prefix}/one", np.array(1, _numpy_dtype(work)))
        dims = _broadcast_dims(dims, ref_dims)
        weight = fg.add_op(f"{prefix}/{factor.kind}{i}", "Mul" if factor.kind == "mul" else "RealDiv",
                           [weight, ref], {"T": DType(work)}, shapes=[dims])
    if work != site.table_dtype:
        weight = _cast(fg, prefix, weight, work, site.table_dtype, dims)
    site.weights, site.weights_squeeze, site.weights_scalar = weight, False, dims == []
    site.weight_factors = ()


def _numpy_dtype(enum: int):
    return dtypes.as_dtype(enum).as_numpy_dtype
