"""The fused EmbeddingBag op for TensorFlow.

``embedding_bag(params, indices, weights=None, combiner="sum")`` computes
``out[..., :] = combine_k weights[..., k] * params[indices[..., k], :]`` in one
kernel, without materialising the ``[..., K, D]`` gather, and its gradient is a
dense ``d_params [N, D]`` (no ``IndexedSlices`` of ``B*K`` rows).

``embedding_bag_composite`` is the same function written with stock TF ops
(gather -> multiply -> reduce): the reference in tests and the fallback where
the op library cannot run (XLA/TPU, or a runtime without the ``.so``).
"""

from __future__ import annotations

import os
import threading
import warnings

import tensorflow as tf

from pkm_serve import _xla

WEIGHTED_COMBINERS = ("sum", "mean", "sqrtn")  # the combiners that take weights
COMBINERS = WEIGHTED_COMBINERS + ("max",)
# The core's message (kernels/core/embedding_bag.h, kMaxWithWeightsError), word for word.
MAX_WITH_WEIGHTS_ERROR = ("combiner 'max' takes no weights (as torch's embedding_bag mode='max' refuses "
                          "per_sample_weights): pass weights=None")
TABLE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
INDEX_DTYPES = (tf.int32, tf.int64)

_LIB_NAME = "_pkm_ops.so"
_GPU_LIB_NAME = "_pkm_ops_gpu.so"  # CPU + GPU kernels, built by `make gpu` (nvcc)
_lib = None
_lib_lock = threading.Lock()


class OpLibraryNotFoundError(ImportError):
    """The compiled op library is missing (not built, or not shipped)."""


def library_path() -> str:
    """Path of the TF op library: ``$PKM_SERVE_OPS_LIB``, else the packaged
    build — the one with GPU kernels when it was built and TF sees a GPU."""
    if os.environ.get("PKM_SERVE_OPS_LIB"):
        return os.environ["PKM_SERVE_OPS_LIB"]
    lib_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
    gpu_lib = os.path.join(lib_dir, _GPU_LIB_NAME)
    # Both libraries register the same ops: load exactly one of them.
    if os.path.exists(gpu_lib) and tf.config.list_physical_devices("GPU"):
        return gpu_lib
    return os.path.join(lib_dir, _LIB_NAME)


def load_library():
    """Loads (once) and returns the op library module; registers the ops with TF.

    Must run before a graph or SavedModel that uses the ops is imported.
    """
    global _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            if not os.path.exists(path):
                raise OpLibraryNotFoundError(
                    f"pkm_serve op library not found at {path}. In a source checkout run "
                    "`make build`; to install, use the TF wheel (`make wheel`, then "
                    "`pip install dist/pkm_serve-*.whl`) rather than `pip install .`; the device "
                    "wheel has no TF op. pkm_serve.ops.embedding_bag_composite needs no library.")
            _lib = tf.load_op_library(path)
        return _lib


def is_available() -> bool:
    try:
        load_library()
        return True
    except (OpLibraryNotFoundError, tf.errors.NotFoundError):
        return False


def _register_at_import():
    """Importing this module registers the ops (so SavedModels using them
    load); a missing library is only an error when the op is used."""
    try:
        load_library()
    except OpLibraryNotFoundError:
        pass
    except tf.errors.NotFoundError as err:  # e.g. built against another TF (undefined symbols)
        warnings.warn(f"pkm_serve: the op library at {library_path()} does not load into "
                      f"TensorFlow {tf.__version__}: {err}", RuntimeWarning, stacklevel=3)


_register_at_import()


def _check_combiner(combiner, weights=None):
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    if combiner == "max" and weights is not None:
        raise ValueError(MAX_WITH_WEIGHTS_ERROR)


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


def _as_weights(weights, dtype, like):
    """Weights in the table's dtype (mixed precision hands float32 scores to a
    float16 table), or an empty placeholder when there are none."""
    if weights is None:
        return tf.zeros([0], dtype), False
    weights = tf.convert_to_tensor(weights)
    if not weights.dtype.is_floating:
        raise TypeError(f"weights must be a float tensor, got {weights.dtype.name}")
    if like is not None and weights.shape.rank is not None and like.shape.rank is not None \
            and not weights.shape.is_compatible_with(like.shape):
        raise ValueError(f"weights shape {weights.shape} must equal indices shape {like.shape}")
    return tf.cast(weights, dtype), True


# Plain Python with no tensor-dependent control flow: AutoGraph has nothing to
# convert, and converting would trace through the library loader.
@tf.autograph.experimental.do_not_convert
def embedding_bag(params, indices, weights=None, combiner="sum", name=None, sparse_gradient=False):
    """Fused gather + weighted reduce over the last axis of ``indices``.

    Args:
      params: ``[N, D]`` table (Tensor, Variable or Keras AutoCastVariable) of
        float32, float16 or bfloat16.
      indices: ``[..., K]`` int32/int64 Tensor, or a ``tf.RaggedTensor`` whose
        last dimension is ragged (bags of varying size). Negative entries are
        padding: they contribute nothing and are not counted by mean/sqrtn.
        An index >= N raises ``InvalidArgumentError``.
      weights: per-index weights shaped like ``indices`` (same ragged
        partition), or None for all ones. Cast to ``params``' dtype.
      combiner: ``"sum"``, ``"mean"`` (divide by the sum of weights),
        ``"sqrtn"`` (divide by sqrt of the sum of squared weights) or ``"max"``
        (torch's ``mode="max"``: elementwise max over the bag's valid rows, 0
        for an empty bag; ``weights`` must be None; the gradient goes to the
        row holding each maximum, ties to the first).
      sparse_gradient: if True, the gradient w.r.t. ``params`` is a
        ``tf.IndexedSlices`` of the distinct rows touched (at most
        ``min(N, number of indices)`` rows) instead of a dense ``[N, D]``
        tensor. ``params`` may also be a ``ShardedVariable`` or a list of row
        shards (see ``sharded_embedding_bag``).

    Returns:
      ``[..., D]`` in ``params``' dtype (accumulated in float32). For ragged
      ``indices`` of ragged rank 1 a dense ``[B, D]`` tensor; for deeper ragged
      indices a RaggedTensor with the outer partitions of ``indices``.
    """
    _check_combiner(combiner, weights)
    if is_sharded(params):
        return sharded_embedding_bag(params, indices, weights, combiner, name, sparse_gradient)
    lib = load_library()
    if _xla.composite_under_xla(params, indices):  # XLA for a backend without our custom-call target
        return embedding_bag_composite(params, indices, weights, combiner, name=name)
    if sparse_gradient and _xla.compile_device_type() is not None:
        # XLA needs static shapes; the number of distinct rows depends on the data.
        raise ValueError("embedding_bag: sparse_gradient=True cannot be compiled by XLA (the number of "
                         "distinct rows touched is only known at run time); use sparse_gradient=False "
                         "under jit_compile, or compile without XLA (model.compile(jit_compile=False))")
    with tf.name_scope(name or "embedding_bag"):
        variable = _sparse_read_variable(params, indices) if sparse_gradient else None
        params = variable if variable is not None else _as_table(params)
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_embedding_bag(lib, params, indices, weights, combiner, sparse_gradient)
        if isinstance(weights, tf.RaggedTensor):
            raise TypeError("weights is ragged but indices is not")
        indices = _as_indices(indices)
        if indices.shape.rank == 0:
            raise ValueError("indices must have rank >= 1 ([..., K])")
        weights, has_weights = _as_weights(weights, params.dtype, indices)
        if variable is not None:
            from tensorflow.python.ops import resource_variable_ops

            resource_variable_ops.variable_accessed(variable)  # what a read tells the tape
            return lib.pkm_resource_embedding_bag(variable.handle, indices, weights, combiner=combiner,
                                                  has_weights=has_weights)
        if sparse_gradient:
            return _with_sparse_gradient(lib, params, (indices,), weights, combiner, has_weights)
        return lib.pkm_embedding_bag(params, indices, weights, combiner=combiner,
                                     has_weights=has_weights)


# No quote characters: TF escapes them in a run-time assertion's message.
_ROW_PARTITION_ERROR = "weights must share the row partition of the indices"


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
    if weights is None:
        return None
    if not isinstance(weights, tf.RaggedTensor):
        raise TypeError(f"indices is a RaggedTensor, weights is not: {_ROW_PARTITION_ERROR}")
    if weights.ragged_rank != indices.ragged_rank:
        raise ValueError(f"{_ROW_PARTITION_ERROR}: weights have ragged rank {weights.ragged_rank}, "
                         f"indices {indices.ragged_rank}")
    checks = []
    for dim, (w_splits, i_splits) in enumerate(
            zip(weights.nested_row_splits, indices.nested_row_splits), start=1):
        w_splits, i_splits = tf.cast(w_splits, tf.int64), tf.cast(i_splits, tf.int64)
        w_known, i_known = tf.get_static_value(w_splits), tf.get_static_value(i_splits)
        if w_known is not None and i_known is not None:
            if w_known.tolist() != i_known.tolist():
                raise ValueError(f"{_ROW_PARTITION_ERROR}: ragged dimension {dim} has row_splits "
                                 f"{_summary(w_known)} in weights, {_summary(i_known)} in indices")
            continue
        if w_splits.shape.is_fully_defined() and i_splits.shape.is_fully_defined() \
                and w_splits.shape != i_splits.shape:
            raise ValueError(f"{_ROW_PARTITION_ERROR}: ragged dimension {dim} has "
                             f"{w_splits.shape[0] - 1} rows in weights, {i_splits.shape[0] - 1} "
                             "in indices")
        # Equal() needs equal sizes: compare the values only when they are.
        same = tf.cond(tf.equal(tf.size(w_splits), tf.size(i_splits)),
                       lambda w=w_splits, i=i_splits: tf.reduce_all(tf.equal(w, i)),
                       lambda: tf.constant(False))
        checks.append(tf.debugging.Assert(
            same, [f"{_ROW_PARTITION_ERROR} (ragged dimension {dim} differs)"]))
    with tf.control_dependencies(checks):
        return tf.identity(weights.flat_values)


def _ragged_embedding_bag(lib, params, indices, weights, combiner, sparse_gradient=False):
    weight_values = _ragged_weight_values(indices, weights)
    values = indices.flat_values
    if values.shape.rank is not None and values.shape.rank > 1:
        # Ragged outer dims, uniform bag axis: the dense op on the flat values.
        out = embedding_bag(params, values, weight_values, combiner, sparse_gradient=sparse_gradient)
        return indices.with_flat_values(out)
    values = _as_indices(values)
    weight_values, has_weights = _as_weights(weight_values, params.dtype, values)
    splits = indices.nested_row_splits
    if sparse_gradient:
        out = _with_sparse_gradient(lib, params, (values, splits[-1]), weight_values, combiner,
                                    has_weights)
    else:
        out = lib.pkm_ragged_embedding_bag(params, values, splits[-1], weight_values,
                                           combiner=combiner, has_weights=has_weights)
    if len(splits) == 1:
        return out
    return tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)


def _register_gradients():
    @tf.RegisterGradient("PkmEmbeddingBag")
    def _embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        d_params, d_weights = load_library().pkm_embedding_bag_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        return [d_params, None, d_weights if has_weights else None]

    @tf.RegisterGradient("PkmRaggedEmbeddingBag")
    def _ragged_embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        d_params, d_weights = load_library().pkm_ragged_embedding_bag_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2], op.inputs[3],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        return [d_params, None, None, d_weights if has_weights else None]

    @tf.RegisterGradient("PkmResourceEmbeddingBag")
    def _resource_embedding_bag_grad(op, grad):
        has_weights = op.get_attr("has_weights")
        rows, row_grads, d_weights = load_library().pkm_resource_embedding_bag_sparse_grad(
            grad, op.inputs[0], op.inputs[1], op.inputs[2],
            combiner=op.get_attr("combiner"), has_weights=has_weights)
        from tensorflow.python.ops import resource_variable_ops

        shape = resource_variable_ops.variable_shape(op.inputs[0], out_type=tf.int64)
        return [tf.IndexedSlices(row_grads, rows, dense_shape=shape), None,
                d_weights if has_weights else None]

    tf.no_gradient("PkmResourceEmbeddingBagSparseGrad")
    # Gradient ops are not differentiated again (no second derivatives).
    tf.no_gradient("PkmEmbeddingBagGrad")
    tf.no_gradient("PkmRaggedEmbeddingBagGrad")


_register_gradients()


# ---- row-sparse gradients and sharded tables ------------------------------------

def _sparse_read_variable(params, indices):
    """The resource variable to read inside the kernel while a tape records, else None.

    After its first sparse update (scatter_* of IndexedSlices), TF keeps a
    variable in copy-on-read mode: every dense read copies the whole table.
    ``PkmResourceEmbeddingBag`` reads it under its lock instead, as
    ``ResourceGather`` does. Used only when a gradient can be recorded (so
    exported inference graphs keep the plain op) for dense-layout bags of a
    CPU variable (the resource op has CPU kernels only).
    """
    if not isinstance(params, tf.Variable) or type(params).__name__ == "AutoCastVariable":
        return None
    if isinstance(indices, tf.RaggedTensor) or "GPU" in (params.device or "").upper():
        return None
    if params.dtype not in TABLE_DTYPES or params.shape.rank != 2:
        return None
    try:  # a distributed variable has a handle only inside a replica context
        params.handle
    except (AttributeError, ValueError):
        return None
    from tensorflow.python.eager import record  # no public "is a tape recording" query

    return params if record.could_possibly_record() else None


def _with_sparse_gradient(lib, params, bag_inputs, weights, combiner, has_weights):
    """The forward op whose params-gradient is an IndexedSlices of unique rows.

    ``bag_inputs`` is ``(indices,)`` or ``(values, row_splits)``. The registered
    gradient of the forward op stays dense; this path pairs the same forward
    with ``Pkm*SparseGrad`` through ``tf.custom_gradient``. A variable's read
    passes the IndexedSlices through to the variable unchanged.
    """
    ragged = len(bag_inputs) == 2
    forward_op = lib.pkm_ragged_embedding_bag if ragged else lib.pkm_embedding_bag
    grad_op = lib.pkm_ragged_embedding_bag_sparse_grad if ragged else lib.pkm_embedding_bag_sparse_grad

    @tf.custom_gradient
    def fused(table, bag_weights):
        out = forward_op(table, *bag_inputs, bag_weights, combiner=combiner, has_weights=has_weights)

        def grad(d_out):
            rows, row_grads, d_weights = grad_op(d_out, table, *bag_inputs, bag_weights,
                                                 combiner=combiner, has_weights=has_weights)
            d_table = tf.IndexedSlices(row_grads, rows, dense_shape=tf.shape(table, out_type=tf.int64))
            return d_table, (d_weights if has_weights else tf.zeros_like(bag_weights))

        return out, grad

    return fused(params, weights)


def is_sharded(params) -> bool:
    """A row-partitioned table: a ``ShardedVariable``, or a list/tuple of
    ``[N_i, D]`` shards (tensors, variables or arrays). A nested list of
    numbers is one table, not shards."""
    if type(params).__name__ == "ShardedVariable":
        return True
    return isinstance(params, (list, tuple)) and len(params) > 0 and all(
        hasattr(p, "shape") and hasattr(p, "dtype") and len(p.shape) == 2 for p in params)


def _table_shards(params):
    shards = list(params.variables) if type(params).__name__ == "ShardedVariable" else list(params)
    if not shards:
        raise ValueError("a sharded table needs at least one shard")
    shards = [s if isinstance(s, (tf.Variable, tf.Tensor)) else tf.convert_to_tensor(s) for s in shards]
    for i, shard in enumerate(shards):
        if shard.shape.rank is not None and shard.shape.rank != 2:
            raise ValueError(f"table shard {i} must be a [N_i, D] matrix, got shape {shard.shape}")
        if shard.dtype != shards[0].dtype:
            raise TypeError(f"table shards must share one dtype: shard {i} is {shard.dtype.name}, "
                            f"shard 0 {shards[0].dtype.name}")
    dims = {int(s.shape[1]) for s in shards if s.shape[1] is not None}
    if len(dims) > 1:
        raise ValueError(f"table shards must all have the same width, got widths {sorted(dims)}")
    return shards


@tf.autograph.experimental.do_not_convert
def sharded_embedding_bag(params, indices, weights=None, combiner="sum", name=None,
                          sparse_gradient=False):
    """``embedding_bag`` over a row-partitioned table, one fused lookup per shard.

    ``params`` is a ``ShardedVariable`` (e.g. from ``ParameterServerStrategy``'s
    ``variable_partitioner``) or a list of ``[N_i, D]`` shards holding
    consecutive rows: shard ``i`` holds global rows ``[sum(N_<i), sum(N_<=i))``
    (the "div" partitioning of ``embedding_lookup``/``ShardedVariable``). Each
    shard runs the fused op, on the shard's device, over the indices that fall
    into it (the others become padding) with combiner ``sum``; the partial
    bags are added and divided once by the combiner's denominator over all
    valid entries, so mean/sqrtn equal the unsharded op. Gradients reach each
    shard (row-sparse with ``sparse_gradient=True``).
    """
    _check_combiner(combiner, weights)
    if combiner == "max":
        raise ValueError("combiner 'max' over a sharded table is not supported: pass one [N, D] table")
    shards = _table_shards(params)
    with tf.name_scope(name or "sharded_embedding_bag"):
        if isinstance(indices, tf.RaggedTensor):
            flat = indices.flat_values
            w_flat = _ragged_weight_values(indices, weights)
        else:
            if isinstance(weights, tf.RaggedTensor):
                raise TypeError("weights is ragged but indices is not")
            flat = indices
            w_flat = weights
        flat = _as_indices(flat)
        dtype = shards[0].dtype
        if w_flat is None:
            w_flat = tf.ones(tf.shape(flat), dtype)
        else:
            w_flat = tf.convert_to_tensor(w_flat)
            if not w_flat.dtype.is_floating:
                raise TypeError(f"weights must be a float tensor, got {w_flat.dtype.name}")
            w_flat = tf.cast(w_flat, dtype)
        sizes = [tf.shape(s, out_type=flat.dtype)[0] for s in shards]
        total = tf.add_n(sizes)
        check = tf.debugging.assert_less(
            flat, total, message="embedding_bag: an index is out of range of the sharded table "
            "(negative indices are padding)")
        with tf.control_dependencies([check]):
            flat = tf.identity(flat)
        partial = None
        offset = tf.zeros([], flat.dtype)
        for shard, size in zip(shards, sizes):
            local = flat - offset
            mine = (local >= 0) & (local < size)
            local = tf.where(mine, local, -tf.ones_like(local))
            bags = indices.with_flat_values(local) if isinstance(indices, tf.RaggedTensor) else local
            bag_w = indices.with_flat_values(w_flat) if isinstance(indices, tf.RaggedTensor) else w_flat
            with tf.device(shard.device):
                part = embedding_bag(shard, bags, bag_w, "sum", sparse_gradient=sparse_gradient)
            part = tf.cast(part, tf.float32)
            partial = part if partial is None else partial + part
            offset = offset + size
        if combiner == "sum":
            return tf.cast(partial, dtype)
        # The denominator over every valid entry, as the unsharded op counts it.
        valid_w = tf.where(flat >= 0, tf.cast(w_flat, tf.float32), tf.zeros_like(w_flat, tf.float32))
        if isinstance(indices, tf.RaggedTensor):
            valid_w = indices.with_flat_values(valid_w)
        denom = tf.reduce_sum(valid_w if combiner == "mean" else valid_w * valid_w, axis=-1)
        if combiner == "sqrtn":
            denom = tf.sqrt(denom)
        return tf.cast(tf.math.divide_no_nan(partial, tf.expand_dims(denom, -1)), dtype)


# ---- the composite: stock TF ops, identical semantics -------------------------

@tf.autograph.experimental.do_not_convert
def embedding_bag_composite(params, indices, weights=None, combiner="sum", name=None,
                            sparse_gradient=False):
    """``embedding_bag`` written as gather -> multiply -> reduce_sum.

    Materialises the ``[..., K, D]`` gather; use it as a reference, or where
    the op library is unavailable. Accumulates in float32 like the fused op.
    ``sparse_gradient`` is accepted for parity with ``embedding_bag``: the
    gather's gradient is an ``IndexedSlices`` either way (one row per index,
    not row-unique).
    """
    _check_combiner(combiner, weights)
    with tf.name_scope(name or "embedding_bag_composite"):
        params = _as_table(params)
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_composite(params, indices, weights, combiner)
        indices = _as_indices(indices)
        tf.debugging.assert_less(indices, tf.cast(tf.shape(params)[0], indices.dtype),
                                 message="embedding_bag: index out of range")
        valid = indices >= 0
        w = tf.ones(tf.shape(indices), tf.float32) if weights is None else tf.cast(weights, tf.float32)
        w = tf.where(valid, w, tf.zeros_like(w))
        rows = tf.gather(params, tf.where(valid, indices, tf.zeros_like(indices)))
        if combiner == "max":
            return tf.cast(_masked_max(tf.cast(rows, tf.float32), valid, axis=-2), params.dtype)
        summed = tf.reduce_sum(tf.cast(rows, tf.float32) * w[..., None], axis=-2)
        return tf.cast(_combine(summed, w, combiner, axis=-1), params.dtype)


def _masked_max(rows, valid, axis):
    """reduce_max over the bag axis of the valid rows only; 0 for an empty bag.
    (reduce_max's gradient splits ties evenly; the fused op gives them to the
    first position.)"""
    masked = tf.where(valid[..., None], rows, tf.fill(tf.shape(rows), float("-inf")))
    any_valid = tf.reduce_any(valid, axis=axis + 1 if axis < 0 else axis)[..., None]
    return tf.where(any_valid, tf.reduce_max(masked, axis=axis), tf.zeros([], rows.dtype))


def _combine(summed, w, combiner, axis):
    if combiner == "mean":
        return tf.math.divide_no_nan(summed, tf.reduce_sum(w, axis=axis)[..., None])
    if combiner == "sqrtn":
        return tf.math.divide_no_nan(summed, tf.sqrt(tf.reduce_sum(w * w, axis=axis))[..., None])
    return summed


def _ragged_composite(params, indices, weights, combiner):
    values = indices.flat_values
    w_values = _ragged_weight_values(indices, weights)
    if values.shape.rank is not None and values.shape.rank > 1:
        return indices.with_flat_values(embedding_bag_composite(params, values, w_values, combiner))
    splits = indices.nested_row_splits
    inner = tf.RaggedTensor.from_row_splits(values, splits[-1], validate=False)
    valid = values >= 0
    w = tf.ones(tf.shape(values), tf.float32) if w_values is None else tf.cast(w_values, tf.float32)
    w = tf.where(valid, w, tf.zeros_like(w))
    rows = tf.cast(tf.gather(params, tf.where(valid, values, tf.zeros_like(values))), tf.float32)
    seg = inner.value_rowids()
    nrows = inner.nrows()
    if combiner == "max":
        # Padding goes to a segment past the last bag (dropped); empty bags get 0.
        seg_valid = tf.where(valid, seg, tf.fill(tf.shape(seg), nrows))
        maxed = tf.math.unsorted_segment_max(rows, seg_valid, nrows + 1)[:-1]
        counts = tf.math.unsorted_segment_sum(tf.cast(valid, tf.int32), seg, nrows)
        out = tf.cast(tf.where((counts > 0)[:, None], maxed, tf.zeros_like(maxed)), params.dtype)
        return out if len(splits) == 1 else tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)
    summed = tf.math.unsorted_segment_sum(rows * w[:, None], seg, nrows)
    w_sum = tf.math.unsorted_segment_sum(w, seg, nrows)
    w_sq = tf.math.unsorted_segment_sum(w * w, seg, nrows)
    if combiner == "mean":
        summed = tf.math.divide_no_nan(summed, w_sum[:, None])
    elif combiner == "sqrtn":
        summed = tf.math.divide_no_nan(summed, tf.sqrt(w_sq)[:, None])
    out = tf.cast(summed, params.dtype)
    if len(splits) == 1:
        return out
    return tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)
