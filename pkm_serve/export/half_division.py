"""A fused masked mean's mask count and division, moved from half precision to
float32 (Keras 3 mixed precision: Embedding(mask_zero=True) ->
GlobalAveragePooling1D sums the rows and the mask cast to float16/bfloat16,
then divides in that dtype). TFLite has no float16/bfloat16 SUM or DIV, so
those two kept a fused model from converting. The count of a boolean mask is
exact in float32 (in half precision it is exact up to 2048 / 256); the bag is
divided in float32 and cast back, the quotient TF's half RealDiv rounds too
(as fuse._divide_by_bag_size does for a weighted mean's K)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.sites import Site

HALF = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
F32 = DType(types_pb2.DT_FLOAT)
_DIVISIONS = ("RealDiv", "DivNoNan")
_PASS = ("Identity", "ExpandDims", "Reshape")  # between the mask's Sum and the division


def _half_division(fg: FunctionGraph, site: Site):
    """The half division node whose numerator is the fused bag, if it is the
    bag's only consumer."""
    consumers = fg.consumers(Ref(site.root, 0))
    if len(consumers) != 1 or consumers[0][1] != 0:
        return None
    node = fg.nodes[consumers[0][0]]
    if node.op not in _DIVISIONS or "T" not in node.attr or node.attr["T"].type not in HALF:
        return None
    return node


def _mask_count(fg: FunctionGraph, divisor: Ref) -> Optional[Tuple[list, object, Ref]]:
    """([pass nodes, division side first], the Sum, the boolean mask it counts)
    where the divisor is Sum(Cast(bool mask)) through reshapes; None otherwise."""
    passes = []
    node = fg.producer(divisor)
    while node is not None and node.op in _PASS:
        passes.append(node)
        node = fg.producer(fg.inputs(node)[0])
    if node is None or node.op != "Sum":
        return None
    cast = fg.producer(fg.inputs(node)[0])
    if cast is None or cast.op != "Cast" or "SrcT" not in cast.attr or \
            cast.attr["SrcT"].type != types_pb2.DT_BOOL:
        return None
    return passes, node, fg.inputs(cast)[0]


def widen_masked_mean_division(fg: FunctionGraph, site: Site) -> List[str]:
    """Rewrites bag / Sum(Cast(mask, half)) of a fused masked mean as
    Cast(Cast(bag, f32) / Sum(Cast(mask, f32)), half), keeping the division's
    name. Returns the old count's nodes (for remove_dead); [] where the site
    is not such a mean."""
    if site.computes != "masked mean":
        return []
    division = _half_division(fg, site)
    if division is None:
        return []
    bag_ref, divisor = fg.inputs(division)
    found = _mask_count(fg, divisor)
    if found is None:
        return []
    passes, total, mask = found
    half = division.attr["T"].type
    prefix = division.name + "/pkm_f32"
    count = fg.add_op(prefix + "/mask", "Cast", [mask],
                      {"SrcT": DType(types_pb2.DT_BOOL), "DstT": F32, "Truncate": False},
                      shapes=[None])
    # Attrs left out of the NodeDef (their defaults) stay out: reading a missing
    # key of the proto map would add an empty AttrValue, which the graph refuses.
    sum_attrs = {k: total.attr[k] for k in ("Tidx", "keep_dims") if k in total.attr}
    count = fg.add_op(prefix + "/count", "Sum", [count, fg.inputs(total)[1]], dict(sum_attrs, T=F32),
                      shapes=[None])
    for node in reversed(passes):
        attrs = {k: v for k, v in node.attr.items() if not k.startswith("_")}
        attrs["T"] = F32
        count = fg.add_op(f"{prefix}/{node.op.lower()}", node.op, [count] + fg.inputs(node)[1:], attrs,
                          shapes=[None])
    bag = fg.add_op(prefix + "/bag", "Cast", [bag_ref],
                    {"SrcT": DType(half), "DstT": F32, "Truncate": False}, shapes=[None])
    quotient = fg.add_op(prefix + "/quotient", division.op, [bag, count], {"T": F32}, shapes=[None])
    control = [t[1:] for t in division.input if t.startswith("^")]
    fg.replace_node(division.name, "Cast", [quotient],
                    {"SrcT": F32, "DstT": DType(half), "Truncate": False}, control=control)
    return [divisor.node]
