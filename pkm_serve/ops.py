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

COMBINERS = ("sum", "mean", "sqrtn")
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


def _check_combiner(combiner):
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")


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
def embedding_bag(params, indices, weights=None, combiner="sum", name=None):
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
      combiner: ``"sum"``, ``"mean"`` (divide by the sum of weights) or
        ``"sqrtn"`` (divide by sqrt of the sum of squared weights).

    Returns:
      ``[..., D]`` in ``params``' dtype (accumulated in float32). For ragged
      ``indices`` of ragged rank 1 a dense ``[B, D]`` tensor; for deeper ragged
      indices a RaggedTensor with the outer partitions of ``indices``.
    """
    _check_combiner(combiner)
    lib = load_library()
    with tf.name_scope(name or "embedding_bag"):
        params = _as_table(params)
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_embedding_bag(lib, params, indices, weights, combiner)
        if isinstance(weights, tf.RaggedTensor):
            raise TypeError("weights is ragged but indices is not")
        indices = _as_indices(indices)
        if indices.shape.rank == 0:
            raise ValueError("indices must have rank >= 1 ([..., K])")
        weights, has_weights = _as_weights(weights, params.dtype, indices)
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


def _ragged_embedding_bag(lib, params, indices, weights, combiner):
    weight_values = _ragged_weight_values(indices, weights)
    values = indices.flat_values
    if values.shape.rank is not None and values.shape.rank > 1:
        # Ragged outer dims, uniform bag axis: the dense op on the flat values.
        out = embedding_bag(params, values, weight_values, combiner)
        return indices.with_flat_values(out)
    values = _as_indices(values)
    weight_values, has_weights = _as_weights(weight_values, params.dtype, values)
    splits = indices.nested_row_splits
    out = lib.pkm_ragged_embedding_bag(params, values, splits[-1], weight_values, combiner=combiner,
                                       has_weights=has_weights)
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

    # Gradient ops are not differentiated again (no second derivatives).
    tf.no_gradient("PkmEmbeddingBagGrad")
    tf.no_gradient("PkmRaggedEmbeddingBagGrad")


_register_gradients()


# ---- the composite: stock TF ops, identical semantics -------------------------

@tf.autograph.experimental.do_not_convert
def embedding_bag_composite(params, indices, weights=None, combiner="sum", name=None):
    """``embedding_bag`` written as gather -> multiply -> reduce_sum.

    Materialises the ``[..., K, D]`` gather; use it as a reference, or where
    the op library is unavailable. Accumulates in float32 like the fused op.
    """
    _check_combiner(combiner)
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
        summed = tf.reduce_sum(tf.cast(rows, tf.float32) * w[..., None], axis=-2)
        return tf.cast(_combine(summed, w, combiner, axis=-1), params.dtype)


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
