"""A row the composite drops is a zero it still multiplies: tf.where(mask, rows, 0) * w, or a one-hot lookup's
zero row (an id outside [0, N)) times w. Where such a multiplier is inf or NaN the composite's 0 * inf is NaN
and so is its bag; the fused op skips the dropped position and its bag is finite. A weighted one-hot count,
reduce_sum(one_hot(ids, N) * w[..., None], 1) @ table, multiplies every w by the one-hot's N - 1 zeros: one inf
or NaN w anywhere makes every entry of the bag NaN.

Fused with a per-bag term added to the op's bag before any step after it: the sum over the dropped (or, for
the counts, all) positions of 0 * m for each multiplier m after the drop (divide_no_nan(0, d) for a divisor d):
NaN exactly where the composite's bag is, 0 elsewhere. It costs a few elementwise ops on [..., K], none on the
[..., K, D] rows. Segment bags (segment_sum, unsorted_segment_sum of one row per id) sum it by the root's own
segment ids. A form the term cannot be shaped for (rows re-gathered by ragged broadcasting, sparse bags, a span
of positions, regrouped ids) is reported."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.fuse import _cast, _squeeze_last
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.no_nan_multiply import _finite
from pkm_serve.export.sites import Site, Skip, dims, tensor_dtype


_HALF = (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)


def _hazards(fg: FunctionGraph, site: Site) -> list:
    """(kind, ref, squeeze, scalar, after_mask) of each multiplier or divisor that scales a dropped row's zeros
    and may make them NaN (not a finite constant, a cast of integers, an axis length). A one-hot lookup's
    multiplier before a tf.where mask scales the zero rows of ids outside [0, N) that the mask keeps only."""
    one_hot = site.negative_ids_padding  # set for one_hot lookups and counts only (bincount refuses negative ids)
    if site.mask is None and not one_hot:
        return []
    found = []  # the last item: the tf.where mask (if any) came before the multiplier, dropping its rows' zeros
    after_mask = site.mask is None or site.weights_after_mask
    if site.weights is not None and (one_hot or after_mask):
        found.append(("mul", site.weights, site.weights_squeeze, site.weights_scalar, after_mask))
    for factor in site.weight_factors:
        after_mask = site.mask is None or factor.after_mask
        if factor.ref is not None and (one_hot or after_mask):
            found.append((factor.kind, factor.ref, factor.squeeze, factor.scalar, after_mask))
    # 0 / d is NaN for a NaN d only: a d that may be 0 is refused before (scales.check_factors) or is
    # divide_no_nan's, whose 0 / 0 is 0
    return [h for h in found if not _finite(fg, h[1], False)]


def check_dropped_rows(fg: FunctionGraph, site: Site) -> None:
    """Notes the hazards on the site; Skip where the per-bag term cannot be built for the site's form."""
    site.drop_hazards = tuple(_hazards(fg, site))
    if not site.drop_hazards:
        return
    ragged = site.segment_ids is not None or site.sparse_indices is not None or site.row_splits is not None
    if ragged and _segment_root(fg, site) is not None and site.sparse_indices is None and not site.segments_counted:
        ragged = False  # the term is summed per bag by the root's own segment ids (_per_segment)
    if ragged or site.positions is not None or site.regroup_ids is not None or \
            site.weights_per_flat_id is not None or site.pooled is not None or site.regathers or \
            site.zero_fill is not None or site.ones is not None or site.weights_unit_row or site.weights_to_vector:
        what = "a one-hot lookup's zero rows" if site.negative_ids_padding else "rows a tf.where mask drops"
        raise Skip(f"{what} then multiplied by {fg.render(site.drop_hazards[0][1])}, which may be inf or NaN: "
                   "the composite's 0 * inf makes the bag NaN where the fused op skips the dropped row, and this "
                   "form's bag is not the last axes of dense ids: not fused")


def _as_per_index(fg: FunctionGraph, prefix: str, ref: Ref, squeeze: bool, scalar: bool, dtype: int) -> Ref:
    if squeeze:
        return _squeeze_last(fg, prefix + "/squeezed", ref, dtype)
    if scalar:
        return fg.add_op(prefix + "/scalar", "Reshape", [ref, fg.add_const(prefix + "/scalar_shape", np.zeros(
            [0], np.int32))], {"T": DType(dtype), "Tshape": DType(types_pb2.DT_INT32)}, shapes=[[]])
    return ref


def _dropped(fg: FunctionGraph, site: Site, prefix: str):
    """(bool [..., K] or None) x 2: the positions the tf.where mask drops, the one-hot lookup's ids outside
    [0, N) (both padding in the fused op); (None, None) for a weighted one-hot count, whose every position
    multiplies zeros."""
    if site.weights_on_one_hot and site.table_shape and site.table_shape[0] != 1:
        return None, None
    masked = outside = None
    if site.mask is not None:
        mask = _squeeze_last(fg, prefix + "/mask", site.mask, types_pb2.DT_BOOL) if site.mask_squeeze else site.mask
        masked = fg.add_op(prefix + "/masked", "LogicalNot", [mask], {}, shapes=[None]) \
            if site.mask_keeps_true else mask
    if site.negative_ids_padding:
        ids, index_type = site.indices, tensor_dtype(fg, site.indices)
        np_type = np.int64 if index_type == types_pb2.DT_INT64 else np.int32
        attrs = {"T": DType(index_type)}
        below = fg.add_op(prefix + "/below", "Less", [ids, fg.add_const(prefix + "/zero_id", np.array(0, np_type))],
                          attrs, shapes=[None])
        past = fg.add_op(prefix + "/past", "GreaterEqual", [ids, fg.add_const(
            prefix + "/rows", np.array(site.table_shape[0], np_type))], attrs, shapes=[None])
        outside = fg.add_op(prefix + "/outside", "LogicalOr", [below, past], {}, shapes=[None])
    return masked, outside


def _combined(fg: FunctionGraph, name: str, op: str, attrs: dict, a: Optional[Ref], b: Optional[Ref]) -> Ref:
    """op(a, b), or whichever of them is not None."""
    return b if a is None else a if b is None else fg.add_op(name, op, [a, b], attrs, shapes=[None])


def _zero_times(fg: FunctionGraph, prefix: str, hazards: list, out: int) -> Optional[Ref]:
    """The sum of 0 * m (0 / d) over `hazards`, per index, in `out`; None for none."""
    zeros = None
    for i, (kind, ref, squeeze, scalar, _) in enumerate(hazards):
        dtype = tensor_dtype(fg, ref)
        ref = _as_per_index(fg, f"{prefix}/m{i}", ref, squeeze, scalar, dtype)
        if dtype in _HALF:  # TFLite has no float16 / bfloat16 MUL: 0 * m in float32 (a cast keeps inf and NaN)
            ref, dtype = _cast(fg, f"{prefix}/m{i}_float", ref, dtype, types_pb2.DT_FLOAT, None), types_pb2.DT_FLOAT
        zero = fg.add_const(f"{prefix}/zero{i}", np.array(0, _np_float(dtype)))
        zero_times = fg.add_op(f"{prefix}/times{i}", "Mul" if kind == "mul" else "DivNoNan",
                               [ref, zero] if kind == "mul" else [zero, ref], {"T": DType(dtype)}, shapes=[None])
        if dtype != out:
            zero_times = _cast(fg, f"{prefix}/cast{i}", zero_times, dtype, out, None)
        zeros = zero_times if zeros is None else fg.add_op(f"{prefix}/add{i}", "AddV2", [zeros, zero_times],
                                                           {"T": DType(out)}, shapes=[None])
    return zeros


def build_nan_term(fg: FunctionGraph, site: Site) -> None:
    """Before fusing (the mask and weights as matched): site.nan_term, [..., 1] in the table's dtype (float32 for
    a float16 / bfloat16 table: fuse.py adds it to the bag in float32)."""
    if not site.drop_hazards:
        return
    prefix = site.root + "/pkm_dropped_nan"
    out = types_pb2.DT_FLOAT if site.table_dtype in _HALF else site.table_dtype  # no half SELECT / SUM in TFLite
    after = _zero_times(fg, prefix + "/after", [h for h in site.drop_hazards if h[4]], out)
    before = _zero_times(fg, prefix + "/before", [h for h in site.drop_hazards if not h[4]], out)
    masked, outside = _dropped(fg, site, prefix)
    add = {"T": DType(out)}
    if masked is None and outside is None:  # every position: broadcast a shared or per-bag multiplier to the ids
        zeros = fg.add_op(prefix + "/at_ids", "AddV2", [_combined(fg, prefix + "/both", "AddV2", add, after, before),
                                                        _zeros_like_ids(fg, site, prefix, out)], add, shapes=[None])
    else:
        none = fg.add_const(prefix + "/kept", np.array(0, _np_float(out)))
        if after is not None:  # a mask before the multiplier drops its zeros too
            dropped = _combined(fg, prefix + "/dropped", "LogicalOr", {}, masked, outside)
            after = fg.add_op(prefix + "/at_dropped", "SelectV2", [dropped, after, none], add, shapes=[None])
        if before is not None:  # a mask after it drops the NaN (one-hot lookups only: outside is set)
            kept = outside if masked is None else fg.add_op(prefix + "/outside_kept", "LogicalAnd", [
                outside, fg.add_op(prefix + "/mask_keeps", "LogicalNot", [masked], {}, shapes=[None])], {},
                shapes=[None])
            before = fg.add_op(prefix + "/at_outside", "SelectV2", [kept, before, none], add, shapes=[None])
        zeros = _combined(fg, prefix + "/sum", "AddV2", add, after, before)
    segments = _segment_root(fg, site)
    if segments is not None:
        per_bag = _per_segment(fg, prefix, zeros, segments, out)
    else:
        per_bag = _per_dense_bag(fg, site, prefix, zeros, out)
    site.nan_term = fg.add_op(prefix + "/per_bag_column", "ExpandDims", [per_bag, fg.add_const(
        prefix + "/column_axis", np.array(-1, np.int32))], {"T": DType(out), "Tdim": DType(types_pb2.DT_INT32)},
        shapes=[None])


_SORTED_SEGMENT_OPS = ("SegmentSum", "SegmentMean", "SegmentSqrtN")


def _segment_root(fg: FunctionGraph, site: Site):
    """The root of a ragged or segment site reducing one row per id by segment ids (tf.math.segment_sum,
    unsorted_segment_sum, a RaggedTensor's reduce_sum / reduce_mean): the node, else None."""
    node = fg.nodes.get(site.root)
    if node is None or node.op not in _SORTED_SEGMENT_OPS + ("UnsortedSegmentSum",):
        return None
    return node


def _per_segment(fg: FunctionGraph, prefix: str, zeros: Ref, root, out: int) -> Ref:
    """The per-id zeros summed into the root's bags by its own segment ids (and number of segments)."""
    ins = fg.inputs(root)
    ids_type = tensor_dtype(fg, ins[1])
    if root.op in _SORTED_SEGMENT_OPS:
        return fg.add_op(prefix + "/per_bag", "SegmentSum", [zeros, ins[1]], {
            "T": DType(out), "Tindices": DType(ids_type)}, shapes=[None])
    return fg.add_op(prefix + "/per_bag", "UnsortedSegmentSum", [zeros, ins[1], ins[2]], {
        "T": DType(out), "Tindices": DType(ids_type), "Tnumsegments": DType(tensor_dtype(fg, ins[2]))},
        shapes=[None])


def _per_dense_bag(fg: FunctionGraph, site: Site, prefix: str, zeros: Ref, out: int) -> Ref:
    bag_axes = np.arange(-site.flatten_bag_axes, 0, dtype=np.int32)  # the ids' last axes: one bag (flat_bags.py)
    return fg.add_op(prefix + "/per_bag", "Sum", [zeros, fg.add_const(prefix + "/bag_axes", bag_axes)], {
        "T": DType(out), "Tidx": DType(types_pb2.DT_INT32), "keep_dims": False}, shapes=[None])


def _zeros_like_ids(fg: FunctionGraph, site: Site, prefix: str, dtype: int) -> Ref:
    ids = fg.add_op(prefix + "/ids", "Cast", [site.indices], {"SrcT": DType(tensor_dtype(fg, site.indices)),
                                                               "DstT": DType(dtype), "Truncate": False}, shapes=[None])
    return fg.add_op(prefix + "/zeros", "ZerosLike", [ids], {"T": DType(dtype)}, shapes=[dims(fg.shape(site.indices))])


def _np_float(dtype: int):
    return dtypes.as_dtype(dtype).as_numpy_dtype
