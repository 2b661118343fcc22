"""Einsum sites: GatherV2/ResourceGather -> Einsum('...k,...kd->...d' and
equivalent spellings), weighted or not; and its matmul spelling,
tf.matmul(w[..., None, :], rows) = the weighted bag with a unit axis before D."""
from __future__ import annotations

from typing import List

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.dense import (Gather, adds_unit_axis, fill_from_gather, leads_to_gather, resolve_gather,
                                    strip_trailing_unit_axis)
from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.one_hot_lookup import pooled_one_hot_einsum
from pkm_serve.export.sites import (NotASite, Site, Skip, check_private, itemsize, same_dims, shared_by_bags,
                                    tensor_dtype)


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
    pooled_one_hot = pooled_one_hot_einsum(fg, node, Gather)
    if pooled_one_hot is not None:  # 'bkn,nd->bd': the one-hot rows' einsum 'bkd->bd', the table no operand
        gathered, rows_labels = pooled_one_hot
        terms, ins = [rows_labels], [gathered.output]
    skipped = None  # an operand that is a gather of something else (a 1-D weight table)
    for g_pos in range(len(ins)):
        if pooled_one_hot is not None:
            break
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
    if pooled_one_hot is not None:  # the rows [..., D] the one-hot [..., N] stands for
        site.gathered_shape = site.gathered_shape[:-1] + site.table_shape[1:] if site.gathered_shape else None
    g_labels = _einsum_labels(terms[g_pos])
    out_labels = _einsum_labels(out)
    reason = f"einsum '{equation}' is not a weighted sum over the bag axis"
    site.weighted = len(ins) == 2
    if len(g_labels) < 2 or len(set(g_labels)) != len(g_labels):
        raise Skip(reason)
    bag, dim = g_labels[-2], g_labels[-1]
    # 'bfkd->bd': the bag axis and those just before it summed, one bag of their ids (flat_bags.py)
    pooled = len(g_labels) - len(out_labels)
    if "..." in g_labels[-1 - pooled:] or pooled < 1 or out_labels != g_labels[:-1 - pooled] + [dim]:
        raise Skip(reason)
    site.flatten_bag_axes = pooled
    if "..." not in g_labels and fg.shape(ins[g_pos]).rank not in (None, len(g_labels)):
        raise Skip(reason)
    if len(ins) == 2:
        w_ref = ins[1 - g_pos]
        w_labels = _einsum_labels(terms[1 - g_pos])
        # w's labels: the ids' (per index), or their last ones down to the bag's (positional
        # weights every bag shares: 'bkd,k->bd'), which fuse broadcasts to the ids
        shared = w_labels != g_labels[:-1] and 0 < len(w_labels) < len(g_labels) - 1 and \
            "..." not in w_labels and w_labels == g_labels[len(g_labels) - 1 - len(w_labels):-1]
        if (w_labels != g_labels[:-1] and not shared) or (pooled > 1 and shared):
            raise Skip(reason)
        if not same_dims(fg.shape(w_ref), fg.shape(gathered.indices)) and not (
                shared and shared_by_bags(fg.shape(w_ref), fg.shape(gathered.indices))):
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
    ([..., 1, K]; or w[..., None] [..., K, 1] with adj_x) is sum_k w[..., k] *
    rows[..., k, :] kept as [..., 1, D]: the weighted bag, then expand_dims(-2).
    Its transpose, matmul(rows, w[..., None], adj_x) or matvec(rows, w,
    transpose_a=True), is the bag as [..., D, 1] (_match_rows_transposed).
    Any other matmul of gathered rows is reported."""
    x, y = fg.inputs(node)[:2]
    if not leads_to_gather(fg, y):
        return _match_rows_transposed(fg, node, site)
    out = fg.shape(Ref(node.name, 0))
    if out.rank is None or out.rank < 2 or out[-2] != 1:
        raise NotASite()  # not one row pooled from the rows (a Dense layer on them, attention)
    site.weighted = True
    reason = ("a matmul of gathered rows that is not w[..., None, :] @ rows (a weighted bag) nor v[None, None, :] "
              "@ rows (positional weights, each batch axis 1 or, statically, the ids' own)")
    adj_x, adj_y = _adjoints(node)
    gathered = _gathered_rows_or_skip(fg, node, y, adj_y, site, reason)
    if adj_x:  # matmul(w[..., None], rows, adjoint_a=True)
        w, nodes, site.weights_squeeze = strip_trailing_unit_axis(fg, x, "weights")
    else:
        w, nodes = _unit_axis_before_last(fg, x)
        if w is None:  # v[None, None, :] @ rows: one weight per position, every bag's
            w, nodes = _row_every_bag_shares(fg, x, gathered.indices, fg.shape(y).rank)
        if w is None and _unit_axes_then_positions(fg, x, gathered.indices, fg.shape(y).rank):
            w, nodes, site.weights_to_vector = x, [], True  # a [1, 1, K] constant or variable: read as [K]
        if w is None and _unit_row(fg, x, fg.shape(y).rank):
            w, nodes, site.weights_unit_row = x, [], True  # [..., 1, K] of any making: read without axis -2
    if w is None:
        raise Skip(reason)
    return _fill_weighted(fg, site, gathered, w, nodes, [gathered.output] + ([] if site.weights_squeeze else [x]), -2)


def _adjoints(node):
    """(adjoint x, adjoint y); read with `in`: indexing a NodeDef's attr map adds the key."""
    transposed = ("transpose_a", "transpose_b") if node.op == "MatMul" else ("adj_x", "adj_y")
    return tuple(a in node.attr and node.attr[a].b for a in transposed)


def _gathered_rows_or_skip(fg: FunctionGraph, node, rows: Ref, adj_y: bool, site: Site, reason: str):
    """The gather behind `rows`, filled into `site`; Skip(reason) for an adjoint second operand,
    mixed operand types or rows that are no gather."""
    if adj_y or not _same_types(node):
        raise Skip(reason)
    try:
        gathered = resolve_gather(fg, rows)
    except NotASite:
        raise Skip(reason) from None
    fill_from_gather(site, gathered, fg)
    return gathered


def _same_types(node) -> bool:
    return node.op != "BatchMatMulV3" or len({node.attr[a].type for a in ("Ta", "Tb", "Tout")}) == 1


def _match_rows_transposed(fg: FunctionGraph, node, site: Site) -> Site:
    """matmul(rows, w[..., None], adj_x) or matmul(transpose(rows), w[..., None])
    ([..., D, K] @ [..., K, 1]) is the weighted bag as [..., D, 1]."""
    x, y = fg.inputs(node)[:2]
    adj_x, adj_y = _adjoints(node)
    nodes, rows = [], x
    producer = fg.producer(x)
    if not adj_x and producer is not None and producer.op == "Transpose" and _swaps_last_two(fg, producer):
        nodes, rows = [producer.name], fg.inputs(producer)[0]
    elif not adj_x:
        raise NotASite()  # rows @ v: each row scored (attention), no pooling
    out = fg.shape(Ref(node.name, 0))
    if not leads_to_gather(fg, rows) or out.rank is None or out.rank < 2 or out[-1] != 1:
        raise NotASite()
    site.weighted = True
    reason = "a matmul of transposed gathered rows that is not rows^T @ w[..., None] (a weighted bag)"
    gathered = _gathered_rows_or_skip(fg, node, rows, adj_y, site, reason)
    w, w_nodes, site.weights_squeeze = strip_trailing_unit_axis(fg, y, "weights")
    private = [gathered.output, x] + ([] if site.weights_squeeze else [y])
    return _fill_weighted(fg, site, gathered, w, nodes + w_nodes, private, -1)


def _swaps_last_two(fg: FunctionGraph, transpose) -> bool:
    perm = fg.const_value(fg.inputs(transpose)[1])
    if perm is None or perm.ndim != 1 or len(perm) < 2:
        return False
    rank = len(perm)
    return [int(p) for p in perm] == list(range(rank - 2)) + [rank - 1, rank - 2]


def _fill_weighted(fg: FunctionGraph, site: Site, gathered, w: Ref, nodes: List[str], private: List[Ref],
                   unit_axis: int) -> Site:
    """The weighted bag of a matmul site, its unit axis put back at `unit_axis`."""
    w_shape = fg.shape(w)[-1:] if site.weights_to_vector else fg.shape(w)
    if site.weights_unit_row:
        w_shape = w_shape[:-2].concatenate(w_shape[-1:])
    if site.weights_squeeze and w_shape.rank:
        w_shape = w_shape[:-1]
    if not same_dims(w_shape, fg.shape(gathered.indices)) and not shared_by_bags(w_shape, fg.shape(gathered.indices)):
        raise Skip("weights shape %s does not match indices shape %s" % (
            w_shape, fg.shape(gathered.indices)))
    site.weights, site.expand_bag_axis, site.bag_unit_axis = w, True, unit_axis
    site.internal = tuple(gathered.nodes + nodes)
    site.intermediate_itemsizes = (itemsize(gathered.dtype),)
    private = private + [Ref(n, 0) for n in gathered.nodes[:-1]]
    check_private(fg, private, set(site.internal) | {site.root})
    return site


def _row_every_bag_shares(fg: FunctionGraph, ref: Ref, ids: Ref, rows_rank):
    """(v, nodes) where `ref` ([1, .., 1, K], no more axes than the rows, each batch axis 1 or the ids'
    own) is positional weights v ([K] or [1, K]) given unit axes (or broadcast over the batch); (None, [])
    otherwise. The matmul then weighs every bag's position k by v[k]: shared_by_bags' weights."""
    out, ids_shape = fg.shape(ref), fg.shape(ids)
    if out.rank is None or ids_shape.rank is None or rows_rank != ids_shape.rank + 1 or \
            not 2 <= out.rank <= rows_rank or out[-2] != 1:
        return None, []
    # Each batch axis 1 or the ids' own, statically: a broadcast to a batch of its own would be other bags.
    batch = zip(out.as_list()[:-2][::-1], ids_shape.as_list()[:-1][::-1])
    if not all(d == 1 or (d is not None and d == i) for d, i in batch):
        return None, []
    nodes, node = [], fg.producer(ref)
    while node is not None and _keeps_the_last_axis(fg, node):
        nodes.append(node.name)
        ref = fg.inputs(node)[0]
        # Only [K] / [1, .., K] sources: unit axes added elsewhere than -2 would align others with other axes.
        if shared_by_bags(fg.shape(ref), ids_shape) and all(d == 1 for d in fg.shape(ref).as_list()[:-1]):
            return ref, nodes
        node = fg.producer(ref)
    return None, []


def _unit_axes_then_positions(fg: FunctionGraph, ref: Ref, ids: Ref, rows_rank) -> bool:
    """`ref` is [1, .., 1, K] (K the ids' positions), no more axes than the rows: positional weights."""
    shape, ids_shape = fg.shape(ref), fg.shape(ids)
    return shape.rank is not None and rows_rank is not None and ids_shape.rank is not None and \
        rows_rank == ids_shape.rank + 1 and 2 <= shape.rank <= rows_rank and \
        all(d == 1 for d in shape.as_list()[:-1]) and same_dims(shape[-1:], ids_shape[-1:])


def _unit_row(fg: FunctionGraph, ref: Ref, rows_rank) -> bool:
    """`ref` is [..., 1, K] of the rows' rank, whatever made it (tf.broadcast_to(v, [tf.shape(ids)[0], 1, K]),
    a computed row): the matmul weighs bag b's position k by ref[b, 0, k], broadcasting its batch axes
    against the rows' as the op's ids and weights are broadcast."""
    shape = fg.shape(ref)
    return shape.rank is not None and shape.rank == rows_rank and shape.rank >= 2 and shape[-2] == 1


def unit_row_weights(fg: FunctionGraph, site: Site) -> None:
    """Before fusing a matmul site whose weights are [..., 1, K]: the op reads them as [..., K] (a Reshape
    to their run-time shape less axis -2)."""
    prefix = site.root + "/pkm_unit_row_weights"
    i32 = DType(types_pb2.DT_INT32)
    shape = fg.shape(site.weights).as_list()

    def part(name, begin, end, begin_mask, end_mask):
        consts = [fg.add_const(f"{prefix}/{name}_{k}", np.array([v], np.int32))
                  for k, v in (("begin", begin), ("end", end), ("strides", 1))]
        return fg.add_op(f"{prefix}/{name}", "StridedSlice", [full] + consts,
                         {"T": i32, "Index": i32, "begin_mask": begin_mask, "end_mask": end_mask, "ellipsis_mask": 0,
                          "new_axis_mask": 0, "shrink_axis_mask": 0}, shapes=[[None]])
    full = fg.add_op(prefix + "/shape", "Shape", [site.weights], {"T": DType(tensor_dtype(fg, site.weights)),
                                                                  "out_type": i32}, shapes=[[len(shape)]])
    target = fg.add_op(prefix + "/target", "ConcatV2", [part("batch", 0, -2, 1, 0), part("positions", -1, 0, 0, 1),
                                                        fg.add_const(prefix + "/axis", np.array(0, np.int32))],
                       {"N": 2, "T": i32, "Tidx": i32}, shapes=[[len(shape) - 1]])
    site.weights = fg.add_op(prefix, "Reshape", [site.weights, target], {
        "T": DType(tensor_dtype(fg, site.weights)), "Tshape": i32}, shapes=[shape[:-2] + shape[-1:]])
    site.weights_unit_row = False


def positional_weights_as_vector(fg: FunctionGraph, site: Site) -> None:
    """Before fusing a matmul site whose weights are [1, .., 1, K]: the op reads them reshaped to [K]."""
    site.weights = fg.add_op(site.root + "/pkm_positional_weights", "Reshape", [
        site.weights, fg.add_const(site.root + "/pkm_positional_weights/shape", np.array([-1], np.int32))],
        {"T": DType(tensor_dtype(fg, site.weights)), "Tshape": DType(types_pb2.DT_INT32)},
        shapes=[fg.shape(site.weights).as_list()[-1:]])


def _keeps_the_last_axis(fg: FunctionGraph, node) -> bool:
    """`node` only adds unit axes before its input's last axis, or broadcasts the axes before it."""
    ins = fg.inputs(node)
    x_shape, out = (fg.shape(ins[0]) if ins else None), fg.shape(Ref(node.name, 0))
    if x_shape is None or x_shape.rank is None or out.rank is None or x_shape.rank == 0 or \
            not same_dims(x_shape[-1:], out[-1:]):
        return False
    if node.op == "ExpandDims":
        axis = fg.const_value(ins[1])
        return axis is not None and int(axis) % out.rank != out.rank - 1
    if node.op == "BroadcastTo":
        return x_shape[-1] is not None and x_shape[-1] != 1  # the last axis is not broadcast
    if node.op == "Reshape":
        kept = [d for d in x_shape.as_list() if d != 1]
        return None not in x_shape.as_list() + out.as_list() and kept == [d for d in out.as_list() if d != 1]
    if node.op != "StridedSlice":
        return False
    begin, strides = fg.const_value(ins[1]), fg.const_value(ins[3])
    masks = {k: node.attr[k].i if k in node.attr else 0 for k in (
        "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
    if begin is None or strides is None or np.any(np.asarray(strides) != 1) or masks["shrink_axis_mask"]:
        return False
    entries = len(np.ravel(begin))
    if masks["new_axis_mask"] & (1 << (entries - 1)):
        return False  # a unit axis added last: the last axis is no longer the positions
    whole = masks["begin_mask"] & masks["end_mask"]
    return all(masks["ellipsis_mask"] & (1 << i) or masks["new_axis_mask"] & (1 << i) or whole & (1 << i)
               for i in range(entries))


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



def check_labelled_weights(fg: FunctionGraph, site: Site) -> None:
    """Before fusing a weighted einsum ('bk,bkd->bd', 'bfk,bfkd->bd'): tf.einsum broadcasts no labelled axis
    (weights fed [B, 1] or [1, K] are refused), the fused op's broadcast to the ids would; so an Assert that
    the weights' labelled axes are the ids' (an ellipsis before them broadcasts, as in the einsum)."""
    root = fg.nodes[site.root]
    if site.weights is None or site.weights_scalar or "equation" not in root.attr or \
            fg.shape(site.weights).rank is None or fg.shape(site.weights).rank != fg.shape(site.indices).rank:
        return
    lhs = root.attr["equation"].s.decode().replace(" ", "").split("->")[0].split(",")
    ins = fg.inputs(root)
    if len(ins) != 2 or site.weights not in ins:
        return
    labels = _einsum_labels(lhs[ins.index(site.weights)])
    if "..." in labels[1:]:
        return  # labels before an ellipsis: not checked here
    from pkm_serve.export.flat_bags import after, assert_same_labelled_axes
    from pkm_serve.export.id_checks import assert_ids_rank
    rank_check = assert_ids_rank(fg, site, site.indices)  # first: ids of another rank get its message
    if rank_check is not None:
        site.indices = after(fg, site.root + "/pkm_einsum_ids_rank_checked", site.indices, rank_check)
        site.weights = after(fg, site.root + "/pkm_einsum_weights_rank_checked", site.weights, rank_check)
    labelled = len(labels) - (1 if labels and labels[0] == "..." else 0)
    check = assert_same_labelled_axes(fg, site, site.root + "/pkm_einsum_axes_check", labelled)
    site.weights = after(fg, site.root + "/pkm_einsum_weights_checked", site.weights, check)
