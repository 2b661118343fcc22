"""Whether a dense site's multipliers and mask are per index of the ids the fused op reads (dense.apply_rows)."""
from __future__ import annotations

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip, per_bag, same_dims, shared_by_bags


def per_index_shape(fg: FunctionGraph, ref: Ref, squeeze: bool, unit_row: bool = False):
    """The shape of `ref` as weights of the ids: squeezed ([..., K, 1]) or read without axis -2 ([..., 1, K])."""
    shape = fg.shape(ref)
    if unit_row and shape.rank:
        return shape[:-2].concatenate(shape[-1:])
    return shape[:-1] if squeeze and shape.rank else shape


def may_broadcast_ids(shape, ids_shape) -> bool:
    """Whether a per-index multiplier of `shape` could make the product larger
    than the ids' [..., K] (some axis of it not 1 and not known equal)."""
    if shape.rank is None or ids_shape.rank is None or shape.rank > ids_shape.rank:
        return True
    ids_dims = ids_shape.as_list()[ids_shape.rank - shape.rank:]
    return any(d != 1 and (d is None or d != i) for d, i in zip(shape.as_list(), ids_dims))


def check_per_index(fg: FunctionGraph, ref: Ref, squeeze: bool, ids_shape, what: str,
                    shared: bool = False, unit_row: bool = False):
    shape = per_index_shape(fg, ref, squeeze, unit_row)
    if not same_dims(shape, ids_shape) and not (shared and (shared_by_bags(shape, ids_shape) or
                                                            per_bag(shape, ids_shape))):
        raise Skip(f"{what} shape {shape} does not match indices shape {ids_shape}")


def check_weights_and_mask(fg: FunctionGraph, rows, ids_shape) -> None:
    """Skip unless the weights (dense.Rows') and mask are per index of ids of `ids_shape`."""
    if rows.weights is not None and not rows.weights_scalar:
        check_per_index(fg, rows.weights, rows.weights_squeeze, ids_shape,
                        "multiplier is not per-index: weights", shared=True, unit_row=rows.weights_unit_row)
    if rows.mask is not None:
        check_per_index(fg, rows.mask, rows.mask_squeeze, ids_shape, "mask is not per-index: mask")


def check_mask_reads_rows(fg: FunctionGraph, mask: Ref, rows: Ref, limit: int = 64) -> None:
    """Skip where tf.where's condition is computed from the rows it masks (tf.math.is_nan(rows), rows > -inf:
    pkm_serve's own embedding_bag_composite(combiner="max") writes its NaN and -inf handling so): a choice per
    value of the rows, which no mask over the ids the fused op reads can make."""
    seen, todo = set(), [mask.node]
    while todo and len(seen) < limit:
        name = todo.pop()
        if name in seen or name not in fg.nodes:
            continue
        if name == rows.node:
            raise Skip("a tf.where mask computed from the gathered rows' own values (their NaN or -inf entries, "
                       "as embedding_bag_composite(combiner=\"max\") writes): a choice per value, not a mask of "
                       "the ids the fused op reads; call pkm_serve's embedding_bag in the model to get the op")
        seen.add(name)
        todo.extend(r.node for r in fg.inputs(fg.nodes[name]))
