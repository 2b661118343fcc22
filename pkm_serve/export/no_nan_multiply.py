"""tf.math.multiply_no_nan(rows, w) on the way from the gather to a bag reduction: rows * w, but 0 wherever w is 0,
whatever the row (an inf or NaN table entry included), where the op's w * row would be NaN. Fused as the multiply
with the ids whose w is 0 made padding (-1, a mask: no_nan_padding.py): the op leaves them out of the sum, as
their 0 adds nothing to the composite's, and a weighted mean's or sqrtn's sum of weights gains nothing from them
either. A multiplier or divisor applied after it that may be inf or NaN (0 * inf) or 0 (0 / 0) would make the
composite's entry NaN there, where padding leaves it out: such sites are reported."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Site, Skip
from pkm_serve.export.position_slices import attr_value

_INT_TYPES = (types_pb2.DT_BOOL, types_pb2.DT_INT8, types_pb2.DT_UINT8, types_pb2.DT_INT16, types_pb2.DT_INT32,
              types_pb2.DT_INT64)


_NO_NAN_CALLS = {"MulNoNan": "tf.math.multiply_no_nan(rows, w)", "DivNoNan": "tf.math.divide_no_nan(rows, d)"}


def multiply_op(fg: FunctionGraph, node, ins: List[Ref], leads_to_gather, rows=None) -> str:
    """The op as a multiply of the rows reads it: tf.math.multiply_no_nan(rows, w) is "Mul" (its zeros are kept
    by note_zero_weights). multiply_no_nan(w, rows) is 0 wherever a row entry is 0, also for an inf or NaN
    weight: not a multiply. tf.math.divide_no_nan(rows, d) is "RealDiv", 0 wherever d is 0 (its zeros kept
    alike). `rows` (dense.Rows): the steps found after it, checked (check_steps_after)."""
    if node.op not in ("MulNoNan", "DivNoNan"):
        return node.op
    rows_side = _rows_side(fg, ins, leads_to_gather)
    if rows_side == 0:
        if rows is not None:
            check_steps_after(fg, rows, _NO_NAN_CALLS[node.op])
        return "Mul" if node.op == "MulNoNan" else "RealDiv"
    if node.op == "DivNoNan":
        return node.op  # divide_no_nan(w, rows): no scaling of the rows
    if rows_side == 1:
        raise Skip("tf.math.multiply_no_nan(w, rows) (the rows second): 0 wherever a row entry is 0, even for "
                   "an inf or NaN weight, which the op's w * row is not; multiply_no_nan(rows, w) is fused")
    return node.op


def _rows_side(fg: FunctionGraph, ins: List[Ref], leads_to_gather) -> Optional[int]:
    """Which input is the gathered rows: the one leading to a gather; of two (ragged broadcasting re-gathers
    the weights too), the one whose last axis is not the weights' 1."""
    sides = [i for i in (0, 1) if leads_to_gather(fg, ins[i])]
    if len(sides) == 2:
        widths = [fg.shape(r)[-1] if fg.shape(r).rank else None for r in ins]
        sides = [i for i in sides if widths[1 - i] == 1 and widths[i] != 1]
    return sides[0] if len(sides) == 1 else None


def _finite(fg: FunctionGraph, ref: Ref, nonzero: bool) -> bool:
    """A constant of finite values (none 0 where `nonzero`), a cast of integers or booleans (not where `nonzero`:
    a cast mask may be 0), or the length of an axis (tf.cast(tf.shape(ids)[-1]): 0 only where no entry is)."""
    if _axis_length(fg, ref):
        return True
    value = fg.const_value(ref)
    if value is not None:
        value = value.astype(np.float64)
        return bool(np.all(np.isfinite(value)) and (not nonzero or np.all(value != 0)))
    node = fg.producer(ref)
    return not nonzero and node is not None and node.op == "Cast" and node.attr["SrcT"].type in _INT_TYPES


def _axis_length(fg: FunctionGraph, ref: Ref) -> bool:
    node = fg.producer(ref)
    while node is not None and node.op in ("Cast", "Identity"):
        node = fg.producer(fg.inputs(node)[0])
    if node is None or node.op != "StridedSlice" or not attr_value(node, "shrink_axis_mask", "i"):
        return False
    source = fg.producer(fg.inputs(node)[0])
    return source is not None and source.op == "Shape"


def check_steps_after(fg: FunctionGraph, rows, call: str = _NO_NAN_CALLS["MulNoNan"]) -> None:
    """Skip where multiply_no_nan(rows, w) is then multiplied by a tensor that may be inf or NaN, or divided by
    one that may be 0 (found before it, walking down from the reduction): the composite's 0 * inf or 0 / 0 is
    NaN where the fused op leaves the padded entry out."""
    later = [("mul", rows.weights)] if rows.weights is not None else []
    later += [(f.kind, f.ref) for f in rows.factors if f.ref is not None]
    for kind, ref in later:
        if not _finite(fg, ref, kind == "div"):
            raise Skip(f"{call} then {'divided' if kind == 'div' else 'multiplied'} by "
                       f"{fg.render(ref)}, which may be {'0' if kind == 'div' else 'inf or NaN'}: the composite's "
                       f"{'0 / 0' if kind == 'div' else '0 * inf'} is NaN where {call[-2]} is 0, and the fused op "
                       "leaves that entry out (the *_no_nan step last, or by a constant, is fused)")


def note_zero_weights(node, rows, site: Site, weights_before: Optional[Ref], factors_before: int) -> None:
    """After a multiply_no_nan(rows, w) (or divide_no_nan(rows, d)) step: w (d) as the resolve recorded it (the
    weights, or a factor), noted on the site; its zeros become padding when fused
    (no_nan_padding.zero_weights_as_padding)."""
    if node.op not in _NO_NAN_CALLS:
        return
    if rows.weights is not None and rows.weights is not weights_before:
        noted = (rows.weights, rows.weights_squeeze, rows.weights_scalar)
    elif len(rows.factors) > factors_before and rows.factors[-1].ref is not None:
        factor = rows.factors[-1]
        noted = (factor.ref, factor.squeeze, factor.scalar)
    else:
        return  # a multiply by ones: never 0
    site.no_nan_weights = site.no_nan_weights + (noted,)


def check_no_nan_site(site: Site) -> None:
    """The zero weights' padding is a mask over the ids as matched; a site that reads a span of positions (a
    partial running sum, tf.math.cumsum(rows)[:, j]) slices the ids and weights, not such a mask: reported."""
    if site.no_nan_weights and site.positions is not None:
        raise Skip("tf.math.multiply_no_nan(rows, w) read at some positions only (a partial running sum): 0 where "
                   "w is 0 even for an inf or NaN row, which the fused op's w * row is not: not fused")
