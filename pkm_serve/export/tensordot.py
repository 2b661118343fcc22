"""tf.tensordot(rows, v, axes=[[1], [0]]) of gathered rows [B, K, D] and positional weights v [K]
(one per position, every bag shares them; keras.ops.matmul(v, rows) is tensordot(v, rows, [[0], [1]])):

  Transpose(rows, [0, 2, 1]) -> Reshape [B*D, K] -> MatMul(., Reshape(v, [K, 1])) -> Reshape [B, D]

is sum_k v[k] * rows[:, k, :], the bag of the ids weighted by v (broadcast to the ids by fuse); of
rows [B, F, K, D] (ids [B, F, K]: a bag per field) tensordot(rows, v, [[2], [0]]) likewise.
Another tensordot of gathered rows through the same steps is reported."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from pkm_serve.export.dense import fill_from_gather, leads_to_gather, resolve_gather
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import NotASite, Site, Skip, check_private, itemsize, same_dims, shared_by_bags

TENSORDOT_PATTERN = "tensordot"
_REASON = ("tf.tensordot of gathered rows that is not tensordot(rows [..., K, D], v [K], axes=[[-2], [0]]) "
           "(the bag weighted by v, one weight per position), so the site stays composite")


def _const_vector(fg: FunctionGraph, ref: Ref) -> Optional[List[int]]:
    """A constant int vector, or a ConcatV2 of constants (tensordot's permutation)."""
    value = fg.const_value(ref)
    if value is not None:
        return [int(v) for v in np.ravel(value)]
    node = fg.producer(ref)
    if node is None or node.op != "ConcatV2":
        return None
    parts = [fg.const_value(r) for r in fg.inputs(node)[:-1]]
    return None if any(p is None for p in parts) else [int(v) for p in parts for v in np.ravel(p)]


def _flag(node, name: str) -> bool:
    return name in node.attr and node.attr[name].b  # indexing the attr map would add the key


def _flattened_rows(fg: FunctionGraph, ref: Ref):
    """(Reshape, Transpose, rows) where `ref` is Reshape(Transpose(gathered rows)), else None."""
    flat = fg.producer(ref)
    transpose = fg.producer(fg.inputs(flat)[0]) if flat is not None and flat.op == "Reshape" else None
    if transpose is None or transpose.op != "Transpose" or not leads_to_gather(fg, fg.inputs(transpose)[0]):
        return None
    return flat, transpose, fg.inputs(transpose)[0]


def match_tensordot(fg: FunctionGraph, node, site: Site) -> Site:
    """`node`: the Reshape that ends tf.tensordot (module doc): rows first (Transpose [0, 2, 1], flattened
    to [B*D, K], times v as a [K, 1] column) or v first (keras.ops.matmul(v, rows): v as a [1, K] row
    times the rows transposed [1, 0, 2] and flattened to [K, B*D])."""
    matmul = fg.producer(fg.inputs(node)[0])
    if matmul is None or matmul.op != "MatMul":
        raise NotASite()
    operands = fg.inputs(matmul)[:2]
    found = [_flattened_rows(fg, r) for r in operands]
    if found == [None, None]:
        raise NotASite()
    rows_first = found[0] is not None
    flat, transpose, rows = found[0] if rows_first else found[1]
    flat_ref, vector_ref = operands if rows_first else operands[::-1]
    perm, rank = _const_vector(fg, fg.inputs(transpose)[1]), fg.shape(rows).rank
    contracted = None if perm is None else perm[-1] if rows_first else perm[0]
    if rank is None or rank < 2 or contracted != rank - 2:
        raise NotASite()  # not contracted over the bag axis (a projection of each row over D)
    site.pattern, site.weighted = TENSORDOT_PATTERN, True
    try:
        gathered = resolve_gather(fg, rows)
    except NotASite:
        raise Skip(_REASON) from None
    fill_from_gather(site, gathered, fg)
    rows_shape, out_shape = fg.shape(rows), fg.shape(Ref(node.name, 0))
    batch = list(range(rank - 2))  # [B] of ids [B, K]; [B, F] of ids [B, F, K] (a bag per field)
    if _flag(matmul, "transpose_a") or _flag(matmul, "transpose_b") or None in rows_shape.as_list()[-2:] or \
            perm != (batch + [rank - 1, rank - 2] if rows_first else [rank - 2] + batch + [rank - 1]):
        raise Skip(_REASON)
    bag, width = rows_shape.as_list()[-2:]
    # The flattened rows' K axis is computed (Pack of Prods); the MatMul with v as a [K, 1] column (a [1, K]
    # row) refuses any other K, and a reshape of [B, D, K] to [X, K] ([K, B, D] to [K, X]) keeps (b, d) in order.
    vector, flat_k = fg.producer(vector_ref), fg.shape(flat_ref)[1 if rows_first else 0] \
        if fg.shape(flat_ref).rank == 2 else -1
    if vector is None or vector.op != "Reshape" or flat_k not in (None, bag) or out_shape.rank != rank - 1 or \
            fg.shape(vector_ref).as_list() != ([bag, 1] if rows_first else [1, bag]) or out_shape[-1] != width or \
            not same_dims(out_shape[:-1], rows_shape[:-2]):
        raise Skip(_REASON)
    weights = fg.inputs(vector)[0]
    if not shared_by_bags(fg.shape(weights), fg.shape(gathered.indices)) or fg.shape(weights).rank != 1:
        raise Skip(_REASON)
    site.weights = weights
    site.internal = tuple(gathered.nodes + [transpose.name, flat.name, matmul.name, vector.name])
    site.intermediate_itemsizes = (itemsize(gathered.dtype),) * 2  # the rows and their transpose
    private = [gathered.output, Ref(transpose.name, 0), flat_ref, Ref(matmul.name, 0), vector_ref]
    check_private(fg, private + [Ref(n, 0) for n in gathered.nodes[:-1]], set(site.internal) | {node.name}, site)
    return site
