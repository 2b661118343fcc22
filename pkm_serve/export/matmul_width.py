"""A fused matmul bag (`w[..., None, :] @ rows`, `v[None, None, :] @ rows`, `rows^T @ w[..., None]`, any
`[..., 1, K]` weights) refuses what the composite's matmul refuses: it contracts the weights' K with the
ids' K and broadcasts neither, where the op's ids and weights are broadcast against each other (weights
fed [B, 1], or ids of one position against K weights, would be answered). So an Assert that the two K are
equal runs before the op (the TFLite converter drops it, as every Assert)."""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.flat_bags import after
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import _assert
from pkm_serve.export.sites import Site, tensor_dtype

I32 = DType(types_pb2.DT_INT32)


def assert_matmul_widths(fg: FunctionGraph, site: Site) -> None:
    """Before fusing a matmul site: site.weights wait for an Assert that their last axis is the ids'."""
    if site.pattern != "matmul" or site.weights is None or site.weights_scalar:
        return
    prefix = site.root + "/pkm_matmul_width_check"

    def width(what: str, ref: Ref, axis: int) -> Ref:
        shape = fg.add_op(f"{prefix}/{what}_shape", "Shape", [ref], {"T": DType(tensor_dtype(fg, ref)),
                                                                      "out_type": I32}, shapes=[[None]])
        return fg.add_op(f"{prefix}/{what}_width", "StridedSlice", [shape] + [
            fg.add_const(f"{prefix}/{what}_{name}", np.array([value], np.int32))
            for name, value in (("begin", axis), ("end", axis + 1), ("strides", 1))],
            {"T": I32, "Index": I32, "begin_mask": 0, "end_mask": 1 if axis == -1 else 0, "ellipsis_mask": 0,
             "new_axis_mask": 0, "shrink_axis_mask": 0}, shapes=[[1]])
    # weights [..., K, 1] (w[..., None] with adjoint_a, rows^T @ w[..., None]) are squeezed later
    weights_width = width("weights", site.weights, -2 if site.weights_squeeze else -1)
    ids_width = width("ids", site.indices, -1)
    same = fg.add_op(prefix + "/same", "Equal", [weights_width, ids_width],
                     {"T": I32, "incompatible_shape_error": True}, shapes=[[1]])
    ok = fg.add_op(prefix + "/all", "All", [same, fg.add_const(prefix + "/axis", np.array([0], np.int32))],
                   {"Tidx": I32, "keep_dims": False}, shapes=[[]])
    both = fg.add_op(prefix + "/widths", "ConcatV2", [weights_width, ids_width, fg.add_const(
        prefix + "/concat_axis", np.array(0, np.int32))], {"N": 2, "T": I32, "Tidx": I32}, shapes=[[2]])
    check = _assert(fg, prefix, ok, f"tf.matmul bag fused in {site.root}: the weights and the ids have",
                    (both, types_pb2.DT_INT32), "positions, but the original's matmul contracts the two and "
                    "broadcasts neither: they must be equal", "/message_widths")
    site.weights = after(fg, prefix + "/weights", site.weights, check)
