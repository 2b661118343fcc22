"""tf.where(mask, rows, zeros) whose zeros are shaped like another tensor: tf.zeros_like(other),
tf.zeros(tf.shape(other)), tf.zeros(shape) of a shape computed at run time.

The select broadcasts rows, mask and zeros together, so the bag is that of where(mask, ids, -1) broadcast
against the zeros' leading axes [..., K'] (a fill of the rows' own shape changes nothing; one larger
repeats rows, as the composite's select does). Where the static shapes prove the fill no larger than the
rows nothing is added; otherwise, before the rewrite, the ids are broadcast against zeros of the fill's
shape less its last axis (which must be 1 or the rows' D: the fill's row axis, which the bag does not
broadcast)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import Site, Skip, tensor_dtype

I32 = DType(types_pb2.DT_INT32)
_REASON = "tf.where fills masked rows with something other than a constant 0"


def zeros_like_another(fg: FunctionGraph, fill: Ref, rows_ref: Ref, nodes: List[str]
                       ) -> Optional[Tuple[Ref, bool]]:
    """For a fill of zeros shaped like a tensor other than the rows: None where its static shape proves it
    no larger than the rows, else (the tensor whose shape it has, or the shape vector itself: True).
    The fill's own nodes go into `nodes`. Skip where it is no such fill, or may broadcast the rows' D."""
    node = fg.producer(fill)
    if node is None:
        raise Skip(_REASON)
    ins = fg.inputs(node)
    if node.op == "ZerosLike":
        source = (ins[0], False)
    elif node.op == "Fill" and _is_zero(fg, ins[1]):
        shape_node = fg.producer(ins[0])
        source = (fg.inputs(shape_node)[0], False) if shape_node is not None and shape_node.op == "Shape" \
            else (ins[0], True)
    else:
        raise Skip(_REASON)
    nodes.append(node.name)
    fill_shape, rows_shape = fg.shape(fill), fg.shape(rows_ref)
    if fill_shape.rank is None or rows_shape.rank is None or fill_shape.rank > rows_shape.rank:
        raise Skip(f"{_REASON} of a shape that may give the rows more axes")
    if fill_shape.rank == 0:
        return None
    aligned = rows_shape.as_list()[rows_shape.rank - fill_shape.rank:]
    pairs = list(zip(fill_shape.as_list(), aligned))
    if all(f == 1 or (f is not None and f == r) for f, r in pairs):
        return None  # no larger than the rows: nothing to broadcast
    last, width = pairs[-1]
    if not (last == 1 or (last is not None and last == width)):
        raise Skip(f"{_REASON} whose last axis may broadcast the rows' width")
    return source


def _is_zero(fg: FunctionGraph, ref: Ref) -> bool:
    value = fg.const_value(ref)
    return value is not None and value.size > 0 and not np.any(value)


def broadcast_ids_like_fill(fg: FunctionGraph, site: Site) -> None:
    """Before fusing: site.indices broadcast against zeros of the fill's shape less its last axis."""
    if site.zero_fill is None:
        return
    source, is_shape = site.zero_fill
    prefix = site.root + "/pkm_fill_ids"
    shape = source if is_shape else fg.add_op(prefix + "/shape", "Shape", [source], {
        "T": DType(tensor_dtype(fg, source)), "out_type": I32}, shapes=[[None]])
    shape_type = tensor_dtype(fg, shape)

    def const(name, value):
        return fg.add_const(f"{prefix}/{name}", np.array(value, np.int32))
    leading = fg.add_op(prefix + "/leading", "StridedSlice", [shape, const("begin", [0]), const("end", [-1]),
                                                              const("strides", [1])],
                        {"T": DType(shape_type), "Index": I32, "begin_mask": 1, "end_mask": 0, "ellipsis_mask": 0,
                         "new_axis_mask": 0, "shrink_axis_mask": 0}, shapes=[[None]])
    zero = fg.add_const(prefix + "/zero", np.array(0, dtypes.as_dtype(site.index_dtype).as_numpy_dtype))
    zeros = fg.add_op(prefix + "/zeros", "Fill", [leading, zero], {"T": DType(site.index_dtype),
                                                                   "index_type": DType(shape_type)}, shapes=[None])
    site.indices = fg.add_op(prefix, "AddV2", [site.indices, zeros], {"T": DType(site.index_dtype)}, shapes=[None])
    site.zero_fill = None


def check_dense_bag(site: Site) -> None:
    """The ids broadcast like the fill only in a dense bag: a segment or ragged bag's row_splits count the
    values as they are."""
    if site.zero_fill is not None and (site.row_splits is not None or site.segment_ids is not None or
                                       site.sparse_indices is not None or site.regathers):
        raise Skip(f"{_REASON} whose shape may not be the rows': fused in a dense bag only")
