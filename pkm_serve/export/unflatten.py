"""Rows gathered on flattened ids and reshaped back: tf-models' OnDeviceEmbedding
gathers table[reshape(ids, [-1])] and reshapes the rows to ids.shape + [D],
which is table[ids]; rows of any ids reshaped to a constant T + [D] are table[reshape(ids, T)].
dense.resolve_rows takes that reshape as a step."""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.one_hot_lookup import flattened_one_hot_lookup, one_hot_lookup
from pkm_serve.export.sites import GATHER_OPS, NotASite, Site, Skip, same_dims, through_identity

WEIGHTED_BEFORE_RESHAPE = (
    "weights or a mask applied to the gathered rows before the reshape that groups them into bags (per row of "
    "the ids as gathered, not of the bags the fused op reads): not fused; apply them after the reshape "
    "(rows * w[..., None] of the [..., K, D] rows), which is fused")


def unflattened_ids(fg: FunctionGraph, ins: List[Ref]) -> Tuple[Ref, Optional[List[int]]]:
    """Reshape(table[reshape(ids, [-1])], shape(ids) + [D]) is table[ids]
    (tf-models' OnDeviceEmbedding): returns (ids, regroup). The target shape must be
    concat(Shape(ids), [D]) (regroup None), or a constant equal to ids' static shape
    + [D] with at most its first dim -1 (regroup: that constant less D). A server
    feeds ids of any shape ([7, 5] to a [None, 7] signature), and the constant then
    regroups them into other bags: the fused op must read reshape(ids, regroup),
    as the composite does. NotASite unless the rows are a gather of flattened ids;
    Skip where the reshape is not proven to undo the flattening."""
    flat_rows = through_identity(fg, ins[0], [])
    gather = fg.producer(flat_rows)
    gathered_ids = one_hot_lookup(fg, gather)  # tf.matmul(tf.one_hot(ids, N), table) is a gather too
    flat_one_hot = flattened_one_hot_lookup(fg, gather) if gathered_ids is None else None
    if flat_one_hot is not None:  # tf.tensordot(tf.one_hot(ids, N), table, 1): flattened one-hots of ids
        return _unflattened_one_hot_ids(fg, ins, flat_rows, *flat_one_hot)
    if gathered_ids is None and (gather is None or gather.op not in GATHER_OPS):
        return _regrouped_rows(fg, ins, flat_rows, None)  # cast rows, say: the gather's ids, once found
    gathered_ids = fg.inputs(gather)[1] if gathered_ids is None else gathered_ids
    flatten = fg.producer(through_identity(fg, gathered_ids, []))
    target = fg.const_value(fg.inputs(flatten)[1]) if flatten is not None and flatten.op == "Reshape" else None
    if target is None or np.ravel(target).tolist() != [-1]:
        return _regrouped_rows(fg, ins, flat_rows, gathered_ids)
    ids = through_identity(fg, fg.inputs(flatten)[0], [])
    width, ids_shape = fg.shape(flat_rows)[-1], fg.shape(ids)
    if width is None or ids_shape.rank is None or ids_shape.rank < 2:
        raise Skip("gathered rows of flattened ids are reshaped, but their width or the ids' rank is unknown")
    if _is_shape_plus_width(fg, ins[1], ids, width):
        return ids, None
    if _is_static_unflatten(fg, ins[1], ids_shape, width):
        return ids, [int(d) for d in np.ravel(fg.const_value(ins[1]))[:-1]]
    raise Skip("gathered rows of flattened ids are reshaped to a shape not proven to be the ids' shape + [D]")


def _unflattened_one_hot_ids(fg: FunctionGraph, ins: List[Ref], flat_rows: Ref, ids: Ref, steps: List[str]
                             ) -> Tuple[Ref, Optional[List[int]]]:
    """Rows of the one-hot of `ids` flattened to [M, N] (flattened_one_hot_lookup), reshaped to the ids' shape
    + [D]: tensordot's concat(gather(shape(one_hot), [0 .. r-2]), [D]), concat(shape(ids), [D]), or that
    shape as a constant (regroup as unflattened_ids')."""
    width, ids_shape = fg.shape(flat_rows)[-1], fg.shape(ids)
    if width is None or ids_shape.rank is None or ids_shape.rank < 2:
        raise Skip("rows of a flattened one-hot matmul are reshaped, but their width or the ids' rank is unknown")
    if _is_shape_plus_width(fg, ins[1], ids, width) or \
            _is_one_hot_shape_plus_width(fg, ins[1], Ref(steps[-1], 0), ids_shape.rank, width):
        return ids, None
    if _is_static_unflatten(fg, ins[1], ids_shape, width):
        return ids, [int(d) for d in np.ravel(fg.const_value(ins[1]))[:-1]]
    raise Skip("rows of a flattened one-hot matmul are reshaped to a shape not proven to be the ids' shape + [D]")


def _is_one_hot_shape_plus_width(fg: FunctionGraph, shape_ref: Ref, one_hot: Ref, ids_rank: int, width: int) -> bool:
    """concat(gather(Shape(one_hot), [0 .. ids_rank-1]), [width]): the one-hot's shape less N is the ids'."""
    concat = fg.producer(shape_ref)
    if concat is None or concat.op != "ConcatV2" or len(fg.inputs(concat)) != 3:
        return False
    head, tail, axis = fg.inputs(concat)
    gather = fg.producer(head)
    if gather is None or gather.op != "GatherV2" or fg.const_value(fg.inputs(gather)[2]) is None or \
            int(fg.const_value(fg.inputs(gather)[2])) != 0 or \
            ("batch_dims" in gather.attr and gather.attr["batch_dims"].i):
        return False
    kept, shape_of = fg.const_value(fg.inputs(gather)[1]), fg.producer(fg.inputs(gather)[0])
    tail_value, axis_value = fg.const_value(tail), fg.const_value(axis)
    return kept is not None and np.ravel(kept).tolist() == list(range(ids_rank)) and shape_of is not None and \
        shape_of.op == "Shape" and through_identity(fg, fg.inputs(shape_of)[0], []) == one_hot and \
        tail_value is not None and np.ravel(tail_value).tolist() == [width] and \
        axis_value is not None and int(axis_value) == 0


def _regrouped_rows(fg: FunctionGraph, ins: List[Ref], rows: Ref, gathered_ids) -> Tuple[Optional[Ref], List[int]]:
    """Reshape(table[ids], T + [D]) with a constant T (keras.ops.reshape(rows, [-1, D]) before a segment
    sum, [B, F * K, D] rows regrouped to [B, F, K, D]) is table[reshape(ids, T)]: each row stays whole
    when the last axis is D. Returns (ids, T), ids None where `rows` are not the gather's output (the gather
    below gives them); NotASite for any other reshape of the rows."""
    target, width = fg.const_value(ins[1]), fg.shape(rows)[-1]
    shaped_like = _shape_plus_width_of(fg, ins[1], width) if target is None and gathered_ids is None else None
    if shaped_like is not None:  # weighted flat rows reshaped to concat(shape(ids), [D]): checked at the gather
        return shaped_like, None
    if target is None or width is None or np.size(target) < 2:
        raise NotASite()
    target = [int(d) for d in np.ravel(target)]
    if target[-1] != width or target[:-1].count(-1) > 1 or any(d < -1 for d in target):
        raise NotASite()
    return None if gathered_ids is None else through_identity(fg, gathered_ids, []), target[:-1]


def _shape_plus_width_of(fg: FunctionGraph, shape_ref: Ref, width) -> Optional[Ref]:
    """x of concat(Shape(x), [width]), else None."""
    concat = fg.producer(shape_ref)
    if width is None or concat is None or concat.op != "ConcatV2" or len(fg.inputs(concat)) != 3:
        return None
    shape_of = fg.producer(fg.inputs(concat)[0])
    if shape_of is None or shape_of.op != "Shape":
        return None
    ids = through_identity(fg, fg.inputs(shape_of)[0], [])
    return ids if _is_shape_plus_width(fg, shape_ref, ids, width) else None


def check_flattened(fg: FunctionGraph, flat_ids: Ref, ids: Ref) -> None:
    """Skip unless the rows reshaped to ids' shape + [D] were gathered for reshape(ids, [-1])."""
    if through_identity(fg, flat_ids, []) == ids:  # table[ids] reshaped to its own shape
        return
    flatten = fg.producer(through_identity(fg, flat_ids, []))
    target = fg.const_value(fg.inputs(flatten)[1]) if flatten is not None and flatten.op == "Reshape" else None
    if target is None or np.ravel(target).tolist() != [-1] or through_identity(fg, fg.inputs(flatten)[0], []) != ids:
        raise Skip("gathered rows are reshaped to the shape of ids they were not gathered for (flattened)")


def _is_shape_plus_width(fg: FunctionGraph, shape_ref: Ref, ids: Ref, width: int) -> bool:
    concat = fg.producer(shape_ref)
    if concat is None or concat.op != "ConcatV2" or len(fg.inputs(concat)) != 3:
        return False
    head, tail, axis = fg.inputs(concat)
    shape_of = fg.producer(head)
    tail_value, axis_value = fg.const_value(tail), fg.const_value(axis)
    return shape_of is not None and shape_of.op == "Shape" and \
        through_identity(fg, fg.inputs(shape_of)[0], []) == ids and tail_value is not None and \
        np.ravel(tail_value).tolist() == [width] and axis_value is not None and int(axis_value) == 0


def _is_static_unflatten(fg: FunctionGraph, shape_ref: Ref, ids_shape, width: int) -> bool:
    target = fg.const_value(shape_ref)
    if target is None:
        return False
    target = np.ravel(target).tolist()
    dims = ids_shape.as_list()
    if len(target) != len(dims) + 1 or target[-1] != width or any(d is None for d in dims[1:]):
        return False
    return target[1:-1] == dims[1:] and (target[0] == dims[0] or (target[0] == -1 and -1 not in target[1:]))


def weights_per_flat_id(fg: FunctionGraph, rows, site: Site) -> Optional[Ref]:
    """reshape(table[flat ids] * w[:, None], T + [D]) with w one weight per flat id (reshape(w, [-1, 1])) is the
    bag of reshape(flat ids, T) weighted by reshape(w, T): fuse reshapes the weights as the composite's reshape
    groups the weighted rows. Only that one multiplier (no mask, other factor, multiply_no_nan or ones), shaped
    like the flat ids (reshape(ids, [-1]), or [-1, F * K] regrouped to [-1, F, K]). Returns the flat ids, else None."""
    if not rows.weighted_before_reshape or rows.weights is None or rows.weights_scalar or rows.mask is not None or \
            rows.factors or rows.ones is not None or site.no_nan_weights or rows.flat_ids is None or \
            rows.regathers or rows.weights_unit_row:
        return None
    shape = fg.shape(rows.weights)
    shape = shape[:-1] if rows.weights_squeeze and shape.rank else shape
    return rows.flat_ids if same_dims(shape, fg.shape(rows.flat_ids)) else None


def check_regroup_without_span(site: Site) -> None:
    """A span of positions (a partial running sum's ids[..., :j+1]) is taken of the ids as fed: of rows
    regrouped by a reshape it would be another span."""
    if site.regroup_ids is not None and site.positions is not None:
        raise Skip("positions of rows regrouped by a reshape: not fused")
