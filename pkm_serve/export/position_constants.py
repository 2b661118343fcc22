"""Per-position terms scaled by a constant as well: rows[:, k] * w[:, k:k+1] * c (in any grouping, c a constant
scalar, also unweighted rows[:, k] * c, or divided: rows[:, k] / c). Where every term's constant is the same c,
the bag is c times the bag of the terms without it: the site gets c as one more factor of its weights
(scales.fold_factors).
Constants that differ by position are per-position scalar weights, reported as such."""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.dense import is_scalar, strip_trailing_unit_axis
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.scales import Factor, _check_half_weight_fits
from pkm_serve.export.sites import NotASite, Site, Skip, same_dims


def _product_leaves(fg: FunctionGraph, ref: Ref, muls: List[str], divisors: List[Ref]) -> List[Ref]:
    """The factors of a tree of Muls (and divisions by a constant: `divisors`) at `ref`, through the nodes
    read by the tree only."""
    node = fg.producer(ref)
    if node is None or (muls and len(fg.consumers(ref)) != 1):
        return [ref]
    ins = fg.inputs(node)
    if node.op == "RealDiv" and _constant(fg, ins[1]) is not None:  # rows[:, k] / c
        muls.append(node.name)
        divisors.append(ins[1])
        return _product_leaves(fg, ins[0], muls, divisors) + [ins[1]]
    if node.op != "Mul":
        return [ref]
    muls.append(node.name)
    return [leaf for r in ins for leaf in _product_leaves(fg, r, muls, divisors)]


def _constant(fg: FunctionGraph, ref: Ref) -> Optional[float]:
    value = fg.const_value(ref)
    return None if value is None or value.size != 1 or value.dtype.kind != "f" else float(np.reshape(value, []))


def scaled_position_rows(fg: FunctionGraph, ref: Ref, function: str, kept: bool, term_of):
    """term_of(fg, ref, function, kept) (positions._position_rows), or where `ref` is a product of one position's
    rows, constant scalars and at most one weight, that term weighted by the weight and with `.constant` the
    (one) constant leaf; None where neither."""
    muls: List[str] = []
    divisors: List[Ref] = []
    leaves = _product_leaves(fg, ref, muls, divisors)
    constants = [leaf for leaf in leaves if _constant(fg, leaf) is not None]
    if not constants:
        return term_of(fg, ref, function, kept)
    others = [leaf for leaf in leaves if leaf not in constants]
    found = [(leaf, term_of(fg, leaf, function, kept)) for leaf in others]
    found = [(leaf, term) for leaf, term in found if term is not None]
    if len(found) != 1 or len(others) > 2 or found[0][1].weights is not None:
        return None
    rows_leaf, term = found[0]
    term.own += muls
    term.constant = [("div" if leaf in divisors else "mul", leaf) for leaf in constants]
    weight = [leaf for leaf in others if leaf != rows_leaf]
    if weight:
        rank = fg.shape(rows_leaf).rank
        try:
            w, nodes, squeeze = (weight[0], [], False) if is_scalar(fg, weight[0], rank) else \
                strip_trailing_unit_axis(fg, weight[0])
        except (NotASite, Skip):
            return None
        term.own += nodes
        term.weights = (w, squeeze, is_scalar(fg, w, rank))
    return term


def check_divided_positions(fg: FunctionGraph, leaves: List[Ref], function: str, term_of) -> None:
    """Skip where two addends or more are rows of one position of one ids tensor and table divided by a tensor
    (rows[:, k] / d[:, k:k+1], tf.math.divide_no_nan(rows[:, k], d[:, k:k+1])): a bag the positions matcher
    does not take (it takes constant divisors), reported rather than left out of the report."""
    divided: dict = {}
    for ref in leaves:
        node = fg.producer(ref)
        if node is None or node.op not in ("RealDiv", "DivNoNan") or _constant(fg, fg.inputs(node)[1]) is not None:
            continue
        term = term_of(fg, fg.inputs(node)[0], function, False)
        if term is not None:
            key = (term.ids[0], term.table)
            divided[key] = divided.get(key, 0) + 1
    if divided and max(divided.values()) >= 2:
        raise Skip("a sum of positions, each position's rows divided by a tensor (rows[:, k] / d[:, k:k+1] or "
                   "tf.math.divide_no_nan(rows[:, k], d[:, k:k+1])): not fused; the same bag written as "
                   "reduce_sum(tf.math.divide_no_nan(rows, d[..., None]), 1) is")


def _no_nan_positions(fg: FunctionGraph, terms, site: Site, constants) -> None:
    """multiply_no_nan(rows[:, k], w[:, k:k+1]) at every position, w shaped like the ids: the bag's weights
    w[..., a:b], whose zeros become padding once sliced (patterns: no_nan_padding), as for rows of every
    position; Skip where some terms are plain products, scaled by constants, or weighted otherwise."""
    if all(c is None for c in constants) and site.weights is not None and \
            same_dims(fg.shape(site.weights), fg.shape(site.indices)) and \
            all(len(t.site.no_nan_weights) == 1 and t.weights is not None and
                t.site.no_nan_weights[0][0] == t.weights[0] for t in terms):
        site.no_nan_positions = True
        return
    raise Skip("a sum of positions some of which are tf.math.multiply_no_nan(rows, w[:, k:k+1]) and some plain or "
               "scaled products (or weighted by other than w shaped like the ids): 0 where w is 0 even for an inf "
               "or NaN row, which the fused op's w * row is not: not fused (multiply_no_nan at every position, "
               "or of the rows of every position then reduce_sum, is)")


def constant_factor(fg: FunctionGraph, terms, site: Site) -> None:
    """Every term's constants as one factor of the site's weights, where every term has one constant and all
    are equal; Skip where they differ (per-position scalar weights) or some terms have none, or where a term
    is a multiply_no_nan (its zero weights' padding is not carried through the positions' slices)."""
    constants = [getattr(t, "constant", None) for t in terms]
    if any(t.site.no_nan_weights for t in terms):
        _no_nan_positions(fg, terms, site, constants)
    if all(c is None for c in constants):
        return
    if any(c is None or len(c) != 1 for c in constants):
        raise Skip("some terms of the sum of positions are scaled by a constant and some are not (or by several): "
                   "only one constant every term shares is fused")
    values = {(c[0][0], _constant(fg, c[0][1])) for c in constants}
    if len(values) != 1:
        raise Skip(f"the terms of the sum of positions are scaled by different constants {sorted(values)}: "
                   "per-position scalar weights, not fused (positional weights v[k] of one vector are)")
    site.weighted = True
    kind, ref = constants[0][0]
    site.weight_factors = site.weight_factors + (Factor(kind, ref, False, True),)
    if site.table_dtype == types_pb2.DT_HALF:  # w * c becomes the op's one float16 weight, as scales.py folds it
        _check_half_weight_fits(fg, site, list(site.weight_factors))
