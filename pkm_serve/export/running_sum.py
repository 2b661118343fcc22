"""A bag read off a running sum: tf.math.cumsum(rows, axis=-2)[..., -1, :] (reverse=True:
[..., 0, :]; keepdims as [..., -1:, :]) is the sum of the rows over the bag axis, and
[..., j, :] with j >= 0 (reverse=False) the bag of ids[..., 0:j+1], whatever the ids' width
(fused as a per-position span, positions.py: the ids sliced after a check that they have
j + 1 positions, as the composite's slice requires, and that every id gathered is in range)."""
from __future__ import annotations

from pkm_serve.export.dense import apply_rows, leads_to_gather, resolve_rows
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.position_slices import attr_value, slice_position
from pkm_serve.export.positions import PositionSpan
from pkm_serve.export.sites import NotASite, Site, Skip, check_private, dims, same_dims

CUMSUM_PATTERN = "cumsum"


def match_cumsum_last(fg: FunctionGraph, node, site: Site) -> Site:
    """cumsum(rows, axis=-2)[..., -1, :] (reverse: [..., 0, :]): the running sum's end is the bag sum."""
    x = fg.inputs(node)[0]
    cumsum = fg.producer(x)
    if cumsum is None or cumsum.op != "Cumsum" or not leads_to_gather(fg, fg.inputs(cumsum)[0]):
        raise NotASite()
    rows_in, axis_ref = fg.inputs(cumsum)
    rank, axis = fg.shape(rows_in).rank, fg.const_value(axis_ref)
    if rank is None or rank < 2 or axis is None or int(axis) % rank == rank - 1:
        raise NotASite()  # a running sum over D is each row's own
    site.pattern = CUMSUM_PATTERN
    rows = resolve_rows(fg, rows_in, site)
    if int(axis) % rank != rank - 2:
        raise Skip(f"tf.math.cumsum over axis {int(axis)}, not the bag axis (-2), of the gathered rows")
    if rows.regathers:
        raise Skip("the gathered rows are re-gathered before a dense reduction")
    position = slice_position(fg, Ref(node.name, 0), axis=rank - 2)
    reverse = attr_value(cumsum, "reverse", "b")
    # The end as written: [:, K - 1] of the declared K is the bag of ids[:, 0:K] however wide the ids a
    # server feeds (a span); reverse's [:, j > 0] (ids[:, j:]) and negative positions but the whole
    # bag's end are other positions at other widths.
    whole_end = 0 if reverse else -1
    partial = position is not None and position[1] >= 0 and not reverse
    if attr_value(cumsum, "exclusive", "b") or position is None or (position[1] != whole_end and not partial):
        raise Skip("the slice of tf.math.cumsum over the bag axis is neither its whole-bag end ([:, -1]; [:, 0] "
                   "with reverse=True) nor position j >= 0 of a forward inclusive running sum (the bag of "
                   "ids[:, :j+1]): an exclusive or reverse partial running sum, or one read at a position counted "
                   "from the end (which other lengths of ids make another bag), is not fused")
    apply_rows(fg, site, rows, cumsum.name, rows_in)
    site.internal += (cumsum.name,)
    check_private(fg, [x], set(site.internal) | {node.name}, site)
    site.expand_bag_axis = position[2]
    if partial and position[1] != whole_end:
        if position[2]:  # [:, j:j+1] of ids narrower than j + 1 is empty, not refused: no span's bag
            raise Skip("a partial running sum kept as tf.math.cumsum(rows)[:, j:j+1] is empty for ids narrower "
                       "than j + 1 (where the fused bag of ids[:, :j+1] would refuse them): not fused")
        _partial_span(fg, site, position[1] + 1)
    return site


def _partial_span(fg: FunctionGraph, site: Site, stop: int) -> None:
    """The running sum's position stop - 1: the bag of ids[..., 0:stop], every id gathered (range-checked)."""
    if site.mask is not None or site.ones is not None or site.regathers or site.weights_scalar or \
            (site.weights is not None and not same_dims(fg.shape(site.weights), fg.shape(site.indices))):
        raise Skip("a partial running sum (tf.math.cumsum(rows)[:, j]) of masked rows, or of rows weighted by "
                   "other than per-index weights shaped like the ids, is not fused")
    if site.table_shape is None or site.table_shape[0] is None:
        raise Skip("the table's rows are unknown, so the ids the partial running sum gathered cannot be "
                   "range-checked")
    site.positions = PositionSpan(0, stop, wrapped=False, gathers_all=True, weighs_all=True)
    ids_dims = dims(fg.shape(site.indices))
    site.gathered_shape = None if ids_dims is None else ids_dims[:-1] + [stop, site.table_shape[1]]
