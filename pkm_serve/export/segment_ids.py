"""int64 segment ids narrowed to the int32 the fused ops and their counting take, without wrapping."""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import tensor_dtype

I32 = DType(types_pb2.DT_INT32)


def int32_segment_ids(fg: FunctionGraph, seg: Ref, prefix: str) -> Ref:
    """int64 segment ids as int32, clamped to [-1, 2**31 - 1] first: a cast alone wraps (-2**32 + 1, which
    the composite drops, would be 1), and an id past int32 is >= any num_segments, refused as it stays."""
    seg_type = tensor_dtype(fg, seg)
    if seg_type == types_pb2.DT_INT32:
        return seg
    numpy_type = np.int64 if seg_type == types_pb2.DT_INT64 else np.int32
    for op, bound in (("Maximum", -1), ("Minimum", np.iinfo(np.int32).max)):
        seg = fg.add_op(f"{prefix}/seg_{op.lower()}", op, [seg, fg.add_const(
            f"{prefix}/seg_{op.lower()}_bound", np.array(bound, numpy_type))], {"T": DType(seg_type)},
            shapes=[[None]])
    return fg.add_op(prefix + "/seg32", "Cast", [seg], {"SrcT": DType(seg_type), "DstT": I32, "Truncate": False},
                     shapes=[[None]])
