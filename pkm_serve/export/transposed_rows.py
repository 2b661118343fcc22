"""Gathered rows transposed before the bag reduction: reduce_sum(tf.transpose(rows, [0, 2, 1]), -1) of rows
[B, K, D] (Keras Permute((2, 1)) then channels_first pooling) is reduce_sum(rows, 1). Any constant
permutation whose axes left after the reduction keep their order is the same reduction of the rows as
gathered, over the permuted axes: the matchers read it so, the Transpose goes with the site."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip, itemsize, tensor_dtype


class Untransposed(NamedTuple):
    rows: Ref            # the rows before the transpose
    axes: np.ndarray     # the reduction's axes in them
    transposed: Ref      # the transpose's output (read by the reduction only, as the site's rows are)
    walk_from: Ref       # where the rows' walk starts: the reduction's input, or below the multiply
    multiply: Optional["AfterTranspose"] = None  # a multiplier applied after the transpose


class AfterTranspose(NamedTuple):
    """reduce(transpose(rows, [.., -1, -2]) * m, -1), m [..., 1, K] (or one value): the bag of the rows weighted
    by m read without axis -2, as m[..., 0, k] weighs position k of every feature (a scalar m: every position)."""
    product: Ref   # the Mul's output, read by the reduction
    weights: Ref   # m
    scalar: bool   # m is a scalar


def _through_casts(fg: FunctionGraph, x: Ref):
    """The producer below `x` past Casts (at most two; Keras mixed precision pools float16 rows in float32)
    and Identities, each read by the next step only: a cast of each entry commutes with the transpose."""
    producer, casts = fg.producer(x), 0
    while producer is not None and producer.op in ("Cast", "Identity") and casts < 2:
        below = fg.inputs(producer)[0]
        if len(fg.consumers(below)) != 1:
            return None
        casts += producer.op == "Cast"
        producer = fg.producer(below)
    return producer


def _multiplied(fg: FunctionGraph, x: Ref, rank: Optional[int]):
    """(the rows side, AfterTranspose) where `x` = Mul(y, m) or Mul(m, y) with y leading (past Casts) to a
    Transpose, read by the Mul only, and m of y's rank with axis -2 of size 1, or a scalar; else (x, None)."""
    node = fg.producer(x)
    if node is None or node.op != "Mul" or rank is None:
        return x, None
    for y, m in (fg.inputs(node), fg.inputs(node)[::-1]):
        below = _through_casts(fg, y)
        shape = fg.shape(m)
        if below is None or below.op != "Transpose" or len(fg.consumers(y)) != 1 or shape.rank is None:
            continue
        if shape.rank == 0 or (shape.rank == rank and shape[-2] == 1):
            return y, AfterTranspose(x, m, shape.rank == 0)
    return x, None


def untranspose(fg: FunctionGraph, node, x: Ref, axis_ref: Ref, leads_to_gather) -> Optional[Untransposed]:
    """The reduction `node` of `x` = Transpose(rows, perm) as a reduction of rows, or None where `x` is no
    such transpose, the axes or perm are not constant, keepdims keeps the unit axes in the transposed
    order, or the axes left are in another order than the rows' (their bag would be transposed too).
    A multiply after the transpose (_multiplied) only where perm swaps the last two axes, reduced over -1."""
    y, multiply = _multiplied(fg, x, fg.shape(x).rank)
    producer = _through_casts(fg, y)
    if producer is None or producer.op != "Transpose" or ("keep_dims" in node.attr and node.attr["keep_dims"].b):
        return None
    rows, perm_ref = fg.inputs(producer)
    perm, axes = fg.const_value(perm_ref), fg.const_value(axis_ref)
    rank = fg.shape(rows).rank
    if perm is None or axes is None or rank is None or not leads_to_gather(fg, rows):
        return None
    perm = [int(p) for p in np.reshape(perm, [-1])]
    reduced = {int(a) % rank for a in np.reshape(axes, [-1])}
    kept = [perm[i] for i in range(rank) if i not in reduced]
    if kept != sorted(kept) or (multiply is not None and (
            rank < 3 or perm != list(range(rank - 2)) + [rank - 1, rank - 2] or reduced != {rank - 1})):
        return None
    return Untransposed(rows, np.array(sorted(perm[a] for a in reduced), np.int64), Ref(producer.name, 0), y,
                        multiply)


def weigh_after_transpose(fg: FunctionGraph, rows, multiply: AfterTranspose, site, adds_unit_axis) -> None:
    """The multiply after the transpose as the rows' weights and their step nearest the reduction (`adds_unit_axis`:
    dense's, which imports this module); Skip where the rows were scaled below it too."""
    if rows.weights is not None or rows.factors or rows.ones is not None or rows.mask is not None:
        raise Skip("the gathered rows are weighted or masked both before and after the transpose to [..., D, K]: "
                   "not fused (weigh them once)")
    unit_row_of = None if multiply.scalar else _unit_row_of(fg, multiply.weights, adds_unit_axis)
    if unit_row_of is not None:  # w[:, None, :]: the op reads w, the slice left unused
        rows.weights, rows.weights_scalar, rows.weights_unit_row = unit_row_of, False, False
    else:
        rows.weights, rows.weights_scalar, rows.weights_unit_row = multiply.weights, multiply.scalar, not multiply.scalar
    site.weighted = True
    rows.nodes.insert(0, multiply.product.node)
    rows.private.insert(0, multiply.product)
    rows.itemsizes.insert(0, itemsize(tensor_dtype(fg, multiply.product)))
    rows.multiplied = [multiply.product]
    if rows.unflattened_rows is not None:
        rows.flat_from += 1


def _unit_row_of(fg: FunctionGraph, weights: Ref, adds_unit_axis) -> Optional[Ref]:
    """w where `weights` is w[..., None, :] (a StridedSlice adding axis -2 only: dense.adds_unit_axis), else None.
    The op then reads w as it reads w of rows * w[..., None]: left in the graph, a float16 or bfloat16 slice is
    no TFLite builtin."""
    node = fg.producer(weights)
    if node is None or node.op != "StridedSlice" or not adds_unit_axis(fg, node, fg.inputs(node), -2):
        return None
    return fg.inputs(node)[0]


def reduced_rows(fg: FunctionGraph, node, leads_to_gather):
    """(rows, axes, transposed) of a reduction `node`: its input and constant axes (None where not constant),
    or where the input is such a transpose (or casts of it), the rows before it, the axes in them and the
    Untransposed record."""
    x, axis_ref = fg.inputs(node)
    found = untranspose(fg, node, x, axis_ref, leads_to_gather)
    if found is None:
        return x, fg.const_value(axis_ref), None
    return found.rows, found.axes, found


def check_transposed_shape_unread(site, transposed_refs) -> None:
    """Skip where the model reads the transposed rows' shape: a Shape of the rows is rebuilt from the ids' as
    [..., K, D], which the transposed [..., D, K] (or a cast of it) is not."""
    if any(ref in transposed_refs for _, ref in site.shape_consumers):
        raise Skip("the shape of the transposed gathered rows is read (tf.shape(x)[-1] of [..., D, K], say): it is "
                   "not the rows' shape the fused site rebuilds, so the site stays composite")
