"""The fused EmbeddingBag op for TensorFlow.

``embedding_bag(params, indices, weights=None, combiner="sum")`` computes
``out[..., :] = combine_k weights[..., k] * params[indices[..., k], :]`` in one
kernel, without materialising the ``[..., K, D]`` gather, and its gradient is a
dense ``d_params [N, D]`` (no ``IndexedSlices`` of ``B*K`` rows).

``embedding_bag_composite`` is the same function written with stock TF ops
(gather -> multiply -> reduce): the reference in tests and the fallback where
the op library cannot run (XLA/TPU, or a runtime without the ``.so``).

Layout (one concern per module, no import circle): ``_library`` loads the op
library, ``_op_args`` checks arguments, ``_fused`` is the op on one table,
``_sharding`` the op over row shards, ``_composite`` the stock-TF version.
Every public name stays importable from here.
"""

from __future__ import annotations

import tensorflow as tf

from pkm_serve import _loss_scale_check
from pkm_serve._composite import embedding_bag_composite
from pkm_serve._fused import fused_embedding_bag
from pkm_serve._library import OpLibraryNotFoundError, is_available, library_path, load_library
from pkm_serve._op_args import (COMBINERS, INDEX_DTYPES, MAX_WITH_WEIGHTS_ERROR, TABLE_DTYPES, WEIGHTED_COMBINERS,
                                _check_combiner, _refuse_sparse_tensors, is_sharded)
from pkm_serve._sharding import sharded_embedding_bag

__all__ = ["COMBINERS", "INDEX_DTYPES", "MAX_WITH_WEIGHTS_ERROR", "TABLE_DTYPES", "WEIGHTED_COMBINERS", "OpLibraryNotFoundError", "embedding_bag",
           "embedding_bag_composite", "is_available", "is_sharded", "library_path", "load_library",
           "sharded_embedding_bag"]


# Plain Python with no tensor-dependent control flow: AutoGraph has nothing to
# convert, and converting would trace through the library loader.
@tf.autograph.experimental.do_not_convert
def embedding_bag(params, indices, weights=None, combiner="sum", name=None, sparse_gradient=False):
    """``ops.embedding_bag`` on one table (not sharded): see its docstring.

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
        for an empty bag, NaN where a row holds NaN, as ``tf.reduce_max``;
        ``weights`` must be None; the gradient goes to the row holding each
        maximum, the first NaN, ties to the first).
      sparse_gradient: if True, the gradient w.r.t. ``params`` is a
        ``tf.IndexedSlices`` of the distinct rows touched (at most
        ``min(N, number of indices)`` rows) instead of a dense ``[N, D]``
        tensor. ``params`` may also be a ``ShardedVariable`` or a list of row
        shards (see ``sharded_embedding_bag``). A ``tf.Variable`` (or the one a
        Keras variable holds) has its scatter methods wrapped so that each leaves it in copy-on-write
        mode (optimizers apply the IndexedSlices with them; in TF's copy-on-read
        mode every later dense read would copy the whole table).

    Returns:
      ``[..., D]`` in ``params``' dtype (accumulated in float32). For ragged
      ``indices`` of ragged rank 1 a dense ``[B, D]`` tensor; for deeper ragged
      indices a RaggedTensor with the outer partitions of ``indices``.
    """
    _check_combiner(combiner, weights)
    _refuse_sparse_tensors(indices, weights)
    if sparse_gradient:
        _loss_scale_check.install()  # Keras' finiteness check missed an inf in a row listed twice
    if is_sharded(params):
        return sharded_embedding_bag(params, indices, weights, combiner, name, sparse_gradient)
    return fused_embedding_bag(params, indices, weights, combiner, name, sparse_gradient)
