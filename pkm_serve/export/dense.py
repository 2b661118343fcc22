"""Dense sites: rows gathered from a 2-D table, reduced over the bag axis.

  GatherV2/ResourceGather [-> Cast] [-> Mul by w[..., None]] [-> tf.where(mask, rows, 0)]
      -> Sum / Mean over axis -2          (the steps above in any order, each at most once)
  GatherV2/ResourceGather -> Einsum('...k,...kd->...d' and equivalents)

Keras writes these too: `Embedding` is a gather, `mask_zero=True` +
`GlobalAveragePooling1D` is `where(mask, rows, 0)` summed and divided by the
mask's sum (the division stays; only the masked sum is fused), mixed precision
casts the rows, `keras.ops.take`/`keras.ops.sum` are gather/Sum.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
from tensorflow.python.framework import tensor_shape

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import (GATHER_OPS, INDEX_DTYPES, TABLE_DTYPES, NotASite, Site,
                                    Skip, check_private, dims, dtype_name, itemsize,
                                    same_dims, tensor_dtype, through_identity)


class Gather:
    """A row gather `table[indices]`, possibly behind Identity nodes."""

    def __init__(self, output: Ref, params: Ref, is_resource: bool, indices: Ref,
                 nodes: List[str], table_shape, dtype: int, index_dtype: int):
        self.output, self.params, self.is_resource = output, params, is_resource
        self.indices, self.nodes = indices, nodes
        self.table_shape, self.dtype, self.index_dtype = table_shape, dtype, index_dtype


def resolve_gather(fg: FunctionGraph, ref: Ref) -> Gather:
    """Raises NotASite unless `ref` is rows of a 2-D table gathered on axis 0."""
    nodes: List[str] = []
    ref = through_identity(fg, ref, nodes)
    node = fg.producer(ref)
    if node is None or node.op not in GATHER_OPS:
        raise NotASite()
    nodes.append(node.name)
    ins = fg.inputs(node)
    if node.attr["batch_dims"].i != 0:
        raise NotASite()
    if node.op == "ResourceGather":
        params, indices, is_resource = ins[0], ins[1], True
        dtype = node.attr["dtype"].type
        var = fg.variable_shape_dtype(params)
        table_shape = var[0] if var is not None else None
    else:
        params, indices, axis = ins
        axis_value = fg.const_value(axis)
        if axis_value is None or int(axis_value) != 0:
            raise NotASite()
        is_resource = False
        dtype = node.attr["Tparams"].type
        table_shape = fg.shape(params)
    index_dtype = node.attr["Tindices"].type
    if table_shape is None or table_shape.rank is None:
        # A resource passed through nested functions may have lost its handle
        # data: gathered rank = indices rank + 1 still proves a [N, D] table.
        out_shape, idx_shape = fg.shape(ref), fg.shape(indices)
        if out_shape.rank is not None and idx_shape.rank is not None and \
                out_shape.rank == idx_shape.rank + 1:
            table_shape = tensor_shape.TensorShape([None, out_shape[-1]])
    gathered = Gather(ref, params, is_resource, indices, nodes, table_shape, dtype,
                      index_dtype)
    if table_shape is None or table_shape.rank != 2:
        raise Skip("table is not known to be 2-D")
    if dtype not in TABLE_DTYPES:
        raise Skip(f"table dtype {dtype_name(dtype)} is not float32/float16/bfloat16")
    return gathered


def leads_to_gather(fg: FunctionGraph, ref: Ref, depth: int = 8) -> bool:
    """True if `ref` is gathered rows behind the steps resolve_rows accepts."""
    node = fg.producer(ref)
    if node is None or depth == 0:
        return False
    if node.op in GATHER_OPS:
        return True
    ins = fg.inputs(node)
    if node.op in ("Identity", "Cast"):
        return leads_to_gather(fg, ins[0], depth - 1)
    if node.op == "Mul":
        return any(leads_to_gather(fg, r, depth - 1) for r in ins)
    if node.op == "SelectV2":
        return any(leads_to_gather(fg, r, depth - 1) for r in ins[1:])
    return False


def strip_trailing_unit_axis(fg: FunctionGraph, ref: Ref, what: str = "multiplier"
                             ) -> Tuple[Ref, List[str]]:
    """w[..., None] / w[:, :, None] / expand_dims(w, -1) / reshape(w, shape+[1])
    -> (w, nodes)."""
    node = fg.producer(ref)
    out_shape = fg.shape(ref)
    reason = f"{what} is not per-index (broadcast on the last axis of the rows)"
    if node is None or out_shape.rank is None or out_shape.rank == 0 or \
            out_shape[-1] != 1:
        raise Skip(reason)
    ins = fg.inputs(node)
    if node.op == "ExpandDims":
        axis = fg.const_value(ins[1])
        if axis is not None and int(axis) in (-1, out_shape.rank - 1):
            return ins[0], [node.name]
    elif node.op == "StridedSlice" and _appends_unit_axis(fg, node, ins):
        return ins[0], [node.name]
    elif node.op == "Reshape":
        in_shape = fg.shape(ins[0])
        # [n] -> [n, 1] is exact whatever n is; higher ranks only when every dim
        # is known (a reshape could otherwise also permute the leading dims).
        if (in_shape.rank == 1 and out_shape.rank == 2) or (
                out_shape.is_fully_defined() and
                same_dims(in_shape.concatenate([1]), out_shape)):
            return ins[0], [node.name]
    raise Skip(reason)


def _appends_unit_axis(fg: FunctionGraph, node, ins) -> bool:
    """A StridedSlice that keeps every axis whole and adds one new last axis:
    x[..., None] or x[:, :, None]."""
    begin, strides = fg.const_value(ins[1]), fg.const_value(ins[3])
    if begin is None or strides is None or np.any(np.asarray(strides) != 1):
        return False
    masks = {k: node.attr[k].i for k in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    n = len(begin)
    if masks["shrink_axis_mask"] or masks["new_axis_mask"] != 1 << (n - 1):
        return False
    for i in range(n - 1):
        bit = 1 << i
        whole = masks["begin_mask"] & bit and masks["end_mask"] & bit
        if not (masks["ellipsis_mask"] & bit or whole):
            return False
    return True


def _is_zero(fg: FunctionGraph, ref: Ref) -> bool:
    value = fg.const_value(ref)
    return value is not None and value.size > 0 and not np.any(value)


class Rows:
    """Gathered rows on their way to a reduction, with what was done to them."""

    def __init__(self):
        self.gather: Optional[Gather] = None
        self.weights: Optional[Ref] = None
        self.mask: Optional[Ref] = None
        self.mask_keeps_true = True
        self.cast_enum = 0
        self.nodes: List[str] = []      # steps between gather and reduction
        self.private: List[Ref] = []    # their outputs: only the site may read them
        self.itemsizes: List[int] = []  # one per [..., K, D] tensor they build


def resolve_rows(fg: FunctionGraph, ref: Ref, site: Site) -> Rows:
    """Walks from the reduction's input down to the gather through at most one
    Cast, one Mul by per-index weights and one tf.where mask (in any order).
    Fills `site` as it learns, so a Skip reports what was found."""
    rows = Rows()
    while True:
        node = fg.producer(ref)
        if node is None:
            raise NotASite()
        ins = fg.inputs(node)
        if node.op in GATHER_OPS:
            rows.gather = resolve_gather(fg, ref)
            rows.private.append(rows.gather.output)
            rows.private.extend(Ref(n, 0) for n in rows.gather.nodes[:-1])
            rows.itemsizes.append(itemsize(rows.gather.dtype))
            return rows
        if node.op == "Identity":
            rows.nodes.append(node.name)
            rows.private.append(ref)
            ref = ins[0]
            continue
        if node.op == "Cast" and not rows.cast_enum:
            if node.attr["DstT"].type not in TABLE_DTYPES or not leads_to_gather(fg, ins[0]):
                raise NotASite()
            # Walking down, the first cast met is the outermost: its dtype is
            # what the reduction sees.
            rows.cast_enum = node.attr["DstT"].type
            site.cast_to = dtype_name(rows.cast_enum)
            step_input = ins[0]
        elif node.op == "Mul" and rows.weights is None:
            step_input = _resolve_weights(fg, ins, rows, site)
        elif node.op == "SelectV2" and rows.mask is None:
            step_input = _resolve_mask(fg, ins, rows, site)
        else:
            raise NotASite()
        rows.nodes.append(node.name)
        rows.private.append(ref)
        rows.itemsizes.append(itemsize(tensor_dtype(fg, ref)))
        ref = step_input


def _resolve_weights(fg: FunctionGraph, ins: List[Ref], rows: Rows, site: Site) -> Ref:
    """Mul(rows, w[..., None]): returns the rows side; records w."""
    problem = None
    for rows_ref, w_ref in ((ins[0], ins[1]), (ins[1], ins[0])):
        if not leads_to_gather(fg, rows_ref):
            continue
        site.weighted = True
        try:
            weights, strip_nodes = strip_trailing_unit_axis(fg, w_ref)
        except Skip as e:
            problem = e
            continue
        rows.weights = weights
        rows.nodes.extend(strip_nodes)
        return rows_ref
    if problem is not None:
        raise problem
    raise NotASite()


def _resolve_mask(fg: FunctionGraph, ins: List[Ref], rows: Rows, site: Site) -> Ref:
    """tf.where(mask[..., None], rows, 0) (or the mask inverted): returns the
    rows side; records the mask."""
    cond, then_ref, else_ref = ins
    if leads_to_gather(fg, then_ref):
        rows_ref, fill, keeps_true = then_ref, else_ref, True
    elif leads_to_gather(fg, else_ref):
        rows_ref, fill, keeps_true = else_ref, then_ref, False
    else:
        raise NotASite()
    site.masked = True
    if not _is_zero(fg, fill):
        raise Skip("tf.where fills masked rows with something other than a constant 0")
    mask, strip_nodes = strip_trailing_unit_axis(fg, cond, what="mask")
    rows.mask, rows.mask_keeps_true = mask, keeps_true
    rows.nodes.extend(strip_nodes)
    return rows_ref


def fill_from_gather(site: Site, gathered: Gather, fg: FunctionGraph) -> None:
    site.params, site.params_is_resource = gathered.params, gathered.is_resource
    site.indices, site.index_dtype, site.table_dtype = (
        gathered.indices, gathered.index_dtype, gathered.dtype)
    site.table = gathered.params.node
    table_node = fg.producer(gathered.params)
    if table_node is not None and table_node.op == "ReadVariableOp":
        site.table = fg.inputs(table_node)[0].node
    site.table_shape = dims(gathered.table_shape)
    site.dtype = dtype_name(gathered.dtype)
    site.gathered_shape = dims(fg.shape(gathered.output))
    if gathered.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(gathered.index_dtype)} is not int32/int64")


def match_reduce(fg: FunctionGraph, node, site: Site) -> Site:
    """Sum/Mean over the bag axis of (cast, weighted, masked) gathered rows."""
    site.combiner = "sum" if node.op == "Sum" else "mean"
    x, axis_ref = fg.inputs(node)
    rows = resolve_rows(fg, x, site)
    gathered = rows.gather
    fill_from_gather(site, gathered, fg)
    if rows.weights is not None:
        if not same_dims(fg.shape(rows.weights), fg.shape(gathered.indices)):
            raise Skip("weights shape %s does not match indices shape %s" % (
                fg.shape(rows.weights), fg.shape(gathered.indices)))
        site.weights = rows.weights
    if rows.mask is not None:
        if not same_dims(fg.shape(rows.mask), fg.shape(gathered.indices)):
            raise Skip("mask shape %s does not match indices shape %s" % (
                fg.shape(rows.mask), fg.shape(gathered.indices)))
        site.mask, site.mask_keeps_true = rows.mask, rows.mask_keeps_true
    site.cast_enum = rows.cast_enum if rows.cast_enum != gathered.dtype else 0
    site.internal = tuple(rows.nodes + gathered.nodes)
    site.intermediate_itemsizes = tuple(rows.itemsizes)
    check_private(fg, [x] + rows.private, set(site.internal) | {node.name})
    rank = fg.shape(x).rank
    if rank is None:
        raise Skip("rank of the gathered tensor is unknown")
    if node.attr["keep_dims"].b:
        raise Skip("reduction keeps dims (keepdims=True)")
    axes = fg.const_value(axis_ref)
    if axes is None or np.size(axes) != 1:
        raise Skip("reduction is not over exactly one constant axis")
    if int(np.reshape(axes, [])) % rank != rank - 2:
        raise Skip(f"reduction axis {int(np.reshape(axes, []))} is not the bag axis "
                   f"(-2) of a rank-{rank} gather")
    if node.op == "Mean" and (site.weights is not None or site.mask is not None):
        # mean over K of w*x is the sum with weights w / K: fused as the sum,
        # then divided by K exactly as Mean does.
        bag_size = fg.shape(x)[-2]
        if bag_size is None:
            raise Skip("weighted or masked reduce_mean over a bag of unknown size K "
                       "(it divides by K, which the graph does not fix)")
        site.combiner, site.divisor = "sum", int(bag_size)
    return site


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
    for g_pos in range(len(ins)):
        try:
            gathered = resolve_gather(fg, ins[g_pos])
            break
        except NotASite:
            continue
    else:
        raise NotASite()
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


def unrecognised_reason(fg: FunctionGraph, node, depth: int = 3) -> Optional[str]:
    """For a Sum/Mean over axis -2 that is not a site: if float rows of a
    table are gathered a few same-rank steps above it ([..., K, D] all the
    way), the reason it was not taken, so no bag-like reduction is silent."""
    x, axis_ref = fg.inputs(node)[:2]
    rank = fg.shape(x).rank
    axes = fg.const_value(axis_ref)
    if rank is None or rank < 2 or axes is None or np.size(axes) != 1 or \
            int(np.reshape(axes, [])) % rank != rank - 2:
        return None  # not over a bag axis: e.g. a LayerNorm mean over D after an embedding
    frontier = [(x, [])]
    for _ in range(depth):
        next_frontier = []
        for ref, path in frontier:
            producer = fg.producer(ref)
            if producer is None or fg.shape(ref).rank != rank:
                continue
            if producer.op in GATHER_OPS:
                dtype = producer.attr["dtype" if producer.op == "ResourceGather"
                                      else "Tparams"].type
                if dtype not in TABLE_DTYPES:
                    continue
                if not path:
                    return "the gather is not a row gather (axis 0, batch_dims 0)"
                steps = " -> ".join(reversed(path))
                return (f"{steps} between the gather and the reduction: only a cast, a "
                        "per-index multiply and a tf.where mask are fused")
            for r in fg.inputs(producer):
                next_frontier.append((r, path + [producer.op]))
        frontier = next_frontier
    return None
