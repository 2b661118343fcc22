"""Einsum sites: GatherV2/ResourceGather -> Einsum('...k,...kd->...d' and
equivalent spellings), weighted or not."""
from __future__ import annotations

from typing import List

from pkm_serve.export.dense import fill_from_gather, resolve_gather
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
