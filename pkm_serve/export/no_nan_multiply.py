"""tf.math.multiply_no_nan(rows, w) on the way from the gather to a bag reduction, read as a multiply."""
from __future__ import annotations

from typing import List

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip


def multiply_op(fg: FunctionGraph, node, ins: List[Ref], leads_to_gather) -> str:
    """The op as a multiply of the rows reads it: tf.math.multiply_no_nan(rows, w) is rows * w, which differs
    only where w is 0 and a table entry is inf or NaN (0 there, inf * 0 or NaN * 0 in the fused op).
    multiply_no_nan(w, rows) is 0 wherever a row entry is 0, also for an inf or NaN weight: not a multiply."""
    if node.op != "MulNoNan":
        return node.op
    if leads_to_gather(fg, ins[0]) and not leads_to_gather(fg, ins[1]):
        return "Mul"
    if leads_to_gather(fg, ins[1]):
        raise Skip("tf.math.multiply_no_nan(w, rows) (the rows second): 0 wherever a row entry is 0, even for "
                   "an inf or NaN weight, which the op's w * row is not; multiply_no_nan(rows, w) is fused")
    return node.op
