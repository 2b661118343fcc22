"""What a composite site is: the record the matchers fill and the report
prints, the two ways a match ends early, and small graph/dtype helpers the
matchers share."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import dtypes, op_def_registry

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.tflite import CUSTOM_OP_NAME as DENSE_OP
from pkm_serve.tflite import RAGGED_CUSTOM_OP_NAME as RAGGED_OP

__all__ = ["DENSE_OP", "RAGGED_OP", "Site", "NotASite", "Skip"]

TABLE_DTYPES = (types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16)
INDEX_DTYPES = (types_pb2.DT_INT32, types_pb2.DT_INT64)
GATHER_OPS = ("ResourceGather", "GatherV2")
ND_GATHER_OPS = ("ResourceGatherNd", "GatherNd")  # fused where the indices are ids[..., None]

# The keys of Site.to_json(), in report order (pinned by a golden test).
REPORT_KEYS = ("function", "root", "pattern", "combiner", "computes", "weighted", "masked",
               "cast_to", "divisor", "table", "table_shape", "dtype", "gathered_shape",
               "status", "reason", "bytes_per_index", "saved_bytes_at_batch")


@dataclasses.dataclass
class Site:
    """One composite site: what was found, and whether it was fused.

    Reported fields describe the composite as written: `combiner` is the
    fused op's combiner, `weighted` whether a per-index multiplier is
    applied, `masked` whether rows are masked with tf.where (fused as padding
    ids), `cast_to` the dtype the rows are cast to before the reduction,
    `divisor` the bag size a weighted/masked reduce_mean divides by, as the
    signature fixes it (null where it does not: the fused model divides by
    the bag size of each request either way, `divide_by_bag`).
    """

    function: str
    root: str                 # name of the node the fused op replaces
    pattern: str              # gather-reduce | einsum | embedding_lookup_sparse
                              # | safe_embedding_lookup_sparse
    combiner: str = "sum"
    computes: str = ""        # what the model computes: sum | mean | sqrtn |
                              # masked mean | weighted mean | max (labels.py)
    weighted: bool = False
    masked: bool = False
    cast_to: Optional[str] = None
    divisor: Optional[int] = None
    table: str = ""           # resource arg or tensor feeding the gather
    table_shape: Optional[List[Optional[int]]] = None
    dtype: str = ""           # table dtype
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
    mask: Optional[Ref] = None        # bool [..., K]: False entries become padding
    mask_keeps_true: bool = True      # where(mask, rows, 0) vs where(mask, 0, rows)
    max_fill: Optional[Ref] = None    # a max's where(mask, rows, c): the scalar c (masked_max.py)
    cast_enum: int = 0                # DstT of the cast, 0 = none
    segment_ids: Optional[Ref] = None  # sparse: sorted bag id of each value
    num_segments: Optional[Ref] = None  # sparse: the bags a segment op's num_segments gives (else last id + 1)
    sparse_indices: Optional[Ref] = None  # safe_: [nnz, 2] ids before the fill
    dense_shape: Optional[Ref] = None     # safe_: [2]; dense_shape[0] bags
    default_id: Optional[int] = None      # safe_: row an empty bag gets (None: zeros)
    empty_bag_lowest: bool = False        # ragged max: an empty bag is the dtype's lowest
    empty_axis_max: bool = False          # dense reduce_max: a request with K = 0 gives -inf, its identity
    empty_bags: Optional[Ref] = None      # [bags, 1] bool, where not read off the row_splits (unsorted_segments.py)
    no_nan_weights: Tuple[Tuple[Ref, bool, bool], ...] = ()  # multiply_no_nan(rows, w): (w, squeeze, scalar)
    no_nan_positions: bool = False  # every position's multiply_no_nan(rows[:, k], w[:, k:k+1]): w's zeros padding
    internal: Tuple[str, ...] = ()     # nodes only the site uses (removed on fusion)
    dead_after: Tuple[str, ...] = ()   # nodes that become unused once fused
    intermediate_itemsizes: Tuple[int, ...] = ()  # one per [..., K, D] tensor built
    index_dtype: int = 0
    table_dtype: int = 0
    weights_squeeze: bool = False     # weights are [..., K, 1]: squeezed for the op
    weights_per_flat_id: Optional[Ref] = None  # the flattened ids whose weights scale the rows before the
    # reshape into bags (unflatten.weights_per_flat_id)
    weights_scalar: bool = False      # weights are one value ([] or [1, .., 1]): broadcast to the ids
    ids_are_sparse_columns: bool = False  # sparse_dense_matmul: ids = sparse_indices[:, 1]
    sparse_any_order: bool = False        # SparseBincount: ids = sp's values, entries in any row order
    ids_past_rows_padding: bool = False  # ids >= N count nowhere (bincount, one_hot): read as padding
    negative_ids_padding: bool = False   # negative ids count nowhere (one_hot): no negative-id check
    rows_from_counts: bool = False    # table rows unknown at export: N is the counts', checked at run time
    expand_bag_axis: bool = False     # the composite keeps a unit bag axis (matmul): the bag gets it back
    extra_unit_axes: int = 0          # more unit axes there (AveragePooling1D of the bag: [B, 1, 1, D])
    bag_unit_axis: int = -2           # ... at this axis: -2 ([..., 1, D]) or -1 (rows^T @ w: [..., D, 1])
    mask_squeeze: bool = False        # mask likewise
    regathers: Tuple[Ref, ...] = ()   # rows re-gathered by these (outermost first)
    regroup_ids: Optional[List[int]] = None  # the composite reshapes its gathered rows to this + [D]:
                                             # the op reads reshape(ids, regroup_ids) (unflatten.py)
    row_splits: Optional[Ref] = None  # ragged sites: the bags' row_splits
    shape_consumers: Tuple[Tuple[str, Ref], ...] = ()  # Shape(rows) nodes to rebuild
    gather_refs: Tuple[Ref, ...] = ()  # the rows as gathered (before any re-gather)
    multiplied_refs: Tuple[Ref, ...] = ()  # the rows from the multiply on (their shape may be broadcast)
    ones: Optional[Ref] = None        # a multiply by ones that may broadcast the ids (fused as that broadcast)
    ones_squeeze: bool = False        # ones are [..., K, 1]
    pooled: Optional[object] = None   # pooled.Pooled: a per-position sparse lookup pooled over L
    divide_by_longest_bag: bool = False  # reduce_mean of ragged rows padded by to_tensor(): / longest bag
    divide_by_bag: bool = False       # a weighted/masked reduce_mean: the bag is divided by its
                                      # size K, read off the ids at run time (not the static K)
    positions: Optional[object] = None  # positions.PositionSpan: a per-position sum of ids[..., a:b]
    weights_unit_row: bool = False    # matmul weights [..., 1, K] of any making: read without axis -2 (einsum.py)
    weights_to_vector: bool = False   # matmul weights [1, .., 1, K]: read as [K] (einsum.positional_weights_as_vector)
    flatten_bag_axes: int = 1         # the bag is the ids' last n axes (reduce over [1, 2]): flat_bags.py
    weight_factors: Tuple = ()        # scales.Factor: more multipliers, divisors, negations of the rows,
                                      # folded into the weights before the rewrite (scales.fold_factors)
    zero_fill: Optional[tuple] = None  # tf.where's zeros shaped like another tensor: the ids are broadcast
                                       # against their leading axes before the rewrite (zero_fill.py)
    segments_unsorted: bool = False   # unsorted_segment_sum of ids in any order: sorted before the rewrite
                                      # (unsorted_segments.py)
    segments_counted: bool = False    # segment_sum of regrouped rows: ids flattened, one per segment id asserted
    weights_after_mask: bool = False  # tf.where(mask, rows, 0) * w: w scales the masked rows' zeros too
    weights_on_one_hot: bool = False  # one_hot(ids, N) * w[..., None] summed: w scales every zero of the one-hot
    drop_hazards: Tuple = ()          # (kind, ref, squeeze, scalar) scaling the zeros of dropped rows (dropped_nan.py)
    nan_term: Optional[Ref] = None    # [..., 1]: NaN where the composite's bag is NaN from those zeros, else 0
    rounded_to: Optional[str] = None  # rows cast to this half dtype below cast_to (mixed precision):
                                      # a rounding the fused op skips, verified at that dtype's tolerance

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in REPORT_KEYS}

    def report_steps(self) -> str:
        """What the fused site keeps of the composite besides the bag, and which ids it reads where
        they are not all the ids ([..., a:b] of a per-position sum) or not one bag axis."""
        span = self.positions
        steps = ([f"ids[..., {span.first}:{span.stop}]"] if span is not None else []) + (
            [f"a bag of the ids' last {self.flatten_bag_axes} axes"] if self.flatten_bag_axes > 1 else []) + (
            ["masked"] if self.masked else []) + (["scalar weight"] if self.weights_scalar else []) + (
            [f"{len(self.weight_factors) + (self.weights is not None)} factors as one weight"]
            if self.weight_factors else []) + (
            [f"cast to {self.cast_to}"] if self.cast_to else []) + (
            ["/ K"] if self.divide_by_bag else []) + (["/ longest bag"] if self.divide_by_longest_bag else [])
        return f" ({', '.join(steps)})" if steps else ""


class NotASite(Exception):
    """The candidate node is not fed by a row gather at all (not reported)."""


class Skip(Exception):
    """A site was found but cannot be fused; the message is the reason."""


def dims(shape) -> Optional[List[Optional[int]]]:
    return None if shape.rank is None else shape.as_list()


def same_dims(a, b) -> bool:
    """Equal rank and, per dim, both known and equal or both unknown: anything
    looser could hide a runtime broadcast that the fused op would not do."""
    if a.rank is None or b.rank is None or a.rank != b.rank:
        return False
    return all(x == y for x, y in zip(a.as_list(), b.as_list()))


def shared_by_bags(shape, ids_shape) -> bool:
    """A multiplier every bag shares (positional weights [1, K] or [K] against ids
    [B, K]): of lower or equal rank, its bag axis the ids' (same_dims' rule),
    each axis before it 1 or the ids' own. fuse broadcasts it to the ids."""
    if shape.rank is None or ids_shape.rank is None or not 1 <= shape.rank <= ids_shape.rank:
        return False
    ids_dims = ids_shape.as_list()[ids_shape.rank - shape.rank:]
    if not same_dims(shape[-1:], ids_shape[-1:]):
        return False
    return all(d == 1 or (d is not None and d == i) for d, i in zip(shape.as_list()[:-1], ids_dims[:-1]))


def per_bag(shape, ids_shape) -> bool:
    """A multiplier of the ids' rank, each axis 1 or the ids' own (same_dims' rule): one weight per bag
    (w[:, :1] [B, 1] against ids [B, K]), per field or per index. fuse broadcasts it and the ids against
    each other as the composite's product broadcasts them."""
    if shape.rank is None or ids_shape.rank is None or shape.rank != ids_shape.rank:
        return False
    return all(d == 1 or d == i for d, i in zip(shape.as_list(), ids_shape.as_list()))


def dtype_name(enum: int) -> str:
    """The dtype's name; "unknown" where the enum names none (a Skip message
    must not fail on a dtype it could not read)."""
    try:
        return dtypes.as_dtype(enum).name
    except TypeError:
        return "unknown"


def itemsize(enum: int) -> int:
    return dtypes.as_dtype(enum).size


def tensor_dtype(fg: FunctionGraph, ref: Ref) -> int:
    """dtype enum of a tensor, from its producer's OpDef and attrs."""
    node = fg.producer(ref)
    if node is None:
        return fg.args[ref.node][1].type
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        raise KeyError(f"op {node.op} of {node.name} is not registered")
    flat = ref.index
    for arg in op_def.output_arg:
        count = (node.attr[arg.number_attr].i if arg.number_attr else
                 len(node.attr[arg.type_list_attr].list.type) if arg.type_list_attr else 1)
        if flat < count:
            if arg.type != types_pb2.DT_INVALID:
                return arg.type
            if arg.type_attr:
                return _attr_or_default(node, op_def, arg.type_attr).type
            return _attr_or_default(node, op_def, arg.type_list_attr).list.type[flat]
        flat -= count
    raise KeyError(f"no output #{ref.index} on {ref.node}")


def _attr_or_default(node, op_def, name: str):
    """node.attr[name], or the OpDef's default where the NodeDef leaves it out
    (SavedModels strip attrs equal to their default: Unique's out_idx int32)."""
    if name in node.attr:
        return node.attr[name]
    for attr in op_def.attr:
        if attr.name == name and attr.HasField("default_value"):
            return attr.default_value
    return node.attr[name]


def through_identity(fg: FunctionGraph, ref: Ref, nodes: List[str]) -> Ref:
    """Follows Identity nodes up from `ref`, appending their names to nodes."""
    node = fg.producer(ref)
    while node is not None and node.op == "Identity":
        nodes.append(node.name)
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    return ref


def check_private(fg: FunctionGraph, refs: List[Ref], site_nodes: set,
                  site: Optional[Site] = None) -> None:
    """Each intermediate must be used by the site alone, or fusing saves nothing.
    Consumers that read no data do not count: a dead branch (tf_keras'
    GlobalAveragePooling1D slices the rows only for their dtype) is removed
    with the site, and a Shape of the rows is rebuilt from the ids' shape."""
    for ref in refs:
        if ref in fg.returned:
            raise Skip(f"intermediate {fg.render(ref)} is also a function output")
        for consumer, _ in fg.consumers(ref):
            if consumer in site_nodes:
                continue
            if site is not None:
                dead = dead_branch(fg, consumer)
                if dead is not None:
                    site.dead_after += tuple(dead)
                    continue
                if fg.nodes[consumer].op == "Shape":
                    if (consumer, ref) not in site.shape_consumers:  # checked once per matcher pass
                        site.shape_consumers += ((consumer, ref),)
                    continue
            raise Skip(f"gathered tensor {fg.render(ref)} has another consumer "
                       f"({consumer}); fusing it would not save memory")


def dead_branch(fg: FunctionGraph, name: str, depth: int = 4) -> Optional[List[str]]:
    """[name and what only it feeds] when none of it reaches an output, a
    control edge or a stateful op; None otherwise."""
    node = fg.nodes.get(name)
    if node is None or depth == 0 or name in fg.control_returned or \
            fg.control_consumers.get(name) or any(r.node == name for r in fg.returned):
        return None
    op_def = op_def_registry.get(node.op)
    if op_def is None or op_def.is_stateful:
        return None
    branch = [name]
    from pkm_serve.export.graph import output_arg_counts
    outputs = sum(c for _, c in output_arg_counts(node, fg.library_sigs))
    for i in range(outputs):
        for consumer, _ in fg.consumers(Ref(name, i)):
            below = dead_branch(fg, consumer, depth - 1)
            if below is None:
                return None
            branch.extend(below)
    return branch


def _fed_at_run_time(fg: FunctionGraph, ref: Ref) -> bool:
    """`ref` reads a signature input (a server feeds it in any shape), not only constants and variables."""
    seen, todo = set(), [ref]
    while todo:
        ref = todo.pop()
        if ref.node in seen:
            continue
        seen.add(ref.node)
        node = fg.producer(ref)
        if node is None:
            if tensor_dtype(fg, ref) != types_pb2.DT_RESOURCE:
                return True
        elif node.op not in ("Const", "ReadVariableOp", "VarHandleOp"):
            todo.extend(fg.inputs(node))
    return False


def check_shared_weights_fixed(fg: FunctionGraph, site: Site) -> None:
    """Raises Skip for weights every bag shares (v [K] against ids [B, K]: v[k], v[None, None, :] @ rows,
    tensordot, einsum 'bkd,k->bd') that a signature input gives: fed [1] or [K + 2] the original indexes,
    multiplies or refuses by rules the fused op's broadcast to the ids does not follow."""
    if site.weights is None or site.indices is None or site.row_splits is not None or \
            site.segment_ids is not None or site.sparse_indices is not None:
        return
    w_rank, ids_rank = fg.shape(site.weights).rank, fg.shape(site.indices).rank
    if w_rank is not None and ids_rank is not None and w_rank < ids_rank and _fed_at_run_time(fg, site.weights):
        raise Skip(f"the weights every bag shares ({fg.render(site.weights)}, rank {w_rank} against ids of rank "
                   f"{ids_rank}) are fed at run time, in a shape no check here ties to the one the original "
                   "needs: not fused (fused where they are a constant or a variable)")
