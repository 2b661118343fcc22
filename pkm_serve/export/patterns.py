"""Finds composite gather-sum sites in a FunctionDef and fuses them.

A site is a reduction over the bag axis whose input is (a weighted) row
gather from a 2-D table:

  dense   GatherV2/ResourceGather -> [Mul by w[..., None]] -> Sum/Mean(axis=-2)
          GatherV2/ResourceGather -> Einsum('...k,...kd->...d' and equivalents)
  sparse  tf.nn.(safe_)embedding_lookup_sparse: Unique -> gather -> SparseSegment*
          or gather -> Mul by reshaped weights -> SegmentSum [-> DivNoNan]

Dense sites become `PkmEmbeddingBag`, sparse ones `PkmRaggedEmbeddingBag` fed
by row_splits computed from the (sorted) segment ids. The fused node takes
the name of the site's last node, so every consumer keeps pointing at it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes, op_def_registry, tensor_shape

from pkm_serve.export.graph import DType, FunctionGraph, Ref

DENSE_OP = "PkmEmbeddingBag"
RAGGED_OP = "PkmRaggedEmbeddingBag"
TABLE_DTYPES = (types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
INDEX_DTYPES = (types_pb2.DT_INT32, types_pb2.DT_INT64)
_SPARSE_SEGMENT_COMBINERS = {
    "SparseSegmentSum": "sum", "SparseSegmentMean": "mean", "SparseSegmentSqrtN": "sqrtn"}


@dataclasses.dataclass
class Site:
    """One composite site: what was found, and whether it was fused."""

    function: str
    root: str                 # name of the node the fused op replaces
    pattern: str              # gather-reduce | einsum | embedding_lookup_sparse
    combiner: str = "sum"
    weighted: bool = False
    table: str = ""           # resource arg or tensor feeding the gather
    table_shape: Optional[List[Optional[int]]] = None
    dtype: str = ""
    gathered_shape: Optional[List[Optional[int]]] = None
    status: str = "skipped"   # fused | skipped
    reason: str = ""
    bytes_per_index: Optional[int] = None   # intermediates per looked-up row
    saved_bytes_at_batch: Optional[int] = None
    # Internal, not reported:
    params: Optional[Ref] = None
    params_is_resource: bool = False
    indices: Optional[Ref] = None
    weights: Optional[Ref] = None
    segment_ids: Optional[Ref] = None
    internal: Tuple[str, ...] = ()   # nodes only the site uses (removed on fusion)
    index_dtype: int = 0
    table_dtype: int = 0

    def to_json(self) -> dict:
        keep = ("function", "root", "pattern", "combiner", "weighted", "table",
                "table_shape", "dtype", "gathered_shape", "status", "reason",
                "bytes_per_index", "saved_bytes_at_batch")
        return {k: getattr(self, k) for k in keep}


class _NotASite(Exception):
    """The candidate node is not fed by a row gather at all (not reported)."""


class _Skip(Exception):
    """A site was found but cannot be fused; the message is the reason."""


def _dims(shape) -> Optional[List[Optional[int]]]:
    return None if shape.rank is None else shape.as_list()


def _same_dims(a, b) -> bool:
    """Equal rank and, per dim, both known and equal or both unknown: anything
    looser could hide a runtime broadcast that the fused op would not do."""
    if a.rank is None or b.rank is None or a.rank != b.rank:
        return False
    return all(x == y for x, y in zip(a.as_list(), b.as_list()))


def _dtype_name(enum: int) -> str:
    return dtypes.as_dtype(enum).name


class _Gather:
    """A row gather `table[indices]`, possibly behind Identity nodes."""

    def __init__(self, output: Ref, params: Ref, is_resource: bool, indices: Ref,
                 nodes: List[str], table_shape, dtype: int, index_dtype: int):
        self.output, self.params, self.is_resource = output, params, is_resource
        self.indices, self.nodes = indices, nodes
        self.table_shape, self.dtype, self.index_dtype = table_shape, dtype, index_dtype


def _through_identity(fg: FunctionGraph, ref: Ref, nodes: List[str]) -> Ref:
    node = fg.producer(ref)
    while node is not None and node.op == "Identity":
        nodes.append(node.name)
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    return ref


def _resolve_gather(fg: FunctionGraph, ref: Ref) -> _Gather:
    """Raises _NotASite unless `ref` is rows of a 2-D table gathered on axis 0."""
    nodes: List[str] = []
    ref = _through_identity(fg, ref, nodes)
    node = fg.producer(ref)
    if node is None or node.op not in ("ResourceGather", "GatherV2"):
        raise _NotASite()
    nodes.append(node.name)
    ins = fg.inputs(node)
    if node.attr["batch_dims"].i != 0:
        raise _NotASite()
    if node.op == "ResourceGather":
        params, indices, is_resource = ins[0], ins[1], True
        dtype = node.attr["dtype"].type
        var = fg.variable_shape_dtype(params)
        table_shape = var[0] if var is not None else None
    else:
        params, indices, axis = ins
        axis_value = fg.const_value(axis)
        if axis_value is None or int(axis_value) != 0:
            raise _NotASite()
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
    gathered = _Gather(ref, params, is_resource, indices, nodes, table_shape, dtype,
                       index_dtype)
    if table_shape is None or table_shape.rank != 2:
        raise _Skip("table is not known to be 2-D")
    if dtype not in TABLE_DTYPES:
        raise _Skip(f"table dtype {_dtype_name(dtype)} is not float32/float16/bfloat16")
    return gathered


def _strip_trailing_unit_axis(fg: FunctionGraph, ref: Ref) -> Tuple[Ref, List[str]]:
    """w[..., None] / expand_dims(w, -1) / reshape(w, shape+[1]) -> (w, nodes)."""
    node = fg.producer(ref)
    out_shape = fg.shape(ref)
    if node is None or out_shape.rank is None or out_shape.rank == 0 or \
            out_shape[-1] != 1:
        raise _Skip("multiplier is not per-index weights broadcast on the last axis")
    ins = fg.inputs(node)
    if node.op == "ExpandDims":
        axis = fg.const_value(ins[1])
        if axis is not None and int(axis) in (-1, out_shape.rank - 1):
            return ins[0], [node.name]
    elif node.op == "StridedSlice":
        masks = {k: node.attr[k].i for k in (
            "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
        begin = fg.const_value(ins[1])
        if begin is not None and len(begin) == 2 and masks["ellipsis_mask"] == 1 and \
                masks["new_axis_mask"] == 2 and masks["shrink_axis_mask"] == 0:
            return ins[0], [node.name]
    elif node.op == "Reshape":
        in_shape = fg.shape(ins[0])
        # [n] -> [n, 1] is exact whatever n is; higher ranks only when every dim
        # is known (a reshape could otherwise also permute the leading dims).
        if (in_shape.rank == 1 and out_shape.rank == 2) or (
                out_shape.is_fully_defined() and
                _same_dims(in_shape.concatenate([1]), out_shape)):
            return ins[0], [node.name]
    raise _Skip("multiplier is not per-index weights broadcast on the last axis")


def _check_private(fg: FunctionGraph, refs: List[Ref], site_nodes: set) -> None:
    """Each intermediate must be used by the site alone, or fusing saves nothing."""
    for ref in refs:
        if ref in fg.returned:
            raise _Skip(f"intermediate {fg.render(ref)} is also a function output")
        for consumer, _ in fg.consumers(ref):
            if consumer not in site_nodes:
                raise _Skip(f"gathered tensor {fg.render(ref)} has another consumer "
                            f"({consumer}); fusing it would not save memory")


def _fill(site: Site, gathered: _Gather, fg: FunctionGraph) -> None:
    site.params, site.params_is_resource = gathered.params, gathered.is_resource
    site.indices, site.index_dtype, site.table_dtype = (
        gathered.indices, gathered.index_dtype, gathered.dtype)
    site.table = gathered.params.node
    table_node = fg.producer(gathered.params)
    if table_node is not None and table_node.op == "ReadVariableOp":
        site.table = fg.inputs(table_node)[0].node
    site.table_shape = _dims(gathered.table_shape)
    site.dtype = _dtype_name(gathered.dtype)
    site.gathered_shape = _dims(fg.shape(gathered.output))
    if gathered.index_dtype not in INDEX_DTYPES:
        raise _Skip(f"index dtype {_dtype_name(gathered.index_dtype)} is not int32/int64")


def _bytes(site: Site, batch_size: int, copies: int) -> None:
    """Bytes of the [.., K, D] intermediates the fused op no longer builds."""
    item = dtypes.as_dtype(site.table_dtype).size
    dim = site.table_shape[1] if site.table_shape else None
    if dim is not None:
        site.bytes_per_index = copies * dim * item
    shape = site.gathered_shape
    if site.pattern == "embedding_lookup_sparse" or not shape:
        return  # number of ids per batch depends on the input
    dims = [batch_size if (i == 0 and d is None) else d for i, d in enumerate(shape)]
    if all(d is not None for d in dims):
        site.saved_bytes_at_batch = int(np.prod(dims)) * item * copies


def _match_reduce(fg: FunctionGraph, node) -> Site:
    site = Site(function=fg.fdef.signature.name, root=node.name, pattern="gather-reduce",
                combiner="sum" if node.op == "Sum" else "mean")
    x, axis_ref = fg.inputs(node)
    producer = fg.producer(x)
    internal, private = [], []
    weights = None
    if producer is not None and producer.op == "Mul":
        a, b = fg.inputs(producer)
        for g_ref, w_ref in ((a, b), (b, a)):
            try:
                gathered = _resolve_gather(fg, g_ref)
                break
            except _NotASite:
                continue
        else:
            raise _NotASite()
        _fill(site, gathered, fg)
        internal.append(producer.name)
        private.append(x)
        weights, strip_nodes = _strip_trailing_unit_axis(fg, w_ref)
        internal.extend(strip_nodes)
        if not _same_dims(fg.shape(weights), fg.shape(gathered.indices)):
            raise _Skip("weights shape %s does not match indices shape %s" % (
                fg.shape(weights), fg.shape(gathered.indices)))
        if node.op == "Mean":
            raise _Skip("weighted Mean over the bag axis divides by K, not by the "
                        "weight sum: no PkmEmbeddingBag combiner computes it")
    else:
        gathered = _resolve_gather(fg, x)
        _fill(site, gathered, fg)
    internal.extend(gathered.nodes)
    private.append(gathered.output)
    private.extend(Ref(n, 0) for n in gathered.nodes[:-1])
    site.weighted = weights is not None
    site.weights = weights
    site.internal = tuple(internal)
    _check_private(fg, private, set(internal) | {node.name})
    rank = fg.shape(x).rank
    if rank is None:
        raise _Skip("rank of the gathered tensor is unknown")
    if node.attr["keep_dims"].b:
        raise _Skip("reduction keeps dims (keepdims=True)")
    axes = fg.const_value(axis_ref)
    if axes is None or np.size(axes) != 1:
        raise _Skip("reduction is not over exactly one constant axis")
    if int(np.reshape(axes, [])) % rank != rank - 2:
        raise _Skip(f"reduction axis {int(np.reshape(axes, []))} is not the bag axis "
                    f"(-2) of a rank-{rank} gather")
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


def _match_einsum(fg: FunctionGraph, node) -> Site:
    equation = node.attr["equation"].s.decode().replace(" ", "")
    ins = fg.inputs(node)
    if "->" not in equation or len(ins) not in (1, 2):
        raise _NotASite()
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    for g_pos in range(len(ins)):
        try:
            gathered = _resolve_gather(fg, ins[g_pos])
            break
        except _NotASite:
            continue
    else:
        raise _NotASite()
    site = Site(function=fg.fdef.signature.name, root=node.name, pattern="einsum")
    _fill(site, gathered, fg)
    g_labels = _einsum_labels(terms[g_pos])
    out_labels = _einsum_labels(out)
    reason = f"einsum '{equation}' is not a weighted sum over the bag axis"
    if len(g_labels) < 2 or len(set(g_labels)) != len(g_labels):
        raise _Skip(reason)
    bag, dim = g_labels[-2], g_labels[-1]
    if "..." in (bag, dim) or out_labels != g_labels[:-2] + [dim]:
        raise _Skip(reason)
    if "..." not in g_labels and fg.shape(ins[g_pos]).rank not in (None, len(g_labels)):
        raise _Skip(reason)
    internal = list(gathered.nodes)
    if len(ins) == 2:
        w_ref = ins[1 - g_pos]
        if _einsum_labels(terms[1 - g_pos]) != g_labels[:-1]:
            raise _Skip(reason)
        if not _same_dims(fg.shape(w_ref), fg.shape(gathered.indices)):
            raise _Skip("weights shape %s does not match indices shape %s" % (
                fg.shape(w_ref), fg.shape(gathered.indices)))
        site.weights, site.weighted = w_ref, True
    site.internal = tuple(internal)
    private = [gathered.output] + [Ref(n, 0) for n in gathered.nodes[:-1]]
    _check_private(fg, private, set(internal) | {node.name})
    return site


def _resolve_sparse_rows(fg: FunctionGraph, ref: Ref):
    """Rows `table[ids]` as built by embedding_lookup_sparse: either a direct
    gather, or gather(table, unique.y) re-gathered by unique.idx.
    Returns (gather, ids, nodes, private refs)."""
    nodes: List[str] = []
    ref = _through_identity(fg, ref, nodes)
    node = fg.producer(ref)
    if node is not None and node.op == "GatherV2":
        ins = fg.inputs(node)
        axis = fg.const_value(ins[2])
        unique = fg.producer(ins[1])
        if unique is not None and unique.op == "Unique" and ins[1].index == 1 and \
                axis is not None and int(axis) == 0:
            inner = _resolve_gather(fg, ins[0])
            if inner.indices == Ref(unique.name, 0):
                private = [ref, inner.output] + [Ref(n, 0) for n in nodes + inner.nodes]
                return inner, fg.inputs(unique)[0], nodes + [node.name] + inner.nodes, \
                    private
    gathered = _resolve_gather(fg, ref)
    private = [gathered.output] + [Ref(n, 0) for n in nodes + gathered.nodes[:-1]]
    return gathered, gathered.indices, nodes + gathered.nodes, private


def _match_sparse_segment(fg: FunctionGraph, node) -> Site:
    data, seg_indices, segment_ids = fg.inputs(node)
    nodes: List[str] = []
    data = _through_identity(fg, data, nodes)
    gathered = _resolve_gather(fg, data)
    site = Site(function=fg.fdef.signature.name, root=node.name,
                pattern="embedding_lookup_sparse",
                combiner=_SPARSE_SEGMENT_COMBINERS[node.op])
    _fill(site, gathered, fg)
    unique = fg.producer(seg_indices)
    if unique is None or unique.op != "Unique" or seg_indices.index != 1 or \
            gathered.indices != Ref(unique.name, 0):
        raise _Skip("sparse segment indices are not the unique-inverse of the "
                    "gathered ids")
    site.indices = fg.inputs(unique)[0]
    site.index_dtype = unique.attr["T"].type
    if site.index_dtype not in INDEX_DTYPES:
        raise _Skip(f"index dtype {_dtype_name(site.index_dtype)} is not int32/int64")
    site.segment_ids = segment_ids
    site.internal = tuple(nodes + gathered.nodes)
    private = [gathered.output, data] + [Ref(n, 0) for n in nodes + gathered.nodes]
    _check_private(fg, private, set(site.internal) | {node.name})
    return site


def _match_segment_sum(fg: FunctionGraph, node, combiner: str, root: str,
                       extra: List[str]) -> Site:
    """Weighted embedding_lookup_sparse: SegmentSum(Mul(rows, reshape(w)), seg)."""
    mul_ref, segment_ids = fg.inputs(node)
    mul = fg.producer(mul_ref)
    if mul is None or mul.op != "Mul":
        raise _NotASite()
    a, b = fg.inputs(mul)
    for rows_ref, w_ref in ((a, b), (b, a)):
        try:
            gathered, ids, rows_nodes, private = _resolve_sparse_rows(fg, rows_ref)
            break
        except _NotASite:
            continue
    else:
        raise _NotASite()
    site = Site(function=fg.fdef.signature.name, root=root,
                pattern="embedding_lookup_sparse", combiner=combiner, weighted=True)
    _fill(site, gathered, fg)
    site.indices = ids
    site.index_dtype = _ids_dtype(fg, ids, gathered)
    weights, strip_nodes = _strip_trailing_unit_axis(fg, w_ref)
    if fg.shape(weights).rank != 1:
        raise _Skip("sparse weights are not one per id")
    site.weights, site.segment_ids = weights, segment_ids
    internal = rows_nodes + [mul.name, node.name] + strip_nodes + extra
    site.internal = tuple(n for n in internal if n != root)
    private = private + [mul_ref, rows_ref]
    _check_private(fg, private, set(internal) | {root})
    if site.index_dtype not in INDEX_DTYPES:
        raise _Skip(f"index dtype {_dtype_name(site.index_dtype)} is not int32/int64")
    return site, w_ref


def _ids_dtype(fg: FunctionGraph, ids: Ref, gathered: _Gather) -> int:
    producer = fg.producer(ids)
    if producer is not None and producer.op == "Unique":
        return producer.attr["T"].type
    if ids == gathered.indices:
        return gathered.index_dtype
    unique_input_of = [n for n in fg.nodes.values()
                       if n.op == "Unique" and fg.inputs(n)[0] == ids]
    if unique_input_of:
        return unique_input_of[0].attr["T"].type
    return gathered.index_dtype


def _match_div(fg: FunctionGraph, node) -> Site:
    """mean: DivNoNan(SegmentSum(w*rows), SegmentSum(w)); sqrtn: the divisor is
    Sqrt(SegmentSum(Pow(w, 2)))."""
    num_ref, den_ref = fg.inputs(node)
    num = fg.producer(num_ref)
    den = fg.producer(den_ref)
    if num is None or num.op != "SegmentSum" or den is None:
        raise _NotASite()
    extra = [num.name]
    combiner = "mean"
    if den.op == "Sqrt":
        combiner = "sqrtn"
        extra.append(den.name)
        den = fg.producer(fg.inputs(den)[0])
        if den is None:
            raise _NotASite()
    if den.op != "SegmentSum":
        raise _NotASite()
    extra.append(den.name)
    site, w_reshaped = _match_segment_sum(fg, num, combiner, node.name, extra)
    den_data, den_seg = fg.inputs(den)
    if combiner == "sqrtn":
        power = fg.producer(den_data)
        if power is None or power.op != "Pow" or fg.inputs(power)[0] != w_reshaped:
            raise _Skip("sqrtn divisor is not sqrt(segment_sum(w^2))")
        exponent = fg.const_value(fg.inputs(power)[1])
        if exponent is None or float(exponent) != 2.0:
            raise _Skip("sqrtn divisor is not sqrt(segment_sum(w^2))")
        site.internal += (power.name,)
    elif den_data != w_reshaped:
        raise _Skip("mean divisor is not segment_sum(w)")
    if den_seg != site.segment_ids:
        raise _Skip("numerator and divisor use different segment ids")
    intermediates = [num_ref, den_ref] + [Ref(n, 0) for n in site.internal]
    _check_private(fg, [r for r in intermediates if r.node in fg.nodes and
                        fg.nodes[r.node].op not in ("Reshape",)],
                   set(site.internal) | {node.name})
    return site


def find_sites(fg: FunctionGraph, batch_size: int) -> List[Site]:
    """Every site in one function, fused-able or not, in graph order."""
    sites: List[Site] = []
    claimed: set = set()

    def attempt(node, matcher):
        if node.name in claimed:
            return
        try:
            result = matcher(fg, node)
        except _NotASite:
            return
        except _Skip as skip:
            sites.append(Site(function=fg.fdef.signature.name, root=node.name,
                              pattern=_pattern_of(node), reason=str(skip)))
            return
        site = result
        site.status = "fused"
        claimed.update(site.internal)
        claimed.add(site.root)
        sites.append(site)

    order = list(fg.fdef.node_def)
    # Divisions first: their inner SegmentSum must not be taken as a plain sum.
    for node in order:
        if node.op in ("DivNoNan", "RealDiv", "Div"):
            attempt(node, _match_div)
    for node in order:
        if node.op in ("Sum", "Mean"):
            attempt(node, _match_reduce)
        elif node.op == "Einsum":
            attempt(node, _match_einsum)
        elif node.op in _SPARSE_SEGMENT_COMBINERS:
            attempt(node, _match_sparse_segment)
        elif node.op == "SegmentSum":
            attempt(node, lambda g, n: _match_segment_sum(g, n, "sum", n.name, [])[0])
    for site in sites:
        if site.status == "fused":
            # Every gather and the weight multiply each build a [..., D] tensor.
            copies = sum(fg.nodes[n].op in ("ResourceGather", "GatherV2", "Mul")
                         for n in site.internal)
            _bytes(site, batch_size, max(copies, 1))
    return sites


def _pattern_of(node) -> str:
    if node.op == "Einsum":
        return "einsum"
    if node.op in ("Sum", "Mean"):
        return "gather-reduce"
    return "embedding_lookup_sparse"


def _op_attrs(op_name: str, typed_inputs: Dict[str, int], combiner: str,
              has_weights: bool) -> dict:
    """Attrs for the fused node, read off the registered OpDef so type-attr
    names follow the op library (T, Tindices, Tsplits...)."""
    op_def = op_def_registry.get(op_name)
    if op_def is None:
        raise RuntimeError(f"op {op_name} is not registered: load the pkm_serve op "
                           "library (pkm_serve.ops.load_library()) first")
    attrs = {}
    for arg in op_def.input_arg:
        if arg.type_attr and arg.name in typed_inputs:
            attrs[arg.type_attr] = DType(typed_inputs[arg.name])
    names = {a.name for a in op_def.attr}
    if "combiner" in names:
        attrs["combiner"] = combiner
    if "has_weights" in names:
        attrs["has_weights"] = has_weights
    missing = [a.name for a in op_def.attr if a.name not in attrs and
               not a.HasField("default_value")]
    if missing:
        raise RuntimeError(f"cannot set attrs {missing} of {op_name}")
    return attrs


def fuse_site(fg: FunctionGraph, site: Site) -> None:
    """Replaces the site's root with the fused op (graph left for remove_dead)."""
    control = set()
    for name in site.internal:
        control.update(fg.control_inputs(fg.nodes[name]))
    control.update(fg.control_inputs(fg.nodes[site.root]))
    control -= set(site.internal) | {site.root}
    control = sorted(control)
    if site.params_is_resource:
        params = fg.add_op(site.root + "/pkm_params", "ReadVariableOp", [site.params],
                           {"dtype": DType(site.table_dtype)},
                           shapes=[site.table_shape], control=control)
    else:
        params = site.params
    np_dtype = dtypes.as_dtype(site.table_dtype).as_numpy_dtype
    weights = site.weights
    if weights is None:
        weights = fg.add_const(site.root + "/pkm_no_weights", np.zeros([0], np_dtype))
    if site.segment_ids is None:
        inputs = [params, site.indices, weights]
        input_names = [a.name for a in op_def_registry.get(DENSE_OP).input_arg] \
            if op_def_registry.get(DENSE_OP) else ["params", "indices", "weights"]
        typed = dict(zip(input_names, [site.table_dtype, site.index_dtype,
                                       site.table_dtype]))
        attrs = _op_attrs(DENSE_OP, typed, site.combiner, site.weights is not None)
        fg.replace_node(site.root, DENSE_OP, inputs, attrs, control=control)
    else:
        row_splits = _row_splits(fg, site)
        inputs = [params, site.indices, row_splits, weights]
        input_names = [a.name for a in op_def_registry.get(RAGGED_OP).input_arg] \
            if op_def_registry.get(RAGGED_OP) else ["params", "values", "row_splits",
                                                    "weights"]
        typed = dict(zip(input_names, [site.table_dtype, site.index_dtype,
                                       types_pb2.DT_INT64, site.table_dtype]))
        attrs = _op_attrs(RAGGED_OP, typed, site.combiner, site.weights is not None)
        fg.replace_node(site.root, RAGGED_OP, inputs, attrs, control=control)
    for name in site.internal:
        fg.redirect_control(name, site.root)


def _row_splits(fg: FunctionGraph, site: Site) -> Ref:
    """int64 row_splits from sorted segment ids, with as many rows as the
    segment ops produce (last id + 1): row_splits[b] = #(ids < b)."""
    prefix = site.root + "/pkm_row_splits"
    seg = site.segment_ids
    seg_enum = _tensor_dtype(fg, seg)
    seg64 = seg
    if seg_enum != types_pb2.DT_INT64:
        seg64 = fg.add_op(prefix + "/ids64", "Cast", [seg],
                          {"SrcT": DType(seg_enum), "DstT": DType(types_pb2.DT_INT64),
                           "Truncate": False}, shapes=[[None]])
    i64 = DType(types_pb2.DT_INT64)
    i32 = DType(types_pb2.DT_INT32)
    minus_one = fg.add_const(prefix + "/minus_one", np.array([-1], np.int64))
    axis0 = fg.add_const(prefix + "/axis0", np.array(0, np.int32))
    padded = fg.add_op(prefix + "/padded", "ConcatV2", [seg64, minus_one, axis0],
                       {"N": 2, "T": i64, "Tidx": i32}, shapes=[[None]])
    last = fg.add_op(prefix + "/last", "Max", [padded, axis0],
                     {"T": i64, "Tidx": i32, "keep_dims": False}, shapes=[[]])
    one = fg.add_const(prefix + "/one", np.array(1, np.int64))
    zero = fg.add_const(prefix + "/zero", np.array(0, np.int64))
    num_rows = fg.add_op(prefix + "/num_rows", "AddV2", [last, one], {"T": i64},
                         shapes=[[]])
    limit = fg.add_op(prefix + "/limit", "AddV2", [num_rows, one], {"T": i64},
                      shapes=[[]])
    bounds = fg.add_op(prefix + "/bounds", "Range", [zero, limit, one], {"Tidx": i64},
                       shapes=[[None]])
    sorted_2d = fg.add_op(prefix + "/ids_2d", "ExpandDims", [seg64, axis0],
                          {"T": i64, "Tdim": i32}, shapes=[[1, None]])
    bounds_2d = fg.add_op(prefix + "/bounds_2d", "ExpandDims", [bounds, axis0],
                          {"T": i64, "Tdim": i32}, shapes=[[1, None]])
    splits_2d = fg.add_op(prefix + "/lower_bound", "LowerBound", [sorted_2d, bounds_2d],
                          {"T": i64, "out_type": i64}, shapes=[[1, None]])
    flat = fg.add_const(prefix + "/flat", np.array([-1], np.int32))
    return fg.add_op(prefix, "Reshape", [splits_2d, flat], {"T": i64, "Tshape": i32},
                     shapes=[[None]])


def _tensor_dtype(fg: FunctionGraph, ref: Ref) -> int:
    node = fg.producer(ref)
    if node is None:
        return fg.args[ref.node][1].type
    op_def = op_def_registry.get(node.op)
    flat = ref.index
    for arg in op_def.output_arg:
        count = (node.attr[arg.number_attr].i if arg.number_attr else
                 len(node.attr[arg.type_list_attr].list.type) if arg.type_list_attr else 1)
        if flat < count:
            if arg.type != types_pb2.DT_INVALID:
                return arg.type
            if arg.type_attr:
                return node.attr[arg.type_attr].type
            return node.attr[arg.type_list_attr].list.type[flat]
        flat -= count
    raise KeyError(f"no output #{ref.index} on {ref.node}")


def rewrite_function(fdef, library_sigs, batch_size: int, fuse: bool = True
                     ) -> List[Site]:
    """Finds the sites of one FunctionDef and, when `fuse`, rewrites it in place."""
    fg = FunctionGraph(fdef, library_sigs)
    sites = find_sites(fg, batch_size)
    fused = [s for s in sites if s.status == "fused"]
    if fuse and fused:
        seeds = []
        for site in fused:
            old_root_inputs = [fg.parse(t).node for t in fg.nodes[site.root].input
                               if not t.startswith("^")]
            fuse_site(fg, site)
            seeds.extend(site.internal)
            seeds.extend(n for n in old_root_inputs if n in fg.nodes and
                         fg.nodes[n].op in ("Const", "Identity", "Reshape", "Cast"))
            fg.reindex()
        fg.remove_dead(seeds)
    return sites
