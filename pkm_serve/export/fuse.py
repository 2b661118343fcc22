"""Rewrites one matched site into PkmEmbeddingBag / PkmRaggedEmbeddingBag.

The node that ends the site keeps its name (so every consumer and the
function's outputs keep pointing at it): it becomes the fused op, or, when
the composite casts or divides after the bag, the last of those steps with
the fused op as a new node before it. Helpers are built only from ops that
TFLite has as builtins, so a fused model converts.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
from tensorflow.core.framework import attr_value_pb2, types_pb2
from tensorflow.python.framework import dtypes, op_def_registry

from pkm_serve.export import padded_ragged, sparse_matmul
from pkm_serve.export.empty_bags import empty_bags, neighbours, select_steps
from pkm_serve.export.masked_max import empty_axis_max_steps, masked_max_steps
from pkm_serve.export.nan_term import nan_term_steps
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import (assert_ids_in_table, assert_ids_rank, assert_masked_ids_below_rows,
                                        assert_table_rows, ids_below_rows)
from pkm_serve.export.segment_ids import with_room_for_bags, int32_segment_count, int32_segment_ids
from pkm_serve.export.sites import DENSE_OP, RAGGED_OP, Site, dims, tensor_dtype

I32 = DType(types_pb2.DT_INT32)
I64 = DType(types_pb2.DT_INT64)


def _op_attrs(op_name: str, typed_inputs: Dict[str, int], combiner: str,
              has_weights: bool) -> dict:
    """Attrs for the fused node, read off the registered OpDef so type-attr
    names follow the op library (T, Tindices, Tsplits...)."""
    op_def = op_def_registry.get(op_name)
    if op_def is None:
        raise RuntimeError(f"op {op_name} is not registered: load the pkm_serve op "
                           "library (pkm_serve.ops.load_library()) first")
    attrs = {}
    for arg in op_def.input_arg:
        if arg.type_attr and arg.name in typed_inputs:
            attrs[arg.type_attr] = DType(typed_inputs[arg.name])
    names = {a.name for a in op_def.attr}
    if "combiner" in names:
        attrs["combiner"] = combiner
    if "has_weights" in names:
        attrs["has_weights"] = has_weights
    missing = [a.name for a in op_def.attr if a.name not in attrs and
               not a.HasField("default_value")]
    if missing:
        raise RuntimeError(f"cannot set attrs {missing} of {op_name}")
    return attrs


def _input_names(op_name: str) -> List[str]:
    return [a.name for a in op_def_registry.get(op_name).input_arg]


def _root_shape(fg: FunctionGraph, site: Site):
    shape = fg.shape(Ref(site.root, 0))
    return [None if shape.rank is None else shape.as_list()]


def _bag_shape(fg: FunctionGraph, site: Site):
    """The bag's shape: the root's, less the unit axis a matmul site keeps."""
    shape = _root_shape(fg, site)
    if site.expand_bag_axis and shape[0] is not None:
        return [shape[0][:-1] if site.bag_unit_axis == -1 else shape[0][:-2 - site.extra_unit_axes] + shape[0][-1:]]
    return shape


def _cast(fg: FunctionGraph, name: str, ref: Ref, src: int, dst: int, shape) -> Ref:
    return fg.add_op(name, "Cast", [ref], {"SrcT": DType(src), "DstT": DType(dst),
                                           "Truncate": False}, shapes=[shape])


def _squeeze_last(fg: FunctionGraph, name: str, ref: Ref, dtype: int) -> Ref:
    """x[..., K, 1] -> x[..., K] as a Reshape to Shape(x)[:-1]: the TFLite
    converter folds a SQUEEZE after a softmax's TRANSPOSE into a TRANSPOSE
    whose permutation has more axes than its output, which LiteRT aborts on."""
    shape = fg.shape(ref)
    out_shape = None if shape.rank is None else shape.as_list()[:-1]
    if out_shape is not None and all(d is not None for d in out_shape):
        new_shape = fg.add_const(name + "/shape", np.array(out_shape, np.int32))
    else:
        full = fg.add_op(name + "/full_shape", "Shape", [ref], {"T": DType(dtype), "out_type": I32},
                         shapes=[[shape.rank]])
        const = lambda suffix, v: fg.add_const(f"{name}/{suffix}", np.array(v, np.int32))  # noqa: E731
        new_shape = fg.add_op(name + "/shape", "StridedSlice",
                              [full, const("begin", [0]), const("end", [-1]), const("strides", [1])],
                              {"T": I32, "Index": I32, "begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0,
                               "new_axis_mask": 0, "shrink_axis_mask": 0},
                              shapes=[[None if shape.rank is None else shape.rank - 1]])
    return fg.add_op(name, "Reshape", [ref, new_shape], {"T": DType(dtype), "Tshape": I32}, shapes=[out_shape])


def _regathered_ids(fg: FunctionGraph, site: Site) -> Ref:
    """ids[perm_inner]...[perm_outer]: the ids of rows that were re-gathered."""
    ids = site.indices
    for i, perm in enumerate(reversed(site.regathers)):
        axis = fg.add_const(f"{site.root}/pkm_regather_axis{i}", np.array(0, np.int32))
        ids = fg.add_op(f"{site.root}/pkm_regathered_ids{i}", "GatherV2", [ids, perm, axis],
                        {"Tparams": DType(site.index_dtype),
                         "Tindices": DType(tensor_dtype(fg, perm)), "Taxis": I32,
                         "batch_dims": 0}, shapes=[fg.shape(perm).as_list()
                                                   if fg.shape(perm).rank else None])
    return ids


def _regrouped_ids(fg: FunctionGraph, site: Site) -> Ref:
    """reshape(ids, regroup_ids): the bags the composite's constant reshape of its
    rows makes, whatever shape the server fed the ids in (the signature's K is
    not checked, so [7, 5] ids to a [-1, 7, D] reshape are 5 bags of 7). The
    shape is regroup_ids + min(size(ids), 0), a value grappler cannot read: it
    removes a Reshape to a constant the ids' declared shape already has."""
    prefix = site.root + "/pkm_regroup"
    size = fg.add_op(prefix + "/size", "Size", [site.indices], {"T": DType(site.index_dtype), "out_type": I32},
                     shapes=[[]])
    zero = fg.add_op(prefix + "/zero", "Minimum", [size, fg.add_const(prefix + "/floor", np.array(0, np.int32))],
                     {"T": I32}, shapes=[[]])
    target = fg.add_const(prefix + "/target", np.array(site.regroup_ids, np.int32))
    shape = fg.add_op(prefix + "/shape", "AddV2", [target, zero], {"T": I32}, shapes=[[len(site.regroup_ids)]])
    return fg.add_op(prefix + "/ids", "Reshape", [site.indices, shape],
                     {"T": DType(site.index_dtype), "Tshape": I32},
                     shapes=[[None if d == -1 else d for d in site.regroup_ids]])


def _weights_in_bags(fg: FunctionGraph, site: Site, weights: Ref) -> Ref:
    """Weights of the flattened ids (one per row before the reshape into bags), broadcast against them as the
    composite's product is, then shaped like the bags' ids (the rows' reshape)."""
    prefix = site.root + "/pkm_flat_weights"
    weights = broadcast_against(fg, prefix, weights, site.weights_per_flat_id)
    shape = fg.add_op(prefix + "/shape", "Shape", [site.indices], {"T": DType(site.index_dtype), "out_type": I32},
                      shapes=[[fg.shape(site.indices).rank]])
    return fg.add_op(prefix + "/bags", "Reshape", [weights, shape], {"T": DType(site.table_dtype), "Tshape": I32},
                     shapes=[dims(fg.shape(site.indices))])


def _rebuild_shape_consumers(fg: FunctionGraph, site: Site, gathered_ids: Ref, bag_ids: Ref) -> None:
    """Shape(rows) == concat(Shape(ids), [D]): rebuilt so the rows can go
    (from the ids as gathered, or as re-gathered, whichever rows it read;
    from the multiply on, the ids as broadcast against the multiplier)."""
    width = site.table_shape[1] if site.table_shape else None
    for name, rows_ref in dict.fromkeys(site.shape_consumers):
        if fg.nodes[name].op != "Shape":
            continue  # rebuilt already: its out_type attr is gone, rebuilding again would make it int32
        if rows_ref in site.multiplied_refs:
            ids = bag_ids
        else:
            ids = gathered_ids if rows_ref in site.gather_refs else site.indices
        node = fg.nodes[name]
        out_type = node.attr["out_type"].type if "out_type" in node.attr \
            else types_pb2.DT_INT32
        if width is None:
            raise RuntimeError(f"cannot rebuild {name}: the table width is unknown")
        ids_shape = fg.add_op(name + "/pkm_ids_shape", "Shape", [ids],
                              {"T": DType(site.index_dtype), "out_type": DType(out_type)},
                              shapes=[[None]])
        np_type = dtypes.as_dtype(out_type).as_numpy_dtype
        fg.replace_node(name, "ConcatV2", [
            ids_shape, fg.add_const(name + "/pkm_width", np.array([width], np_type)),
            fg.add_const(name + "/pkm_axis", np.array(0, np.int32))],
            {"N": 2, "T": DType(out_type), "Tidx": I32})


def _masked_indices(fg: FunctionGraph, site: Site) -> Ref:
    """tf.where(mask, rows, 0) == the bag of where(mask, ids, -1): masked
    entries become padding, which the op skips (and mean does not count)."""
    pad = fg.add_const(site.root + "/pkm_padding_id",
                       np.array(-1, dtypes.as_dtype(site.index_dtype).as_numpy_dtype))
    then_ref, else_ref = (site.indices, pad) if site.mask_keeps_true else (pad, site.indices)
    shape = fg.shape(site.indices)
    mask = site.mask
    if site.mask_squeeze:
        mask = _squeeze_last(fg, site.root + "/pkm_mask_squeezed", mask, types_pb2.DT_BOOL)
    return fg.add_op(site.root + "/pkm_masked_ids", "SelectV2",
                     [mask, then_ref, else_ref], {"T": DType(site.index_dtype)},
                     shapes=[None if shape.rank is None else shape.as_list()])


def fuse_site(fg: FunctionGraph, site: Site) -> None:
    """Replaces the site's root with the fused op (graph left for remove_dead)."""
    control = _site_control(fg, site)
    params = site.params
    reads = [n for n in site.internal if fg.nodes[n].op == "ResourceGather"]
    if site.params_is_resource:
        # The table read takes the gather's place in the chain of stateful ops
        # (tf.function orders them by control edges): same control inputs, and
        # what waited for the gather waits for the read. Giving the read every
        # control input of the site instead could close a cycle.
        read_control = sorted({c for n in reads for c in fg.control_inputs(fg.nodes[n])} -
                              set(site.internal))
        params = fg.add_op(site.root + "/pkm_params", "ReadVariableOp", [site.params],
                           {"dtype": DType(site.table_dtype)},
                           shapes=[site.table_shape], control=read_control)
    op, inputs, splits, checks = _bag_inputs(fg, site, params)
    if checks:
        control = sorted(set(control) | set(checks))
    types = [site.table_dtype, site.index_dtype] + (
        [types_pb2.DT_INT32] if splits is not None else []) + [site.table_dtype]
    attrs = _op_attrs(op, dict(zip(_input_names(op), types)), site.combiner,
                      site.weights is not None or site.pooled is not None)
    steps = _steps_after_bag(fg, site, params, splits, inputs[1])
    if not steps:
        fg.replace_node(site.root, op, inputs, attrs, control=control)
    else:
        ref = fg.add_op(site.root + "/pkm_bag", op, inputs, attrs,
                        shapes=_bag_shape(fg, site), control=control)
        for i, (step, step_attrs, step_inputs) in enumerate(steps):
            if i == len(steps) - 1:
                fg.replace_node(site.root, step, step_inputs(ref), step_attrs)
            else:
                ref = fg.add_op(f"{site.root}/pkm_{step.lower()}", step, step_inputs(ref), step_attrs,
                                shapes=[None] if site.extra_unit_axes else _bag_shape(fg, site) if site.expand_bag_axis
                                else _root_shape(fg, site))
    for name in site.internal:
        fg.redirect_control(name, params.node if site.params_is_resource and name in reads
                            else site.root)


def _site_control(fg: FunctionGraph, site: Site) -> List[str]:
    """Control inputs of the site's nodes from outside it: the fused op keeps them."""
    control = set()
    for name in site.internal:
        control.update(fg.control_inputs(fg.nodes[name]))
    control.update(fg.control_inputs(fg.nodes[site.root]))
    control -= set(site.internal) | {site.root}
    return sorted(control)


def _bag_inputs(fg: FunctionGraph, site: Site, params: Ref):
    """(op, inputs, row_splits or None, names of the Asserts the op waits for)."""
    if site.pooled is not None:
        return site.pooled.bag_inputs(fg, site, params)
    weights = site.weights
    if weights is None:
        weights = fg.add_const(site.root + "/pkm_no_weights", np.zeros(
            [0], dtypes.as_dtype(site.table_dtype).as_numpy_dtype))
    else:
        w_dtype = tensor_dtype(fg, weights)
        if w_dtype != site.table_dtype:  # mixed precision: weights in the compute dtype
            w_shape = fg.shape(weights)
            weights = _cast(fg, site.root + "/pkm_weights", weights, w_dtype,
                            site.table_dtype, None if w_shape.rank is None
                            else w_shape.as_list())
        if site.weights_squeeze:
            weights = _squeeze_last(fg, site.root + "/pkm_weights_squeezed", weights,
                                    site.table_dtype)
        if site.weights_scalar:  # [1, .., 1] -> []; broadcast to the ids below
            weights = fg.add_op(site.root + "/pkm_scalar_weight", "Reshape",
                                [weights, fg.add_const(site.root + "/pkm_scalar_shape", np.zeros([0], np.int32))],
                                {"T": DType(site.table_dtype), "Tshape": I32}, shapes=[[]])
    if site.regroup_ids is not None:
        site.indices = _regrouped_ids(fg, site)
    if site.weights_per_flat_id is not None:
        weights = _weights_in_bags(fg, site, weights)
    weights, columns_check = sparse_matmul.sorted_columns_and_weights(fg, site, weights, params) \
        if site.ids_are_sparse_columns else (weights, None)  # sparse_dense_matmul: ids are sp's columns
    if site.sparse_any_order:  # SparseBincount: ids are sp's values, its entries in any row order
        weights, columns_check = sparse_matmul.values_in_row_order(fg, site, weights)
    gathered_ids = site.indices
    pruned = site.sparse_indices is not None and not site.ids_are_sparse_columns  # safe_ drops negative ids
    ids_check = None if pruned or site.negative_ids_padding else \
        assert_ids_in_table(fg, site, gathered_ids)
    bound_check = assert_masked_ids_below_rows(fg, site, gathered_ids, params) or \
        assert_table_rows(fg, site, params)  # a masked site is no counts site: at most one of the two
    site.indices = _regathered_ids(fg, site)
    indices = _masked_indices(fg, site) if site.mask is not None else site.indices
    if site.ids_past_rows_padding:  # counted ids: an id >= N counts nowhere, as padding
        indices = ids_below_rows(fg, site, indices, params)
    if site.weights is not None:
        indices, weights = _broadcast_ids_and_weights(fg, site, indices, weights)
    elif site.ones is not None:
        indices = _broadcast_ids_like_ones(fg, site, indices)
    _rebuild_shape_consumers(fg, site, gathered_ids, indices)
    if site.segment_ids is None and site.sparse_indices is None and site.row_splits is None:
        return DENSE_OP, [params, indices, weights], None, _checks(ids_check, bound_check,
                                                                   assert_ids_rank(fg, site, gathered_ids))
    if site.row_splits is not None:
        splits = site.row_splits
        if tensor_dtype(fg, splits) != types_pb2.DT_INT32:
            splits = _cast(fg, site.root + "/pkm_row_splits32", splits,
                           tensor_dtype(fg, splits), types_pb2.DT_INT32, [None])
        return RAGGED_OP, [params, indices, splits, weights], splits, _checks(ids_check, bound_check)
    splits, sorted_check = row_splits(fg, site)
    return RAGGED_OP, [params, indices, splits, weights], splits, _checks(ids_check, bound_check, sorted_check,
                                                                          columns_check)


def _checks(*names: Optional[str]) -> List[str]:
    return [n for n in names if n is not None]


def broadcast_against(fg: FunctionGraph, name: str, x: Ref, other: Ref) -> Ref:
    """x + zeros shaped like `other`: x broadcast against it. An elementwise add
    fails with a message where the two do not broadcast (TFLite's
    BROADCAST_ARGS aborts the process there); adding 0 changes no id and no
    weight (but -0.0, which becomes 0.0). Half weights are broadcast in
    float32 (exact both ways): TFLite has no float16/bfloat16 ADD or ZEROS_LIKE."""
    x_type, other_type = tensor_dtype(fg, x), tensor_dtype(fg, other)
    x_shape, other_shape = fg.shape(x), fg.shape(other)
    if x_type in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):
        wide = _cast(fg, name + "_wide", x, x_type, types_pb2.DT_FLOAT, dims(x_shape))
        wide = broadcast_against(fg, name + "_wide", wide, other)
        return _cast(fg, name + "_broadcast", wide, types_pb2.DT_FLOAT, x_type, dims(fg.shape(wide)))
    other_dims = other_shape.as_list() if other_shape.rank is not None else None
    zeros = fg.add_op(name + "_zeros", "ZerosLike", [_cast(fg, name + "_cast", other, other_type, x_type, other_dims)],
                      {"T": DType(x_type)}, shapes=[other_dims])
    rank = x_shape.rank if x_shape.rank is not None else other_shape.rank
    if x_shape.rank is not None and other_shape.rank is not None:
        rank = max(x_shape.rank, other_shape.rank)  # a scalar weight takes the ids' rank
    return fg.add_op(name + "_broadcast", "AddV2", [x, zeros], {"T": DType(x_type)},
                     shapes=[[None] * rank if rank is not None else None])


def _broadcast_ids_and_weights(fg: FunctionGraph, site: Site, indices: Ref, weights: Ref):
    """The composite's rows * w[..., None] broadcasts ids against weights (per-bag
    weights [B, 1], one row of ids for every bag, one scale [1] for every sparse
    id); the op takes equal shapes. Where the static shapes do not prove them
    equal, both are broadcast to their common shape at run time."""
    ids_shape, w_shape = fg.shape(indices), fg.shape(weights)
    if ids_shape.is_fully_defined() and w_shape.is_fully_defined() and ids_shape == w_shape:
        return indices, weights
    return (broadcast_against(fg, site.root + "/pkm_ids", indices, weights),
            broadcast_against(fg, site.root + "/pkm_weights", weights, indices))


def _broadcast_ids_like_ones(fg: FunctionGraph, site: Site, indices: Ref) -> Ref:
    """rows * ones: where the ones' shape may be larger than the ids', the
    product repeats rows; the same bag is that of the ids broadcast against
    the ones."""
    ones = site.ones
    if site.ones_squeeze:
        ones = _squeeze_last(fg, site.root + "/pkm_ones_squeezed", ones, tensor_dtype(fg, ones))
    return broadcast_against(fg, site.root + "/pkm_ids", indices, ones)


def _bag_size(fg: FunctionGraph, site: Site, indices: Ref, dtype: int) -> Ref:
    """K of the request per bag ([..., 1], in `dtype`): the length of the last
    axis of the op's ids (as broadcast against the weights or mask, i.e. the
    bag axis of the rows Mean reduced), counted as the sum of ones shaped like
    them. Not StridedSlice(Shape(ids)): the TFLite converter folds that to the
    K the signature declares, and a resized input then divides by it."""
    prefix = site.root + "/pkm_bag_size"
    shape = fg.add_op(prefix + "/ids_shape", "Shape", [indices],
                      {"T": DType(site.index_dtype), "out_type": I32}, shapes=[[None]])
    ones = fg.add_op(prefix + "/ones", "Fill", [shape, fg.add_const(prefix + "/one", np.array(1, np.float32))],
                     {"T": DType(types_pb2.DT_FLOAT), "index_type": I32}, shapes=[None])
    k = fg.add_op(prefix + "/k", "Sum", [ones, fg.add_const(prefix + "/axis", np.array(-1, np.int32))],
                  {"T": DType(types_pb2.DT_FLOAT), "Tidx": I32, "keep_dims": True}, shapes=[None])
    return k if dtype == types_pb2.DT_FLOAT else _cast(fg, prefix, k, types_pb2.DT_FLOAT, dtype, None)


def _divide_by_bag_size(fg: FunctionGraph, site: Site, indices: Ref, out_dtype: int):
    """Steps dividing the bag by the request's K. A half bag is divided in float32
    and cast back (the quotient TF's half RealDiv rounds too): TFLite has no
    float16 / bfloat16 DIV, so the half division kept a .tflite from converting."""
    if out_dtype not in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):
        k = _bag_size(fg, site, indices, out_dtype)
        return [("RealDiv", {"T": DType(out_dtype)}, lambda bag: [bag, k])]
    k = _bag_size(fg, site, indices, types_pb2.DT_FLOAT)
    return [("Cast", {"SrcT": DType(out_dtype), "DstT": DType(types_pb2.DT_FLOAT), "Truncate": False},
             lambda bag: [bag]),
            ("RealDiv", {"T": DType(types_pb2.DT_FLOAT)}, lambda bag: [bag, k]),
            ("Cast", {"SrcT": DType(types_pb2.DT_FLOAT), "DstT": DType(out_dtype), "Truncate": False},
             lambda bag: [bag])]


def _steps_after_bag(fg: FunctionGraph, site: Site, params: Ref, splits: Optional[Ref],
                     indices: Ref):
    """What the composite does after the bag, as [(op, attrs, inputs(bag))]:
    cast it, divide it by K (the request's, as Mean does), or give empty bags
    table[default_id] (safe_) or the lowest value (ragged reduce_max)."""
    steps = masked_max_steps(fg, site) if site.max_fill is not None else []
    out_dtype = site.table_dtype
    fixed_k = fg.shape(indices)[-1] if fg.shape(indices).rank else None
    if site.empty_axis_max and site.max_fill is None and not fixed_k:  # K open or 0: a request may have no entries
        steps += empty_axis_max_steps(fg, site, _bag_size(fg, site, indices, types_pb2.DT_FLOAT))
    if site.nan_term is not None:  # NaN where the composite's dropped rows times inf are (dropped_nan.py)
        steps += nan_term_steps(site, out_dtype)
    if site.cast_enum:
        steps.append(("Cast", {"SrcT": DType(out_dtype), "DstT": DType(site.cast_enum),
                               "Truncate": False}, lambda bag: [bag]))
        out_dtype = site.cast_enum
    if site.divide_by_bag:
        steps += _divide_by_bag_size(fg, site, indices, out_dtype)
    if site.divide_by_longest_bag:
        steps += padded_ragged.longest_bag_division(fg, site, splits, out_dtype)
    if site.default_id is not None:
        # safe_ with default_id: an empty bag is table[default_id] (weight 1).
        default_row = fg.add_op(
            site.root + "/pkm_default_row", "GatherV2",
            [params, fg.add_const(site.root + "/pkm_default_id",
                                  np.array([site.default_id], np.int32)),
             fg.add_const(site.root + "/pkm_axis0", np.array(0, np.int32))],
            {"Tparams": DType(site.table_dtype), "Tindices": I32, "Taxis": I32,
             "batch_dims": 0}, shapes=[[1, site.table_shape[1]]])
        steps += select_steps(fg, site.root + "/pkm_default_row", empty_bags(fg, site, splits), default_row,
                              site.table_dtype)
    if site.expand_bag_axis:
        unit_axis = fg.add_const(site.root + "/pkm_unit_axis", np.array(site.bag_unit_axis, np.int32))
        steps += [("ExpandDims", {"T": DType(out_dtype), "Tdim": I32}, lambda bag: [bag, unit_axis])] * (
            1 + site.extra_unit_axes)
    if site.empty_bag_lowest:
        out_type = dtypes.as_dtype(out_dtype)
        lowest = fg.add_const(site.root + "/pkm_empty_max",
                              np.array(out_type.min, out_type.as_numpy_dtype))
        empty_rows = empty_bags(fg, site, splits) if site.empty_bags is None else site.empty_bags
        steps += select_steps(fg, site.root + "/pkm_empty_max", empty_rows, lowest, out_dtype)
    return steps


def row_splits(fg: FunctionGraph, site: Site):
    """int32 row_splits [rows + 1] from the bag id of each value (sorted, as
    in every SparseTensor): counts by UnsortedSegmentSum, then a cumulative
    sum. rows is dense_shape[0] for safe_ sites and last id + 1 otherwise (as
    the segment ops of embedding_lookup_sparse produce). int32 limits a
    request to 2^31 - 1 ids, far above what fits in one batch.
    Returns (row_splits, name of the Assert that the ids are sorted)."""
    prefix = site.root + "/pkm_row_splits"
    axis0 = fg.add_const(prefix + "/axis0", np.array(0, np.int32))
    if site.sparse_indices is not None:
        rows_of_ids = _sparse_column(fg, prefix + "/ids_row", site.sparse_indices, 0)
        seg = _cast(fg, prefix + "/ids_row32", rows_of_ids, types_pb2.DT_INT64,
                    types_pb2.DT_INT32, [None])
        first = fg.add_op(prefix + "/rows64", "GatherV2", [site.dense_shape, axis0, axis0],
                          {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                          shapes=[[]])
        num_rows = _with_room(fg, site, int32_segment_count(fg, first, prefix + "/rows",
                                                           "the SparseTensor's dense_shape[0]"), prefix)
    else:
        seg = int32_segment_ids(fg, site.segment_ids, prefix + "/ids")
        num_rows = _segment_count(fg, site, prefix, seg)
    sorted_check = _assert_sorted(fg, prefix, seg, f"{site.pattern} in {site.root}")
    seg_shape = fg.add_op(prefix + "/ids_shape", "Shape", [seg],
                          {"T": I32, "out_type": I32}, shapes=[[1]])
    one_each = fg.add_const(prefix + "/one_each", np.array(1, np.int32))
    ones = fg.add_op(prefix + "/ones", "Fill", [seg_shape, one_each],
                     {"T": I32, "index_type": I32}, shapes=[[None]])
    counts = fg.add_op(prefix + "/counts", "UnsortedSegmentSum", [ones, seg, num_rows],
                       {"T": I32, "Tindices": I32, "Tnumsegments": I32}, shapes=[[None]])
    ends = fg.add_op(prefix + "/ends", "Cumsum", [counts, axis0],
                     {"T": I32, "Tidx": I32, "exclusive": False, "reverse": False},
                     shapes=[[None]])
    zero = fg.add_const(prefix + "/zero", np.array([0], np.int32))
    splits = fg.add_op(prefix, "ConcatV2", [zero, ends, axis0],
                       {"N": 2, "T": I32, "Tidx": I32}, shapes=[[None]])
    return splits, sorted_check


def _segment_count(fg: FunctionGraph, site: Site, prefix: str, seg: Ref) -> Ref:
    """int32 bags: num_segments where the segment op takes it, else last id + 1."""
    if site.num_segments is not None:
        return _with_room(fg, site, int32_segment_count(fg, site.num_segments, prefix + "/rows"), prefix)
    axis0 = fg.add_const(prefix + "/rows_axis0", np.array(0, np.int32))
    minus_one = fg.add_const(prefix + "/minus_one", np.array([-1], np.int32))
    padded = fg.add_op(prefix + "/padded", "ConcatV2", [seg, minus_one, axis0],
                       {"N": 2, "T": I32, "Tidx": I32}, shapes=[[None]])
    last = fg.add_op(prefix + "/last", "Max", [padded, axis0],
                     {"T": I32, "Tidx": I32, "keep_dims": False}, shapes=[[]])
    one = fg.add_const(prefix + "/one", np.array(1, np.int32))
    return _with_room(fg, site, fg.add_op(prefix + "/rows", "AddV2", [last, one], {"T": I32}, shapes=[[]]), prefix)


def _with_room(fg: FunctionGraph, site: Site, count: Ref, prefix: str) -> Ref:
    width = site.table_shape[1] if site.table_shape and len(site.table_shape) == 2 else None
    return with_room_for_bags(fg, count, prefix + "/rows_room", width, site.table_dtype)


def _sparse_column(fg: FunctionGraph, name: str, sparse_indices: Ref, column: int) -> Ref:
    """sparse_indices[:, column] (int64 [nnz]): a value's row (0) or column (1)."""
    return fg.add_op(name, "GatherV2", [sparse_indices, fg.add_const(name + "/column", np.array(column, np.int32)),
                                        fg.add_const(name + "/axis1", np.array(1, np.int32))],
                     {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[None]])


def _assert_sorted(fg: FunctionGraph, prefix: str, seg: Ref, site_name: str) -> str:
    """An Assert that the row ids are >= 0 and non-decreasing, which the
    segment ops of the composite require ("segment ids must be >= 0", "are not
    increasing") and the counts above assume: 0 put before them makes one check
    of both. Returns its name (a control input of the fused op). The TFLite
    converter drops Asserts: there the order is the caller's duty."""
    zero = fg.add_const(prefix + "/sorted/zero", np.array([0], np.int32))
    axis = fg.add_const(prefix + "/sorted/axis", np.array(0, np.int32))
    from_zero = fg.add_op(prefix + "/sorted/from_zero", "ConcatV2", [zero, seg, axis],
                          {"N": 2, "T": I32, "Tidx": I32}, shapes=[[None]])
    later, earlier = neighbours(fg, prefix + "/sorted", from_zero)
    ordered = fg.add_op(prefix + "/sorted/pairs", "GreaterEqual", [later, earlier],
                        {"T": I32}, shapes=[[None]])
    all_ordered = fg.add_op(prefix + "/sorted/all", "All", [ordered, axis],
                            {"Tidx": I32, "keep_dims": False}, shapes=[[]])
    message = fg.add_const(prefix + "/sorted/message", np.array(
        f"PkmRaggedEmbeddingBag (fused {site_name}): the sparse ids' row indices must be >= 0 and sorted "
        "(canonical SparseTensor order; tf.sparse.reorder sorts them)".encode()))
    check = fg.add_op(prefix + "/sorted", "Assert", [all_ordered, message],
                      {"T": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                          type=[types_pb2.DT_STRING])), "summarize": 3})
    return check.node
