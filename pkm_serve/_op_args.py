"""What every front end of the op checks and converts before calling it:
combiner names, table/index/weights dtypes, ragged weights' row partition,
and what counts as a sharded table."""

from __future__ import annotations

import tensorflow as tf

WEIGHTED_COMBINERS = ("sum", "mean", "sqrtn")  # the combiners that take weights
COMBINERS = WEIGHTED_COMBINERS + ("max",)
# The core's message (kernels/core/embedding_bag.h, kMaxWithWeightsError), word for word.
MAX_WITH_WEIGHTS_ERROR = ("combiner 'max' takes no weights (as torch's embedding_bag mode='max' refuses "
                          "per_sample_weights): pass weights=None")
TABLE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
INDEX_DTYPES = (tf.int32, tf.int64)


def _check_combiner(combiner, weights=None):
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if combiner == "max" and weights is not None:
        raise ValueError(MAX_WITH_WEIGHTS_ERROR)


def _refuse_sparse_tensors(indices, weights=None):
    """TypeError for tf.SparseTensor ids or weights (a VarLenFeature's), which the op does not read
    (TF's own conversion error said only that a SparseTensor is no Tensor): it names the ragged form."""
    if isinstance(indices, tf.SparseTensor) or isinstance(weights, tf.SparseTensor):
        which = "indices" if isinstance(indices, tf.SparseTensor) else "weights"
        raise TypeError(
            f"embedding_bag: {which} is a tf.SparseTensor; the op takes dense [..., K] or tf.RaggedTensor "
            "indices (and weights of the same form). For [batch, K] sparse ids, as "
            "tf.nn.embedding_lookup_sparse takes them, pass the bags of the entries present: "
            "ids = tf.sparse.reorder(ids); rows = ids.indices[:, 0]; "
            "tf.RaggedTensor.from_value_rowids(ids.values, rows, nrows=ids.dense_shape[0]) (the weights' "
            "values with the same rows). pkm_serve.layers.EmbeddingBag takes "
            "SparseTensors as they are.")


def _as_table(params):
    # Reading a (possibly autocast) variable gives a tensor that shares the
    # variable's buffer: no copy of the table, and the gradient flows to it.
    params = tf.convert_to_tensor(params)
    if params.dtype not in TABLE_DTYPES:
        raise TypeError(f"params must be float32, float16 or bfloat16, got {params.dtype.name}")
    if params.shape.rank is not None and params.shape.rank != 2:
        raise ValueError(f"params must be a [N, D] matrix, got shape {params.shape}")
    return params


def _as_indices(indices):
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype.name}")
    return indices


_NO_WEIGHTS = {}  # dtype -> the empty eager tensor that stands for "no weights" (or biases)


def _no_weights(dtype):
    """An empty [0] tensor of `dtype` (the ops' "no weights" input). Eager calls
    share one per dtype, an immutable constant: making it per call took an
    unweighted eager ops.embedding_bag from 26 to 69 us on the 2-core VM."""
    if not tf.executing_eagerly():
        return tf.zeros([0], dtype)
    empty = _NO_WEIGHTS.get(dtype)
    if empty is None:
        empty = _NO_WEIGHTS[dtype] = tf.zeros([0], dtype)
    return empty


def _as_weights(weights, dtype, like):
    """Weights in the table's dtype (mixed precision hands float32 scores to a
    float16 table), or an empty placeholder when there are none."""
    if weights is None:
        return _no_weights(dtype), False
    weights = tf.convert_to_tensor(weights)
    if not weights.dtype.is_floating:
        raise TypeError(f"weights must be a float tensor, got {weights.dtype.name}")
    if like is not None and weights.shape.rank is not None and like.shape.rank is not None \
            and not weights.shape.is_compatible_with(like.shape):
        raise ValueError(f"weights shape {weights.shape} must equal indices shape {like.shape}")
    return _sizes_checked_when_compiled(tf.cast(weights, dtype), like), True


# No quote characters: TF escapes them in a run-time assertion's message.
_RUN_TIME_SHAPE_ERROR = "weights must have the shape of indices (their run-time sizes differ)"


def _sizes_checked_when_compiled(weights, like):
    """Weights whose shape, or the ids', is only known at run time inside the function
    (tf.boolean_mask, tf.unique) checked against the ids' when XLA compiles the graph: XLA runs the op on
    bounded operands and has no shape check of its own, so weights masked otherwise than the ids
    were read at the ids' positions (zero past their own size) instead of failing as outside XLA."""
    if like is None or weights.shape.rank is None or weights.shape.rank != like.shape.rank \
            or (weights.shape.is_fully_defined() and like.shape.is_fully_defined()):
        return weights
    if all(t.shape.is_fully_defined() or _is_top_level_argument(t) for t in (weights, like)):
        # Arguments of a None dimension (a serving signature's batch): XLA compiles the function
        # for their run-time shapes, and the lowering's own shape check refuses weights of
        # another. The check op there kept a stock TFLite conversion from running.
        return weights
    from pkm_serve import _xla

    checked = _xla.checked_when_compiled(
        lambda: tf.reduce_all(tf.equal(tf.shape(weights), tf.shape(like))), weights, _RUN_TIME_SHAPE_ERROR)
    return weights if checked is None else checked


def _is_top_level_argument(tensor):
    """Whether `tensor` (through Identity / Cast) is an argument of a tf.function traced at the top
    level: not of a tf.cond / tf.while_loop body, nor of a function traced inside another one (both
    are inlined where their inputs may have run-time sizes)."""
    while getattr(tensor, "op", None) is not None and tensor.op.type in ("Identity", "Cast"):
        tensor = tensor.op.inputs[0]
    if getattr(tensor, "op", None) is None or tensor.op.type != "Placeholder":
        return False
    from pkm_serve import _recording

    graph = tensor.graph
    outer = getattr(graph, "outer_graph", None)
    return not _recording.is_control_flow_graph(graph) and not hasattr(outer, "outer_graph")


# No quote characters: TF escapes them in a run-time assertion's message.
_ROW_PARTITION_ERROR = "weights must share the row partition of the indices"
# The first row split that marks bags whose weights are not laid out like the ids, where the graph's
# check is an Assert that XLA drops when it compiles the graph later: the op refuses such bags with
# a message naming the mismatch (kMismatchedWeightsSplit, kernels/core/embedding_bag.h).
MISMATCHED_WEIGHTS_SPLIT = -2**31


def mark_mismatched_weights(splits, same):
    """`splits` with MISMATCHED_WEIGHTS_SPLIT first where `same` (a boolean scalar) is false."""
    first = tf.where(same, splits[:1], tf.fill([1], tf.constant(MISMATCHED_WEIGHTS_SPLIT, splits.dtype)))
    marked = tf.concat([first, splits[1:]], axis=0)
    marked._pkm_may_mark_mismatched_weights = True  # pylint: disable=protected-access
    return marked


def may_mark_mismatched_weights(splits) -> bool:
    """Whether `splits` came from mark_mismatched_weights (also through RaggedTensors built on them)."""
    return getattr(splits, "_pkm_may_mark_mismatched_weights", False)


def uniform_bags_as_ragged(values, weight_values, marked_splits):
    """(bags, weights): uniform bags `values` [..., K] (the flat values of ragged outer dims) as ragged
    bags of K ids each, whose row splits start with `marked_splits`' first entry, for a lookup that
    refuses the mark (the dense op has no row splits to carry it); weights likewise, or None."""
    shape = tf.shape(values, out_type=marked_splits.dtype)
    num_bags = tf.reduce_prod(shape[:-1])
    bag_splits = tf.concat([marked_splits[:1], tf.range(1, num_bags + 1, dtype=marked_splits.dtype) * shape[-1]], 0)
    bags = tf.RaggedTensor.from_row_splits(tf.reshape(values, [-1]), bag_splits, validate=False)
    weights = None if weight_values is None else bags.with_flat_values(tf.reshape(weight_values, [-1]))
    return bags, weights


def uniform_bags_output(out, values):
    """The [num_bags, D] output of uniform_bags_as_ragged's bags shaped back to [..., D]."""
    shaped = tf.reshape(out, tf.concat([tf.shape(values)[:-1], tf.shape(out)[-1:]], 0))
    shaped.set_shape(values.shape[:-1].concatenate(out.shape[-1:]))
    return shaped


def _summary(values, limit=8):
    values = values.tolist()
    return str(values) if len(values) <= limit else f"{values[:limit]}... ({len(values)} splits)"


def _ragged_weight_values(indices, weights):
    """The flat weights of ragged bags, after checking that they partition
    like the indices (else weights would silently land in the wrong bags).

    As ``embedding_lookup_sparse`` does, a mismatch is a ValueError when the
    partitions are known while tracing (eager, constants, static shapes), else
    an InvalidArgumentError with the same message when the graph runs.
    """
    return _ragged_weights_and_splits(indices, weights)[0]


def _ragged_weights_and_splits(indices, weights):
    """(_ragged_weight_values, the indices' innermost row splits to pass the op).

    Where the partition check is a tf.debugging.Assert (a graph XLA does not compile for the CPU
    while it is built), the splits start at MISMATCHED_WEIGHTS_SPLIT where the partitions differ: XLA drops the Assert
    when such a graph is compiled later (a SavedModel saved without jit_compile, called in a
    jit_compile function), and the op then refuses the splits instead of putting the weights in
    the wrong bags. Where the graph runs without XLA, the Assert fails first."""
    splits = indices.nested_row_splits[-1]
    if weights is None:
        return None, splits
    if not isinstance(weights, tf.RaggedTensor):
        raise TypeError(f"indices is a RaggedTensor, weights is not: {_ROW_PARTITION_ERROR}")
    if weights.ragged_rank != indices.ragged_rank:
        raise ValueError(f"{_ROW_PARTITION_ERROR}: weights have ragged rank {weights.ragged_rank}, "
                         f"indices {indices.ragged_rank}")
    from pkm_serve import _xla

    checks, conditions = [], []
    values = weights.flat_values
    for dim, (w_splits, i_splits) in enumerate(
            zip(weights.nested_row_splits, indices.nested_row_splits), start=1):
        if w_splits is i_splits:  # one tensor (indices.with_flat_values(w)): nothing to compare
            continue
        w_splits, i_splits = tf.cast(w_splits, tf.int64), tf.cast(i_splits, tf.int64)
        _refuse_known_partition_mismatch(dim, w_splits, i_splits)
        if tf.get_static_value(w_splits) is not None and tf.get_static_value(i_splits) is not None:
            continue
        same = same_entries(w_splits, i_splits)
        message = f"{_ROW_PARTITION_ERROR} (ragged dimension {dim} differs)"
        checked = _xla.checked_when_compiled(same, values, message)  # XLA drops the Assert
        if checked is not None:
            values = checked
        else:
            checks.append(tf.debugging.Assert(same, [message]))
            conditions.append(same)
    if conditions:
        splits = mark_mismatched_weights(splits, tf.reduce_all(tf.stack(conditions)))
    with tf.control_dependencies(checks):
        return tf.identity(values), splits


def _refuse_known_partition_mismatch(dim, w_splits, i_splits):
    """ValueError where the two row splits of ragged dimension `dim` differ already while tracing."""
    w_known, i_known = tf.get_static_value(w_splits), tf.get_static_value(i_splits)
    if w_known is not None and i_known is not None:
        if w_known.tolist() != i_known.tolist():
            raise ValueError(f"{_ROW_PARTITION_ERROR}: ragged dimension {dim} has row_splits "
                             f"{_summary(w_known)} in weights, {_summary(i_known)} in indices")
        return
    if w_splits.shape.is_fully_defined() and i_splits.shape.is_fully_defined() \
            and w_splits.shape != i_splits.shape:
        raise ValueError(f"{_ROW_PARTITION_ERROR}: ragged dimension {dim} has "
                         f"{w_splits.shape[0] - 1} rows in weights, {i_splits.shape[0] - 1} "
                         "in indices")


def same_entries(a, b):
    """Whether two non-negative integer tensors (row_splits, or [n, 2] positions) hold the same
    entries, also where their first dimensions differ. Equal() needs equal shapes, and XLA compiles
    both branches of a tf.cond (a compare there failed with "Incompatible shapes: [4] vs. [5]"), so
    each is extended by -1s (never an entry) along axis 0 to the sum of both lengths: where the
    lengths differ, the shorter's first -1 meets an entry of the longer."""
    a_padded = tf.concat([a, -tf.ones_like(b)], axis=0)
    b_padded = tf.concat([b, -tf.ones_like(a)], axis=0)
    return tf.logical_and(tf.reduce_all(tf.equal(tf.shape(a), tf.shape(b))),
                          tf.reduce_all(tf.equal(a_padded, b_padded)))


def is_sharded(params) -> bool:
    """A row-partitioned table: a ``ShardedVariable``, or a list/tuple of
    ``[N_i, D]`` shards (tensors, variables or arrays). A nested list of
    numbers is one table, not shards."""
    if type(params).__name__ == "ShardedVariable":
        return True
    return isinstance(params, (list, tuple)) and len(params) > 0 and all(
        hasattr(p, "shape") and hasattr(p, "dtype") and len(p.shape) == 2 for p in params)
