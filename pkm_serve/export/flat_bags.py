"""A bag over the ids' last n axes: reduce_sum / reduce_mean / reduce_max(rows, axis=[1, 2]) of rows
[B, F, K, D] (Keras GlobalAveragePooling2D of an Embedding of [B, H, W] ids) pools the F * K rows of
each ids[b] into one bag. Fused on the ids (and per-index weights or mask; ids and weights broadcast
against each other first, as the composite's product) reshaped to [B, F * K], the reshape's shape
read off the ids at run time, after an Assert that the ids have the rank the site was
matched at (a server may feed any shape: the composite would reduce other axes of another rank)."""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import I32, _assert, assert_ids_rank
from pkm_serve.export.sites import Site, tensor_dtype


def flatten_bag_axes(fg: FunctionGraph, site: Site) -> None:
    """Before fusing: site.indices (weights, mask) [..., a, .., k] -> [..., a * .. * k] over the last
    site.flatten_bag_axes axes."""
    prefix = site.root + "/pkm_flat_bag"
    check = assert_ids_rank(fg, site, site.indices)  # first: the checks below would fail on another rank
    if check is not None:
        site.indices = after(fg, prefix + "/ids_rank_checked", site.indices, check)
    if site.weights is not None and not site.weights_scalar:
        if check is not None:
            site.weights = after(fg, prefix + "/weights_rank_checked", site.weights, check)
        # rows * w[..., None] pairs ids and weights as broadcast (w [B, 1, K]), refusing shapes that do not
        # broadcast (w [B, K, F], [B, F * K]): so here, before each is flattened on its own.
        from pkm_serve.export.fuse import broadcast_against
        site.indices, site.weights = (broadcast_against(fg, prefix + "/ids", site.indices, site.weights),
                                      broadcast_against(fg, prefix + "/weights", site.weights, site.indices))
    site.indices = _flattened(fg, prefix + "/ids", site.indices, site.flatten_bag_axes, [])
    if site.weights is not None and not site.weights_scalar:
        site.weights = _flattened(fg, prefix + "/weights", site.weights, site.flatten_bag_axes, [])
    if site.mask is not None:
        if check is not None:
            site.mask = after(fg, prefix + "/mask_rank_checked", site.mask, check)
        site.mask = _flattened(fg, prefix + "/mask", site.mask, site.flatten_bag_axes, [])


def after(fg: FunctionGraph, name: str, ref: Ref, check: str) -> Ref:
    """`ref` once `check` passed."""
    shape = fg.shape(ref)
    return fg.add_op(name, "Identity", [ref], {"T": DType(tensor_dtype(fg, ref))},
                     shapes=[None if shape.rank is None else shape.as_list()], control=[check])


def assert_same_labelled_axes(fg: FunctionGraph, site: Site, prefix: str, axes: int) -> str:
    """An Assert that the weights' last `axes` axes are the ids': tf.einsum ('bk,bkd->bd') refuses a
    weights' unit axis that rows * w[..., None] (and the fused op's broadcast) would broadcast."""
    rank = fg.shape(site.indices).rank
    tail = np.zeros([rank], np.int32)
    tail[rank - axes:] = 1
    tail_ref = fg.add_const(prefix + "/tail", tail)

    def bag_axes(what, ref):
        shape = fg.add_op(f"{prefix}/{what}_shape", "Shape", [ref], {"T": DType(tensor_dtype(fg, ref)),
                                                                      "out_type": I32}, shapes=[[rank]])
        return shape, fg.add_op(f"{prefix}/{what}_axes", "Mul", [shape, tail_ref], {"T": I32}, shapes=[[rank]])
    weights_shape, weights_axes = bag_axes("weights", site.weights)
    equal = fg.add_op(prefix + "/equal", "Equal", [bag_axes("ids", site.indices)[1], weights_axes],
                      {"T": I32, "incompatible_shape_error": True}, shapes=[[rank]])
    ok = fg.add_op(prefix + "/all", "All", [equal, fg.add_const(prefix + "/axis", np.array([0], np.int32))],
                   {"Tidx": I32, "keep_dims": False}, shapes=[[]])
    return _assert(fg, prefix, ok, f"tf.einsum bag fused in {site.root}: the weights have shape",
                   (weights_shape, types_pb2.DT_INT32), f"but the original's einsum takes their last "
                   f"{axes} axes equal to the ids' (it broadcasts no labelled axis)", "/message_axes")


def _flattened(fg: FunctionGraph, name: str, ref: Ref, axes: int, control) -> Ref:
    dims = fg.shape(ref).as_list()
    rank, dtype = len(dims), DType(tensor_dtype(fg, ref))

    def const(suffix, value):
        return fg.add_const(f"{name}/{suffix}", np.array(value, np.int32))

    shape = fg.add_op(name + "/shape", "Shape", [ref], {"T": dtype, "out_type": I32}, shapes=[[rank]])
    lead = fg.add_op(name + "/lead", "StridedSlice", [shape, const("lead_begin", [0]),
                                                      const("lead_end", [rank - axes]), const("stride", [1])],
                     {"T": I32, "Index": I32, "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0,
                      "begin_mask": 1, "end_mask": 0}, shapes=[[rank - axes]])
    # The bag's size as prod(shape * tail + (1 - tail)), tail = [0, .., 1, 1]: the TFLite converter folds a
    # StridedSlice of a Shape to the declared F * K, and a resized input then fails at the Reshape.
    tail = np.zeros([rank], np.int32)
    tail[rank - axes:] = 1
    tail_dims = fg.add_op(name + "/tail_dims", "AddV2", [
        fg.add_op(name + "/tail_only", "Mul", [shape, const("tail", tail)], {"T": I32}, shapes=[[rank]]),
        const("ones_before_tail", 1 - tail)], {"T": I32}, shapes=[[rank]])
    size = fg.add_op(name + "/size", "Prod", [tail_dims, const("axis", [0])], {"T": I32, "Tidx": I32,
                                                                              "keep_dims": True}, shapes=[[1]])
    flat = fg.add_op(name + "/flat_shape", "ConcatV2", [lead, size, const("concat_axis", 0)],
                     {"T": I32, "N": 2, "Tidx": I32}, shapes=[[rank - axes + 1]])
    known = dims[rank - axes:]
    width = None if None in known else int(np.prod(known))
    return fg.add_op(name, "Reshape", [ref, flat], {"T": dtype, "Tshape": I32},
                     shapes=[dims[:rank - axes] + [width]], control=control)
