"""Gathered rows transposed before the bag reduction: reduce_sum(tf.transpose(rows, [0, 2, 1]), -1) of rows
[B, K, D] (Keras Permute((2, 1)) then channels_first pooling) is reduce_sum(rows, 1). Any constant
permutation whose axes left after the reduction keep their order is the same reduction of the rows as
gathered, over the permuted axes: the matchers read it so, the Transpose goes with the site."""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import Skip


class Untransposed(NamedTuple):
    rows: Ref            # the rows before the transpose
    axes: np.ndarray     # the reduction's axes in them
    transposed: Ref      # the transpose's output (read by the reduction only, as the site's rows are)
    walk_from: Ref       # the reduction's input: the transpose's output, or casts of it


def _through_casts(fg: FunctionGraph, x: Ref):
    """The producer below `x` past Casts (at most two; Keras mixed precision pools float16 rows in float32)
    and Identities, each read by the next step only: a cast of each entry commutes with the transpose."""
    producer, casts = fg.producer(x), 0
    while producer is not None and producer.op in ("Cast", "Identity") and casts < 2:
        below = fg.inputs(producer)[0]
        if len(fg.consumers(below)) != 1:
            return None
        casts += producer.op == "Cast"
        producer = fg.producer(below)
    return producer


def untranspose(fg: FunctionGraph, node, x: Ref, axis_ref: Ref, leads_to_gather) -> Optional[Untransposed]:
    """The reduction `node` of `x` = Transpose(rows, perm) as a reduction of rows, or None where `x` is no
    such transpose, the axes or perm are not constant, keepdims keeps the unit axes in the transposed
    order, or the axes left are in another order than the rows' (their bag would be transposed too)."""
    producer = _through_casts(fg, x)
    if producer is None or producer.op != "Transpose" or ("keep_dims" in node.attr and node.attr["keep_dims"].b):
        return None
    rows, perm_ref = fg.inputs(producer)
    perm, axes = fg.const_value(perm_ref), fg.const_value(axis_ref)
    rank = fg.shape(rows).rank
    if perm is None or axes is None or rank is None or not leads_to_gather(fg, rows):
        return None
    perm = [int(p) for p in np.reshape(perm, [-1])]
    reduced = {int(a) % rank for a in np.reshape(axes, [-1])}
    kept = [perm[i] for i in range(rank) if i not in reduced]
    if kept != sorted(kept):
        return None
    return Untransposed(rows, np.array(sorted(perm[a] for a in reduced), np.int64), Ref(producer.name, 0), x)


def reduced_rows(fg: FunctionGraph, node, leads_to_gather):
    """(rows, axes, transposed) of a reduction `node`: its input and constant axes (None where not constant),
    or where the input is such a transpose (or casts of it), the rows before it, the axes in them and the
    Untransposed record."""
    x, axis_ref = fg.inputs(node)
    found = untranspose(fg, node, x, axis_ref, leads_to_gather)
    if found is None:
        return x, fg.const_value(axis_ref), None
    return found.rows, found.axes, found


def check_transposed_shape_unread(site, transposed_refs) -> None:
    """Skip where the model reads the transposed rows' shape: a Shape of the rows is rebuilt from the ids' as
    [..., K, D], which the transposed [..., D, K] (or a cast of it) is not."""
    if any(ref in transposed_refs for _, ref in site.shape_consumers):
        raise Skip("the shape of the transposed gathered rows is read (tf.shape(x)[-1] of [..., D, K], say): it is "
                   "not the rows' shape the fused site rebuilds, so the site stays composite")
