"""A bag over the ids' last n axes: reduce_sum / reduce_mean / reduce_max(rows, axis=[1, 2]) of rows
[B, F, K, D] (Keras GlobalAveragePooling2D of an Embedding of [B, H, W] ids) pools the F * K rows of
each ids[b] into one bag. Fused on the ids (and per-index weights or mask) reshaped to [B, F * K], the
reshape's shape read off the ids at run time, after an Assert that the ids have the rank the site was
matched at (a server may feed any shape: the composite would reduce other axes of another rank)."""
from __future__ import annotations

import numpy as np

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import I32, assert_ids_rank
from pkm_serve.export.sites import Site, tensor_dtype


def flatten_bag_axes(fg: FunctionGraph, site: Site) -> None:
    """Before fusing: site.indices (weights, mask) [..., a, .., k] -> [..., a * .. * k] over the last
    site.flatten_bag_axes axes."""
    prefix = site.root + "/pkm_flat_bag"
    check = assert_ids_rank(fg, site, site.indices)
    control = [] if check is None else [check]
    site.indices = _flattened(fg, prefix + "/ids", site.indices, site.flatten_bag_axes, control)
    if site.weights is not None and not site.weights_scalar:
        site.weights = _flattened(fg, prefix + "/weights", site.weights, site.flatten_bag_axes, control)
    if site.mask is not None:
        site.mask = _flattened(fg, prefix + "/mask", site.mask, site.flatten_bag_axes, control)


def _flattened(fg: FunctionGraph, name: str, ref: Ref, axes: int, control) -> Ref:
    dims = fg.shape(ref).as_list()
    rank, dtype = len(dims), DType(tensor_dtype(fg, ref))

    def const(suffix, value):
        return fg.add_const(f"{name}/{suffix}", np.array(value, np.int32))

    shape = fg.add_op(name + "/shape", "Shape", [ref], {"T": dtype, "out_type": I32}, shapes=[[rank]])
    slice_attrs = {"T": I32, "Index": I32, "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}
    lead = fg.add_op(name + "/lead", "StridedSlice", [shape, const("lead_begin", [0]),
                                                      const("lead_end", [rank - axes]), const("stride", [1])],
                     dict(slice_attrs, begin_mask=1, end_mask=0), shapes=[[rank - axes]])
    tail = fg.add_op(name + "/tail", "StridedSlice", [shape, const("tail_begin", [rank - axes]),
                                                      const("tail_end", [rank]), const("tail_stride", [1])],
                     dict(slice_attrs, begin_mask=0, end_mask=1), shapes=[[axes]])
    size = fg.add_op(name + "/size", "Prod", [tail, const("axis", [0])], {"T": I32, "Tidx": I32, "keep_dims": True},
                     shapes=[[1]])
    flat = fg.add_op(name + "/flat_shape", "ConcatV2", [lead, size, const("concat_axis", 0)],
                     {"T": I32, "N": 2, "Tidx": I32}, shapes=[[rank - axes + 1]])
    known = dims[rank - axes:]
    width = None if None in known else int(np.prod(known))
    return fg.add_op(name, "Reshape", [ref, flat], {"T": dtype, "Tshape": I32},
                     shapes=[dims[:rank - axes] + [width]], control=control)
