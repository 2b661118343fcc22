"""A bag read off a running sum: tf.math.cumsum(rows, axis=-2)[..., -1, :] (reverse=True:
[..., 0, :]; keepdims as [..., -1:, :]) is the sum of the rows over the bag axis."""
from __future__ import annotations

from pkm_serve.export.dense import apply_rows, leads_to_gather, resolve_rows
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.position_slices import attr_value, slice_position
from pkm_serve.export.sites import NotASite, Site, Skip, check_private

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
    # The end as written: [:, K - 1] of the declared K (reverse: [:, -K]) is a partial sum of
    # the wider ids a server may feed, so only [:, -1] (reverse: [:, 0]) is the whole bag.
    whole_end = 0 if attr_value(cumsum, "reverse", "b") else -1
    if attr_value(cumsum, "exclusive", "b") or position is None or position[1] != whole_end:
        raise Skip("the slice of tf.math.cumsum over the bag axis is not its whole-bag end ([:, -1]; [:, 0] with "
                   "reverse=True; exclusive=False): a partial running sum, or an end counted off the declared "
                   "length, which other lengths of ids make a partial sum, is not fused")
    apply_rows(fg, site, rows, cumsum.name, rows_in)
    site.internal += (cumsum.name,)
    check_private(fg, [x], set(site.internal) | {node.name}, site)
    site.expand_bag_axis = position[2]
    return site
