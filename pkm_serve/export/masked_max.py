"""reduce_max(tf.where(mask[..., None], rows, c), axis=-2) of gathered rows with a constant fill c: -inf (the
masked max users write), the dtype's lowest value, 0, or tf.fill(tf.shape(rows), c).

The composite's bag is the max of the kept rows and, where the bag has a masked entry, of c; a bag of no
entry (K = 0) is -inf. Fused as the op's max of the kept ids (masked ids become padding, which the max skips;
an empty bag is 0 there), then Maximum(bag, c) where the bag has a masked entry, and c (or -inf) where it
keeps none: the same value for every row, NaN included (a kept NaN row stays NaN through Maximum).
An unmasked reduce_max gets -inf too where a request's K is 0 (empty_axis_max_steps)."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import Site, Skip, tensor_dtype

I32 = DType(types_pb2.DT_INT32)
_FLOATS = (types_pb2.DT_FLOAT,)


def constant_fill(fg: FunctionGraph, fill: Ref, rows_ref: Ref, nodes: List[str]) -> Optional[Ref]:
    """The scalar a max's tf.where fills masked rows with: a constant of one value for every row, or
    tf.fill(tf.shape(rows), c) (its Fill and Shape go into `nodes`); None for any other fill."""
    value = fg.const_value(fill)
    shape, rows_shape = fg.shape(fill), fg.shape(rows_ref)
    if value is not None and value.size == 1 and shape.rank is not None and rows_shape.rank is not None and \
            shape.rank <= rows_shape.rank:
        return fill
    node = fg.producer(fill)
    if node is None or node.op != "Fill":
        return None
    shape_ref, scalar = fg.inputs(node)
    shape_node = fg.producer(shape_ref)
    scalar_value = fg.const_value(scalar)
    if shape_node is None or shape_node.op != "Shape" or fg.inputs(shape_node)[0] != rows_ref or \
            scalar_value is None or scalar_value.size != 1:
        return None
    nodes.extend((node.name, shape_node.name))
    return scalar


def check_masked_max(site: Site, dense: bool) -> None:
    """A masked max with a constant fill is fused in a dense bag of float rows as gathered."""
    if site.max_fill is None:
        return
    if not dense or site.flatten_bag_axes > 1 or site.regroup_ids is not None or site.zero_fill is not None:
        raise Skip("max of rows masked with a constant fill: fused over one bag axis of a dense gather only")
    if site.cast_enum or site.rounded_to or site.table_dtype not in _FLOATS:
        raise Skip("max of rows masked with a constant fill: fused for float32 rows not cast only")


def masked_max_steps(fg: FunctionGraph, site: Site):
    """[(op, attrs, inputs(bag))]: the fused max of the kept rows made the composite's (module docstring):
    Maximum(bag, f) then SelectV2(any kept, that, f), f = c where the bag has a masked entry, else -inf."""
    prefix = site.root + "/pkm_masked_max"
    dtype = DType(site.table_dtype)
    # A [..., K, 1] mask: reduced over K without keepdims; a [..., K] one: over K with keepdims ([..., 1]).
    axis = fg.add_const(prefix + "/bag_axis", np.array(-2 if site.mask_squeeze else -1, np.int32))
    dropped = fg.add_op(prefix + "/dropped", "LogicalNot", [site.mask], {}, shapes=[None])
    kept = site.mask
    if not site.mask_keeps_true:
        kept, dropped = dropped, kept

    def any_of(name: str, ref: Ref) -> Ref:
        return fg.add_op(f"{prefix}/{name}", "Any", [ref, axis], {"Tidx": I32, "keep_dims": not site.mask_squeeze},
                         shapes=[None])
    any_kept, any_dropped = any_of("any_kept", kept), any_of("any_dropped", dropped)
    minus_inf = _run_time_minus_inf(fg, prefix, any_dropped, site.table_dtype)
    fill_value = fg.const_value(site.max_fill)
    if fill_value is not None and np.all(np.isneginf(fill_value)):
        fill = minus_inf  # not the constant: TFLite would read it as the lowest finite value
    else:
        fill = fg.add_op(prefix + "/fill", "Cast", [site.max_fill], {
            "SrcT": DType(tensor_dtype(fg, site.max_fill)), "DstT": dtype, "Truncate": False}, shapes=[None])
        fill = fg.add_op(prefix + "/fill_scalar", "Reshape", [fill, fg.add_const(prefix + "/scalar", np.array(
            [], np.int32))], {"T": dtype, "Tshape": I32}, shapes=[[]])
    floor = fg.add_op(prefix + "/floor", "SelectV2", [any_dropped, fill, minus_inf], {"T": dtype}, shapes=[None])
    return [("Maximum", {"T": dtype}, lambda bag: [bag, floor]),
            ("SelectV2", {"T": dtype}, lambda bag: [any_kept, bag, floor])]


def empty_axis_max_steps(fg: FunctionGraph, site: Site, k: Ref):
    """[(op, attrs, inputs(bag))] for an unmasked reduce_max over a bag axis that a request may give length 0
    (`k`: its length per bag, float32 [..., 1]): -inf there, the reduction's identity, where the op gives an
    empty bag 0. A half bag is selected in float32 and cast back (TFLite's SELECT_V2 takes no halves)."""
    prefix = site.root + "/pkm_empty_axis_max"
    no_entries = fg.add_op(prefix + "/no_entries", "Equal", [k, fg.add_const(prefix + "/zero", np.float32(0))],
                           {"T": DType(types_pb2.DT_FLOAT), "incompatible_shape_error": True}, shapes=[None])
    minus_inf = _run_time_minus_inf(fg, prefix, no_entries, types_pb2.DT_FLOAT)
    select = ("SelectV2", {"T": DType(types_pb2.DT_FLOAT)}, lambda bag: [no_entries, minus_inf, bag])
    if site.table_dtype == types_pb2.DT_FLOAT:
        return [select]
    half, wide = DType(site.table_dtype), DType(types_pb2.DT_FLOAT)
    return [("Cast", {"SrcT": half, "DstT": wide, "Truncate": False}, lambda bag: [bag]), select,
            ("Cast", {"SrcT": wide, "DstT": half, "Truncate": False}, lambda bag: [bag])]


def _run_time_minus_inf(fg: FunctionGraph, prefix: str, like: Ref, table_dtype: int) -> Ref:
    """-inf shaped like the bool `like`, computed at run time (-1 / 0): the TFLite converter writes a -inf
    constant as the dtype's lowest finite value (-3.4e38), which the composite's bag of no kept row is not."""
    dtype = DType(table_dtype)
    not_like = fg.add_op(prefix + "/not_like", "LogicalNot", [like], {}, shapes=[None])
    never = fg.add_op(prefix + "/never", "LogicalAnd", [like, not_like], {}, shapes=[None])
    zero = fg.add_op(prefix + "/zero", "Cast", [never], {"SrcT": DType(types_pb2.DT_BOOL), "DstT": dtype,
                                                         "Truncate": False}, shapes=[None])
    minus_one = fg.add_const(prefix + "/minus_one", np.array(-1, dtypes.as_dtype(table_dtype).as_numpy_dtype))
    return fg.add_op(prefix + "/minus_inf", "RealDiv", [minus_one, zero], {"T": dtype}, shapes=[None])
