"""tf.math.multiply_no_nan(rows, w) on the way from the gather to a bag reduction, read as a multiply."""
from __future__ import annotations

from typing import List, Optional

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip


def multiply_op(fg: FunctionGraph, node, ins: List[Ref], leads_to_gather) -> str:
    """The op as a multiply of the rows reads it: tf.math.multiply_no_nan(rows, w) is rows * w, which differs
    only where w is 0 and a table entry is inf or NaN (0 there, inf * 0 or NaN * 0 in the fused op).
    multiply_no_nan(w, rows) is 0 wherever a row entry is 0, also for an inf or NaN weight: not a multiply."""
    if node.op != "MulNoNan":
        return node.op
    rows_side = _rows_side(fg, ins, leads_to_gather)
    if rows_side == 0:
        return "Mul"
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
