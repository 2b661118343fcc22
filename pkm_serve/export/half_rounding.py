"""Keras mixed precision's rows rounded to float16/bfloat16 and cast back to float32 before the reduction."""
from __future__ import annotations

from tensorflow.core.framework import types_pb2

from pkm_serve.export.sites import TABLE_DTYPES


def rounds_to_half(fg, node, ins, rows, leads_to_gather) -> bool:
    """A second Cast below the outer one (rows.cast_enum) that rounds the rows to
    float16/bfloat16 on their way to it (Cast(Cast(rows, half), float32)):
    skipping it changes the bag by at most that dtype's rounding, within the
    tolerance the export verifies it with (Site.rounded_to). A float16 row value past
    65504 is inf in the composite and finite in the fused op (docs/export.md)."""
    return bool(rows.cast_enum) and not rows.rounded_enum and \
        node.attr["DstT"].type in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16) and \
        node.attr["SrcT"].type in TABLE_DTYPES and leads_to_gather(fg, ins[0])
