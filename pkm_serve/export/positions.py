"""Bags written one position at a time:

  tf.add_n([tf.gather(t, ids[:, k]) [* w[:, k:k+1]] for k in range(K)])   (or a + b + ..., Python sum(),
  tf.gather_nd(t, ids[:, k, None]) or tf.gather_nd(t, ids[:, k:k+1]) as the rows of position k,
  keras.ops.take / a Keras 3 Embedding per position, rows = gather(t, ids) sliced rows[:, k] or unstacked,
  reduce_sum / reduce_mean of tf.stack of such rows)
      -> the bag of ids[..., a:b] [weights w[..., a:b]] over the positions a..b-1 the terms take

A per-position sum reads positions a..b-1 only: a server may feed wider ids (the composite
sums the same positions, so does the fused op on ids[..., a:b]) or narrower ones (the
composite's slice fails; an Assert added before the fused op fails too; tf.unstack refuses any
width but its own, an Assert of that width too). Positions counted from the end (ids[:, -1]) are
other positions of another width: reported. Rows gathered once for every position: the
composite's gather refuses a bad id at any position, an Assert too.
"""
from __future__ import annotations

import collections
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes

from pkm_serve.export.dense import (Rows, apply_rows, fill_from_gather, is_scalar, leads_to_gather, resolve_rows,
                                    strip_trailing_unit_axis)
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import I32, _assert, _reduce_ids
from pkm_serve.export.position_constants import check_divided_positions, constant_factor, scaled_position_rows
from pkm_serve.export.position_slices import _slice_entries, slice_position, unwrapped, wrap_negative
from pkm_serve.export.sites import (NotASite, Site, Skip, check_private, dims, same_dims, shared_by_bags,
                                    tensor_dtype)

ADD_OPS = ("AddN", "AddV2", "Add")
POSITIONS_PATTERN = "per-position-sum"


class PositionSpan(NamedTuple):
    """What the fused op reads of a per-position sum: ids[..., first:stop] (and the weights')."""
    first: int
    stop: int
    wrapped: bool              # keras.ops.take wraps negative ids
    gathers_all: bool          # rows gathered (and range-checked) at every position, then sliced
    ids_width: Optional[int] = None      # tf.unstack(ids or rows) refuses ids of any other width
    weights_width: Optional[int] = None  # tf.unstack(weights) likewise
    ids_cast: Optional[dict] = None      # the attrs of the Cast each position's ids go through
    clamped: bool = False      # unweighted ids[..., k:k+1] (tf.concat's): empty past the ids' width as
                               # the fused ids[..., a:b] clamps, not refused: no width check
    weighs_all: bool = False   # weights multiply all the rows before the slice (cumsum(rows * w)[:, j])


def _is_zero_fill(fg: FunctionGraph, ref: Ref) -> bool:
    """A tensor of zeros whatever the input: tf.zeros / zeros_like / a constant 0 (a running sum's start)."""
    node = fg.producer(ref)
    value = fg.const_value(ref)
    if value is not None:
        return value.size > 0 and not np.any(value)
    if node is None:
        return False
    if node.op == "ZerosLike":
        return True
    fill = fg.const_value(fg.inputs(node)[1]) if node.op == "Fill" else None
    return fill is not None and not np.any(fill)


def _broadcasts_nothing(shape, out_shape) -> bool:
    """Adding zeros of `shape` to the bag changes nothing: 0, [1, D], or the bag's own shape."""
    if shape.rank is None or out_shape.rank is None or shape.rank > out_shape.rank:
        return False
    tail = out_shape[out_shape.rank - shape.rank:]
    return all(d == 1 or same_dims(shape[i:i + 1], tail[i:i + 1]) for i, d in enumerate(shape.as_list()))


def _terms(fg: FunctionGraph, root, adds: List[str]) -> List[Ref]:
    """The addends of an add tree rooted at `root`: through the Add nodes that only the tree reads."""
    leaves: List[Ref] = []
    for ref in fg.inputs(root):
        producer = fg.producer(ref)
        if producer is not None and producer.op in ADD_OPS and ref not in fg.returned and \
                len(fg.consumers(ref)) == 1:
            adds.append(producer.name)
            leaves.extend(_terms(fg, producer, adds))
        else:
            leaves.append(ref)
    return leaves


class _Term:
    def __init__(self, fg: FunctionGraph, ref: Ref, rows: Rows, site: Site, ids: Tuple[Ref, int, bool]):
        self.ref, self.rows, self.site, self.ids = ref, rows, site, ids
        self.wrapped = False  # the gather reads keras.ops.take's where(x < 0, x + N, x) of the position
        self.table = rows.gather.params  # the variable a ReadVariableOp reads, or the tensor gathered
        read = fg.producer(self.table)
        if read is not None and read.op == "ReadVariableOp":
            self.table = fg.inputs(read)[0]
        # (per-index weights, squeeze, scalar) or None
        self.weights = None if rows.weights is None else (rows.weights, rows.weights_squeeze, rows.weights_scalar)
        self.sliced: Optional[Ref] = None  # rows gathered once for every position, sliced by this term
        self.own: List[str] = []           # the slice (and multiply) of those rows
        self.position_ref = ref            # the position of the ids (or of the sliced rows) taken
        self.cast = None                   # the Cast node of tf.cast(ids[..., k]) the gather reads
        self.kept = False                  # rows [..., 1, D] of ids[..., k:k+1] (tf.concat's), not [..., D]


def _cast_key(term: _Term):
    return None if term.cast is None else tuple(sorted(
        (key, value.SerializeToString()) for key, value in term.cast.attr.items() if not key.startswith("_")))


def _unpacked_width(fg: FunctionGraph, ref: Ref) -> Optional[int]:
    """num of the tf.unstack whose output `ref` is (it refuses any other length), else None."""
    node = fg.producer(ref)
    return None if node is None or node.op != "Unpack" else int(node.attr["num"].i)


def _position_rows(fg: FunctionGraph, ref: Ref, function: str, kept: bool = False) -> Optional[_Term]:
    """A term that is table rows gathered at one position of some ids (ids[..., k]), else None.
    kept: rows of ids[..., k:k+1] (or rows[..., k:k+1, :]), the position's unit axis kept (tf.concat's)."""
    if not leads_to_gather(fg, ref):
        return _sliced_rows_term(fg, ref, function, kept)
    scratch = Site(function=function, root=ref.node, pattern=POSITIONS_PATTERN)
    try:
        rows = resolve_rows(fg, ref, scratch, nd_positions=True)
    except (NotASite, Skip):
        return None
    indices, wrapped = unwrapped(fg, rows.gather.indices, rows.gather.table_shape)
    cast = fg.producer(indices)
    cast = cast if cast is not None and cast.op == "Cast" else None
    if cast is not None:  # tf.cast(ids[:, k]) is tf.cast(ids)[:, k], element by element
        indices = fg.inputs(cast)[0]
    ids = slice_position(fg, indices)
    # gather_nd(t, ids[:, k:k+1]) takes the kept unit axis as its index axis: the rows of ids[:, k]
    if ids is None or ids[2] != (rows.gather.nd_position or kept) or (kept and rows.gather.nd_position):
        return None
    term = _Term(fg, ref, rows, scratch, (ids[0], ids[1], False))
    term.wrapped, term.cast, term.position_ref, term.kept = wrapped, cast, indices, kept
    return term


def _sliced_rows_term(fg: FunctionGraph, ref: Ref, function: str, kept: bool = False) -> Optional[_Term]:
    """rows[..., k, :] [* w[..., k:k+1]] (or tf.unstack(rows, axis=-2)[k]) of rows = gather(t, ids) gathered
    once for every position: the term gather(t, ids[..., k]) [* w[..., k:k+1]]."""
    node = fg.producer(ref)
    pairs = [(ref, None)] if node is None or node.op != "Mul" else [tuple(fg.inputs(node)), tuple(fg.inputs(node))[::-1]]
    for sliced, w_ref in pairs:
        producer = fg.producer(sliced)
        if producer is None or producer.op not in ("StridedSlice", "Unpack", "GatherV2"):
            continue
        rank = fg.shape(fg.inputs(producer)[0]).rank
        position = None if rank is None or rank < 2 else slice_position(fg, sliced, axis=rank - 2)
        if position is None or position[2] != kept or not leads_to_gather(fg, position[0]):
            continue
        scratch = Site(function=function, root=ref.node, pattern=POSITIONS_PATTERN)
        try:
            rows = resolve_rows(fg, position[0], scratch)
            weights = None if w_ref is None else (w_ref, [], False) if is_scalar(fg, w_ref, rank - 1) else \
                strip_trailing_unit_axis(fg, w_ref)
        except (NotASite, Skip):
            return None
        if rows.weights is not None or rows.mask is not None or rows.ones is not None:
            return None
        indices, wrapped = unwrapped(fg, rows.gather.indices, rows.gather.table_shape)
        term = _Term(fg, ref, rows, scratch, (indices, position[1], False))
        term.wrapped, term.sliced, term.own, term.position_ref = wrapped, position[0], [producer.name], sliced
        term.kept = kept
        if weights is not None:
            term.own += [node.name] + weights[1]
            term.weights = (weights[0], weights[2], is_scalar(fg, weights[0], rank))
        return term
    return None


def _check_term(fg: FunctionGraph, term: _Term, first: _Term) -> Optional[Ref]:
    """Raises Skip unless `term` is a position of the same ids, table, cast and weights as `first`;
    returns the weights' source (or None)."""
    rows = term.rows
    if term.ids[0] != first.ids[0] or term.table != first.table:
        raise Skip("the added terms gather other ids or another table: only the positions of one ids "
                   "tensor gathered from one table are a bag")
    if term.sliced != first.sliced:
        raise Skip("the terms slice their positions off separate gathers of all the ids (or some off a gather of "
                   "all the ids, some off a gather of their own position): not fused")
    if rows.mask is not None or rows.ones is not None or rows.regathers or rows.unflattened is not None:
        raise Skip("a term is masked, multiplied by ones, re-gathered or reshaped: only rows[k] [* w[k]] "
                   "terms are fused")
    if term.wrapped != first.wrapped:
        raise Skip("some terms wrap negative ids (keras.ops.take) and some do not")
    if rows.cast_enum != first.rows.cast_enum or rows.rounded_enum != first.rows.rounded_enum:
        raise Skip("the terms cast their rows to different dtypes")
    if _cast_key(term) != _cast_key(first):
        raise Skip("the terms cast their ids differently (some through tf.cast, some not, or to other dtypes)")
    if (term.weights is None) != (first.weights is None):
        raise Skip("some terms are weighted and some are not")
    if term.weights is None:
        return None
    weights_ref, squeeze, scalar = term.weights
    weights = slice_position(fg, weights_ref)
    if scalar:  # v[k] (or v[k:k+1]) of positional weights v [K]: every bag's position k weighed by v[k]
        source_rank = None if weights is None else fg.shape(weights[0]).rank
        weights = None if source_rank != 1 else (weights[0], weights[1], squeeze or term.kept)
    if weights is None and term.kept and squeeze:  # w[:, k:k+1, None] times kept rows [B, 1, D]
        weights, squeeze = _kept_position_unit_axis_added(fg, weights_ref), False
    # w[:, k:k+1] times rows [B, D] (squeezed for the op), w[:, k:k+1][..., None] times kept rows [B, 1, D]
    if weights is None or weights[1] != term.ids[1] or weights[2] != (squeeze or term.kept):
        raise Skip("a term's weight is not the weights' entry at the term's position (w[:, k:k+1] for "
                   "ids[:, k]): the multiplier is not per index")
    return weights[0]


def _variable_read(fg: FunctionGraph, ref: Optional[Ref]):
    """The variable a ReadVariableOp `ref` reads (reads of one variable in one call are one value), else ref."""
    node = None if ref is None else fg.producer(ref)
    return ("variable", fg.inputs(node)[0]) if node is not None and node.op == "ReadVariableOp" else ref


def _kept_position_unit_axis_added(fg: FunctionGraph, ref: Ref) -> Optional[Tuple[Ref, int, bool]]:
    """(w, k, True) where `ref` is w[..., k:k+1, None] (one StridedSlice), else None."""
    node = fg.producer(ref)
    rank = None if node is None or node.op != "StridedSlice" else fg.shape(fg.inputs(node)[0]).rank
    entry = None if not rank else _slice_entries(fg, node, rank - 1)
    if entry is None or entry[2] or not entry[5] or entry[3] or entry[4] or entry[0] < 0 or entry[1] - entry[0] != 1:
        return None
    return fg.inputs(node)[0], entry[0], True


def _gather_site(fg: FunctionGraph, site: Site, term: _Term) -> None:
    """Fills the site's table fields from one term (the checks of apply_rows on it; rows sliced by
    every term are checked with the whole site)."""
    if term.sliced is None:
        consumers = fg.consumers(term.ref)  # the add that reads the term (checked with the whole tree later)
        apply_rows(fg, term.site, term.rows, consumers[0][0] if len(consumers) == 1 else site.root, term.ref)
    else:
        fill_from_gather(term.site, term.rows.gather, fg)
        term.site.cast_enum = term.rows.cast_enum if term.rows.cast_enum != term.rows.gather.dtype else 0
        term.site.internal = tuple(term.own + term.rows.nodes + term.rows.gather.nodes)
        term.site.intermediate_itemsizes = tuple(term.rows.itemsizes)
    for key in ("params", "params_is_resource", "index_dtype", "table_dtype", "table", "table_shape", "dtype",
                "cast_to", "rounded_to", "cast_enum", "negative_ids_padding", "ids_past_rows_padding"):
        setattr(site, key, getattr(term.site, key))


def match_positions_sum(fg: FunctionGraph, node, site: Site) -> Site:
    """An add tree whose addends are rows of one table gathered at positions a..b-1 of one ids
    tensor, each once, each weighted by the same weights' entry or none: the bag of ids[..., a:b]."""
    out = Ref(node.name, 0)
    consumers = fg.consumers(out)
    if out not in fg.returned and len(consumers) == 1 and fg.nodes[consumers[0][0]].op in ADD_OPS and \
            (_pure(fg, fg.nodes[consumers[0][0]], site.function) or not _pure(fg, node, site.function)):
        raise NotASite()  # inside a larger bag (matched at its top), or reported at the top of the tree
    adds: List[str] = []
    leaves = _terms(fg, node, adds)
    if not _pure(fg, node, site.function) and any(_pure(fg, fg.nodes[a], site.function) for a in adds):
        raise NotASite()  # tf.add_n(positions) + bias: the positions below are a bag of their own
    terms = _candidate_terms(fg, leaves, site)
    zeros = [ref for ref, t in zip(leaves, terms) if t is None and _is_zero_fill(fg, ref)]
    bag_shape = fg.shape(next(t for t in terms if t is not None).ref)
    for ref, term in zip(leaves, terms):
        if term is None and ref not in zeros:
            raise Skip(f"the sum of positions also adds {fg.render(ref)}, which is no position of the bag")
        # tf.zeros([B, 1, D]) + rows [B, D] is [B, B, D], tf.zeros([1, D]) + rows [D] is [1, D]: no bag
        if ref in zeros and not (_broadcasts_nothing(fg.shape(ref), bag_shape) and same_dims(fg.shape(out), bag_shape)):
            raise Skip(f"a zero start of the sum, shaped {fg.shape(ref)}, is not shaped like the bag's rows "
                       f"{bag_shape}: it broadcasts the sum to {fg.shape(out)}")
    _positions_site(fg, node, site, [t for t in terms if t is not None], adds)
    site.dead_after += tuple(fg.producer(r).name for r in zeros if fg.producer(r) is not None)
    return site


def _pure(fg: FunctionGraph, node, function: str) -> bool:
    """The add tree at `node` adds positions (two at least) and zeros only. Cached per function pass:
    each add of a long chain asks about its parent."""
    cache = fg.__dict__.setdefault("_pkm_pure_adds", {})
    if node.name not in cache:
        leaves = _terms(fg, node, [])
        terms = [_cached_term(fg, ref, function) for ref in leaves]
        cache[node.name] = sum(t is not None for t in terms) >= 2 and \
            all(t is not None or _is_zero_fill(fg, ref) for ref, t in zip(leaves, terms))
    return cache[node.name]


def _cached_term(fg: FunctionGraph, ref: Ref, function: str) -> Optional[_Term]:
    cache = fg.__dict__.setdefault("_pkm_position_terms", {})
    if ref not in cache:
        cache[ref] = _position_rows(fg, ref, function)
    return cache[ref]


def _stacked(fg: FunctionGraph, pack, rank: int):
    """(addends, axis, expand nodes, kept flags) of tf.stack(xs, axis) or tf.concat of xs each expanded at
    axis, or (kept) rows of one position kept at the bag axis (gather(t, ids[:, k:k+1])); None otherwise."""
    if pack is None or pack.op not in ("Pack", "ConcatV2"):
        return None
    if pack.op == "Pack":
        return fg.inputs(pack), (pack.attr["axis"].i if "axis" in pack.attr else 0) % rank, [], None
    axis = fg.const_value(fg.inputs(pack)[-1])
    if axis is None:
        return None
    addends, expands, kept = [], [], []
    for ref in fg.inputs(pack)[:-1]:
        expand = fg.producer(ref)
        expand_axis = fg.const_value(fg.inputs(expand)[1]) if expand is not None and expand.op == "ExpandDims" else None
        if expand_axis is not None and int(expand_axis) % rank == int(axis) % rank:
            addends.append(fg.inputs(expand)[0])
            expands.append(expand.name)
        elif int(axis) % rank == rank - 2:  # a position's rows kept as [..., 1, D] (checked as a term)
            addends.append(ref)
        else:
            return None  # concatenated blocks, not one row per position
        kept.append(addends[-1] == ref)
    return addends, int(axis) % rank, expands, kept


def match_stacked_positions(fg: FunctionGraph, node, site: Site) -> Site:
    """reduce_sum / reduce_mean(tf.stack([rows of ids[..., k] for k], axis), axis) (or tf.concat of them each
    expanded at axis): the per-position bag whatever the axis (a mean divided by the positions stacked)."""
    x, axis_ref = fg.inputs(node)
    axis, rank = fg.const_value(axis_ref), fg.shape(x).rank
    stacked = None if rank is None or axis is None or np.size(axis) != 1 else _stacked(fg, fg.producer(x), rank)
    if stacked is None:
        raise NotASite()
    addends, stacked_at, expands, kept = stacked
    terms = _candidate_terms(fg, addends, site, kept)
    if None in terms:
        raise Skip("tf.stack of per-position rows also stacks a tensor that is no position of the bag")
    if int(np.reshape(axis, [])) % rank != stacked_at:
        raise Skip("the stacked per-position rows are reduced over another axis than the one they are stacked on")
    site.expand_bag_axis = "keep_dims" in node.attr and node.attr["keep_dims"].b
    site.bag_unit_axis = stacked_at - rank
    if site.expand_bag_axis and site.bag_unit_axis not in (-2, -1):
        raise Skip(f"keepdims=True keeps the unit axis at {stacked_at}: the fused bag gets it back at -2 or -1 only")
    _positions_site(fg, node, site, terms, [fg.producer(x).name] + expands)
    check_private(fg, [x] + [Ref(n, 0) for n in expands], set(site.internal) | {node.name}, site)
    if site.shape_consumers:
        raise Skip("the shape of the stacked per-position rows is read")
    if node.op == "Mean":
        site.divide_by_bag, site.divisor = True, len(terms)
    return site


def _candidate_terms(fg: FunctionGraph, leaves: List[Ref], site: Site, kept=None) -> List[Optional[_Term]]:
    """Each leaf as a position term (kept: its unit axis kept) or None; NotASite unless two of them are
    positions of one ids tensor in one table (token + position embeddings, features of other tables: no bag)."""
    site.pattern = POSITIONS_PATTERN
    terms = [scaled_position_rows(fg, ref, site.function, bool(kept and kept[i]), _position_rows)
             for i, ref in enumerate(leaves)]
    groups = collections.Counter((t.ids[0], t.table) for t in terms if t is not None)
    if not groups or max(groups.values()) < 2:
        check_divided_positions(fg, leaves, site.function, _position_rows)  # reported: Skip
        raise NotASite()
    site.table = next(t for t in terms if t is not None).table.node
    return terms


def _positions_site(fg: FunctionGraph, node, site: Site, terms: List[_Term], own: List[str]) -> None:
    """Fills the site of the bag the terms make (positions a..b-1 each once) or raises Skip."""
    first = terms[0]
    site.weighted = first.weights is not None
    found = [_check_term(fg, t, first) for t in terms]
    sources = {_variable_read(fg, ref) for ref in found}  # m.v[k] reads the variable once per term
    if len(sources) != 1:
        raise Skip("the terms are weighted by entries of different tensors: only one weights tensor's w[..., k] "
                   "for each position ids[..., k] are a bag's weights")
    positions = sorted(t.ids[1] for t in terms)
    if positions[0] < 0:
        raise Skip(f"the terms take positions {positions} of the ids, counted from the end: ids a server feeds "
                   "wider or narrower than declared make them other positions, which the fused ids[..., a:b] "
                   "would not follow")
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise Skip(f"the terms take positions {positions} of the ids: not each position of a range once")
    widths = [{_unpacked_width(fg, t.position_ref) for t in terms} - {None},
              {_unpacked_width(fg, t.weights[0]) for t in terms if t.weights is not None} - {None}]
    if any(len(w) > 1 for w in widths):
        raise Skip("tf.unstack of the ids (or weights) with different lengths: the original refuses any ids")
    ids_source, weights_source = first.ids[0], found[0]
    shared = first.weights is not None and first.weights[2]  # v[k]: checked as v's shape against the ids'
    if site.weighted and not same_dims(fg.shape(weights_source), fg.shape(ids_source)) and not (
            shared and shared_by_bags(fg.shape(weights_source), fg.shape(ids_source))):
        raise Skip("the weights are not shaped like the ids")
    internal: List[str] = list(own)
    for term in terms:
        _gather_site(fg, site, term)
        internal.extend(term.site.internal + tuple(term.own))  # own: a scaled term's Muls (position_constants)
    site.weights = weights_source if site.weighted else None
    site.indices = ids_source
    constant_factor(fg, terms, site)  # rows[:, k] * w[:, k:k+1] * c: c one more factor of the weights
    if first.sliced is not None and site.table_shape[0] is None:
        raise Skip("the table's rows are unknown, so the ids the sliced rows gathered cannot be range-checked")
    if site.weighted and all(t.kept for t in terms):
        raise Skip("weighted positions taken as ids[..., k:k+1] (tf.concat's): the original sums the positions "
                   "the ids and the weights both have (one past either's width is empty, not refused): not fused")
    site.positions = PositionSpan(
        positions[0], positions[-1] + 1, first.wrapped, first.sliced is not None, *(min(w, default=None) for w in widths),
        ids_cast=None if first.cast is None else {k: v for k, v in first.cast.attr.items() if not k.startswith("_")},
        clamped=all(t.kept for t in terms))
    site.internal = tuple(dict.fromkeys(internal))
    check_private(fg, [t.ref for t in terms] + [p for t in terms for p in t.rows.private] +
                  [Ref(n, 0) for t in terms for n in t.own] + ([first.sliced] if first.sliced else []) +
                  _other_unpacked_rows(fg, terms), set(site.internal) | {node.name}, site)
    if site.shape_consumers or any(t.site.shape_consumers for t in terms):
        raise Skip("the shape of a position's gathered rows is read: it is not the shape of the bag's ids")
    site.dead_after += tuple({t.rows.gather.indices.node for t in terms} | {t.cast.name for t in terms if t.cast})
    ids_dims = dims(fg.shape(ids_source))
    site.gathered_shape = None if ids_dims is None else ids_dims[:-1] + [len(terms), site.table_shape[1]]
    site.intermediate_itemsizes = first.site.intermediate_itemsizes


def _other_unpacked_rows(fg: FunctionGraph, terms: List[_Term]) -> List[Ref]:
    """Every output of a tf.unstack of the rows the terms take: the unstack goes with the site, so
    no output of it may be read elsewhere (a position the sum does not add, relu(p[4]))."""
    unpacks = {fg.producer(t.position_ref).name for t in terms if t.sliced is not None}
    return [Ref(name, i) for name in unpacks if fg.nodes[name].op == "Unpack"
            for i in range(int(fg.nodes[name].attr["num"].i))]


def take_positions(fg: FunctionGraph, site: Site) -> None:
    """Before fusing a per-position sum: the op reads ids[..., a:b] (and w[..., a:b]), after an Assert
    that the ids have b positions (the composite's ids[..., b-1] refuses fewer; tf.unstack any other
    count than its own)."""
    span: PositionSpan = site.positions
    prefix = site.root + "/pkm_positions"
    rank = fg.shape(site.indices).rank
    if span.weighs_all and site.weights is not None:  # broadcast (or refused) whole, as the product was
        from pkm_serve.export.fuse import broadcast_against
        site.indices, site.weights = (broadcast_against(fg, prefix + "/ids_all", site.indices, site.weights),
                                      broadcast_against(fg, prefix + "/weights_all", site.weights, site.indices))
    checks = [] if span.clamped else [_width_check(fg, prefix + "/ids", site, site.indices, span.stop,
                                                   span.ids_width, "ids")]
    if site.weights is not None and not site.weights_scalar and (span.weights_width is not None or
                                                                  not span.weighs_all):  # w[:, k] refuses
        checks.append(_width_check(fg, prefix + "/weights", site, site.weights, span.stop, span.weights_width,
                                   "weights"))
    if span.gathers_all and not site.negative_ids_padding:  # a one-hot lookup's ids outside [0, N) are zero rows
        checks.append(_assert_every_id_in_range(fg, site, prefix + "/range_check", span.wrapped))
    site.indices = _positions(fg, prefix + "/ids", site.indices, span.first, span.stop, rank, checks)
    if span.ids_cast is not None:  # tf.cast(ids)[..., a:b] is what each tf.cast(ids[..., k]) took
        site.indices = fg.add_op(prefix + "/ids_cast", "Cast", [site.indices], span.ids_cast,
                                 shapes=[dims(fg.shape(site.indices))])
    if span.wrapped:  # as keras.ops.take does: where(ids < 0, ids + N, ids)
        site.indices = wrap_negative(fg, prefix + "/wrapped", site)
    if site.weights is not None and not site.weights_scalar:  # a scalar (a constant folded in) weighs every id
        site.weights = _positions(fg, prefix + "/weights", site.weights, span.first, span.stop,
                                  fg.shape(site.weights).rank, checks)


def _width_check(fg: FunctionGraph, prefix: str, site: Site, ref: Ref, stop: int, exact: Optional[int],
                 what: str) -> str:
    """An Assert that `ref` has at least `stop` positions (exactly `exact` where tf.unstack takes them)."""
    rank, dtype = fg.shape(ref).rank, DType(tensor_dtype(fg, ref))
    shape = fg.add_op(prefix + "/shape", "Shape", [ref], {"T": dtype, "out_type": I32}, shapes=[[None]])
    # The width as sum(shape * [0, .., 0, 1]): a StridedSlice of a Shape is folded to the declared K.
    one_hot = np.zeros([rank], np.int32)
    one_hot[-1] = 1
    width = fg.add_op(prefix + "/width", "Sum", [
        fg.add_op(prefix + "/last_only", "Mul", [shape, fg.add_const(prefix + "/last", one_hot)], {"T": I32},
                  shapes=[[rank]]),
        fg.add_const(prefix + "/axis", np.array(0, np.int32))], {"T": I32, "Tidx": I32, "keep_dims": False},
        shapes=[[]])
    bound = stop if exact is None else exact
    ok = fg.add_op(prefix + "/enough", "GreaterEqual" if exact is None else "Equal",
                   [width, fg.add_const(prefix + "/stop", np.array(bound, np.int32))], {"T": I32}, shapes=[[]])
    wanted = (f"reads position {stop - 1} ({what}[..., {stop - 1}]); send at least {stop}" if exact is None else
              f"takes exactly {exact} with tf.unstack; send {exact}")
    return _assert(fg, prefix + "/check", ok, f"per-position bag fused in {site.root}: the {what} have",
                   (width, types_pb2.DT_INT32), f"positions, but the original model {wanted}", "/message_positions")


def _assert_every_id_in_range(fg: FunctionGraph, site: Site, prefix: str, wrapped: bool) -> str:
    """Rows gathered once for every position and sliced: the composite's gather refuses an id outside
    [0, N) ([-N, N) for keras.ops.take) at any position, also those the sum does not read."""
    np_type = dtypes.as_dtype(site.index_dtype).as_numpy_dtype
    ids_type, rows = DType(site.index_dtype), site.table_shape[0]
    low, high = (-rows if wrapped else 0), rows
    smallest = _reduce_ids(fg, prefix + "/min", site.indices, ids_type, "Min", "/smallest")
    largest = _reduce_ids(fg, prefix + "/max", site.indices, ids_type, "Max", "/largest")
    ok = fg.add_op(prefix + "/both", "LogicalAnd", [
        fg.add_op(prefix + "/above", "GreaterEqual", [smallest, fg.add_const(prefix + "/low", np.array(low, np_type))],
                  {"T": ids_type}, shapes=[[]]),
        fg.add_op(prefix + "/below", "Less", [largest, fg.add_const(prefix + "/high", np.array(high, np_type))],
                  {"T": ids_type}, shapes=[[]])], {}, shapes=[[]])
    check = _assert(fg, prefix, ok, f"per-position bag fused in {site.root}: an id is out of range: the ids span",
                    (fg.add_op(prefix + "/span", "Pack", [smallest, largest], {"T": ids_type, "N": 2, "axis": 0},
                               shapes=[[2]]), site.index_dtype),
                    f"(smallest, largest), not within [{low}, {high}) (the original model gathers every id "
                    "before it slices the positions it sums, and refuses it)", "/message_range")
    return check


def _positions(fg: FunctionGraph, name: str, ref: Ref, first: int, stop: int, rank: int, checks: List[str]) -> Ref:
    """ref[..., first:stop], after the `checks`."""
    def const(suffix, value):
        return fg.add_const(f"{name}/{suffix}", np.array(value, np.int32))

    shape = fg.shape(ref)
    out = None if shape.rank is None else shape.as_list()[:-1] + [stop - first]
    whole = (1 << (rank - 1)) - 1
    return fg.add_op(name, "StridedSlice", [ref, const("begin", [0] * (rank - 1) + [first]),
                                            const("end", [0] * (rank - 1) + [stop]), const("strides", [1] * rank)],
                     {"T": DType(tensor_dtype(fg, ref)), "Index": I32, "begin_mask": whole, "end_mask": whole,
                      "ellipsis_mask": 0, "new_axis_mask": 0, "shrink_axis_mask": 0}, shapes=[out], control=checks)
