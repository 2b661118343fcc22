"""Einsum sites: GatherV2/ResourceGather -> Einsum('...k,...kd->...d' and
equivalent spellings), weighted or not; and its matmul spelling,
tf.matmul(w[..., None, :], rows) = the weighted bag with a unit axis before D."""
from __future__ import annotations

from typing import List

from pkm_serve.export.dense import adds_unit_axis, fill_from_gather, leads_to_gather, resolve_gather
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import (NotASite, Site, Skip, check_private, itemsize,
                                    same_dims)


def _einsum_labels(term: str) -> List[str]:
    labels, i = [], 0
    while i < len(term):
        if term.startswith("...", i):
            labels.append("...")
            i += 3
        else:
            labels.append(term[i])
            i += 1
    return labels


def match_einsum(fg: FunctionGraph, node, site: Site) -> Site:
    equation = node.attr["equation"].s.decode().replace(" ", "")
    ins = fg.inputs(node)
    if "->" not in equation or len(ins) not in (1, 2):
        raise NotASite()
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    skipped = None  # an operand that is a gather of something else (a 1-D weight table)
    for g_pos in range(len(ins)):
        try:
            gathered = resolve_gather(fg, ins[g_pos])
            break
        except NotASite:
            continue
        except Skip as e:
            skipped = skipped or e
    else:
        raise skipped or NotASite()
    fill_from_gather(site, gathered, fg)
    g_labels = _einsum_labels(terms[g_pos])
    out_labels = _einsum_labels(out)
    reason = f"einsum '{equation}' is not a weighted sum over the bag axis"
    site.weighted = len(ins) == 2
    if len(g_labels) < 2 or len(set(g_labels)) != len(g_labels):
        raise Skip(reason)
    bag, dim = g_labels[-2], g_labels[-1]
    if "..." in (bag, dim) or out_labels != g_labels[:-2] + [dim]:
        raise Skip(reason)
    if "..." not in g_labels and fg.shape(ins[g_pos]).rank not in (None, len(g_labels)):
        raise Skip(reason)
    if len(ins) == 2:
        w_ref = ins[1 - g_pos]
        if _einsum_labels(terms[1 - g_pos]) != g_labels[:-1]:
            raise Skip(reason)
        if not same_dims(fg.shape(w_ref), fg.shape(gathered.indices)):
            raise Skip("weights shape %s does not match indices shape %s" % (
                fg.shape(w_ref), fg.shape(gathered.indices)))
        site.weights = w_ref
    site.internal = tuple(gathered.nodes)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),)
    private = [gathered.output] + [Ref(n, 0) for n in gathered.nodes[:-1]]
    check_private(fg, private, set(site.internal) | {node.name})
    return site


MATMUL_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def match_matmul(fg: FunctionGraph, node, site: Site) -> Site:
    """matmul(x, rows) with rows = table[ids] [..., K, D] and x = w[..., None, :]
    ([..., 1, K]) is sum_k w[..., k] * rows[..., k, :] kept as [..., 1, D]: the
    weighted bag, then expand_dims(-2). Any other matmul of gathered rows is reported."""
    x, y = fg.inputs(node)[:2]
    out = fg.shape(Ref(node.name, 0))
    if not leads_to_gather(fg, y) or out.rank is None or out.rank < 2 or out[-2] != 1:
        raise NotASite()  # not one row pooled from the rows (a Dense layer on them, attention)
    site.weighted = True
    reason = "a matmul of gathered rows that is not w[..., None, :] @ rows (a weighted bag)"
    transposed = ("transpose_a", "transpose_b") if node.op == "MatMul" else ("adj_x", "adj_y")
    if any(node.attr[a].b for a in transposed) or (node.op == "BatchMatMulV3" and len(
            {node.attr[a].type for a in ("Ta", "Tb", "Tout")}) != 1):
        raise Skip(reason)
    try:
        gathered = resolve_gather(fg, y)
    except NotASite:
        raise Skip(reason) from None
    fill_from_gather(site, gathered, fg)
    w, nodes = _unit_axis_before_last(fg, x)
    if w is None:
        raise Skip(reason)
    if not same_dims(fg.shape(w), fg.shape(gathered.indices)):
        raise Skip("weights shape %s does not match indices shape %s" % (
            fg.shape(w), fg.shape(gathered.indices)))
    site.weights, site.expand_bag_axis = w, True
    site.internal = tuple(gathered.nodes + nodes)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),)
    private = [gathered.output, x] + [Ref(n, 0) for n in gathered.nodes[:-1]]
    check_private(fg, private, set(site.internal) | {node.name})
    return site


def _unit_axis_before_last(fg: FunctionGraph, ref: Ref):
    """(w, nodes) where `ref` is w [..., K] with a 1 inserted before K:
    expand_dims(w, -2), w[..., None, :] / w[:, None, :], or a reshape whose
    static shapes prove it; (None, []) otherwise."""
    node, out = fg.producer(ref), fg.shape(ref)
    if node is None or out.rank is None or out.rank < 2 or out[-2] != 1:
        return None, []
    ins = fg.inputs(node)
    w = ins[0] if ins else None
    if w is None or fg.shape(w).rank != out.rank - 1:
        return None, []
    if node.op == "ExpandDims":
        axis = fg.const_value(ins[1])
        ok = axis is not None and int(axis) in (-2, out.rank - 2)
    elif node.op == "StridedSlice":
        ok = adds_unit_axis(fg, node, ins, -2)
    elif node.op == "Reshape":
        dims, w_dims = out.as_list(), fg.shape(w).as_list()
        ok = dims[:-2] + dims[-1:] == w_dims and None not in w_dims[1:]
    else:
        ok = False
    return (w, [node.name]) if ok else (None, [])

