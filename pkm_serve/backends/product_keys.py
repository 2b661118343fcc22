"""The product-key search of a PKM read in `keras.ops`, for the JAX and
PyTorch backends (TF keeps pkm_serve.product_keys, which export and serving
share). Same arithmetic: per head, the top knn of each half's sub-key scores,
their knn x knn sums, the best knn slots i * n_keys + j with softmax weights; ties
to the lowest index."""

from __future__ import annotations

import sys

import keras
from keras import ops


def top_k_lowest_ties(scores, k: int):
    """ops.top_k over the last axis, (values, indices) in ascending index order, ties at the k-th
    value to the lowest indices (-0.0 tied with 0.0); as pkm_serve.product_keys. torch.topk orders
    ties its own way, so PyTorch takes a stable sort's first k; JAX's ranking is chosen when lowered
    (pkm_serve.backends.jax_top_k). The values are gathered from the scores (their gradient)."""
    if keras.backend.backend() == "jax":
        from pkm_serve.backends.jax_top_k import top_k_indices

        index = top_k_indices(scores, k)
        return _take_along_last_axis(scores, index), index
    if keras.backend.backend() == "torch":
        import torch

        index = torch.sort(scores, dim=-1, descending=True, stable=True)[1][..., :k]
    else:   # (-0.0 ranked as 0.0: an IEEE total-order top_k puts 0.0 first)
        index = ops.top_k(ops.where(scores == 0, ops.zeros_like(scores), scores), k=k, sorted=True)[1]
    index = _take_along_last_axis(index, ops.top_k(-index, k=k, sorted=True)[1])   # k distinct: no ties
    return _take_along_last_axis(scores, index), index


def _take_along_last_axis(x, index):
    """ops.take_along_axis(x, index, axis=-1); torch.gather under PyTorch, where Keras' take_along_dim
    (it broadcasts) fixed the batch size under torch.export (a dynamic batch was refused)."""
    if keras.backend.backend() == "torch":
        import torch

        return torch.gather(x, -1, index.long())
    return ops.take_along_axis(x, index, axis=-1)


def _under_jax_export(scores):
    """True under JAX for arrays of a symbolic shape (jax.export's shape polymorphism: model.export's
    None batch), for any traced while TensorFlow builds a graph (jax2tf.convert inside a tf.function:
    model.export with a fixed-batch input_signature) and for any traced by jax2tf or jax.export
    themselves (jax2tf.convert called eagerly): there a host callback cannot be serialised. Read at
    trace time, so a jitted function traced before for a call keeps that trace when exported (the
    product-key search decides when lowered instead: pkm_serve.backends.jax_top_k)."""
    if keras.backend.backend() != "jax":
        return False
    if not all(isinstance(d, int) for d in scores.shape):
        return True
    tf = sys.modules.get("tensorflow")   # (never imported here: without it, no TF graph is built)
    if tf is not None and hasattr(tf, "inside_function") and tf.inside_function():
        return True
    return _called_from(_EXPORTING_MODULES)


# Modules whose frames below a trace mean it is being serialised (jax2tf's, jax.export's).
_EXPORTING_MODULES = ("jax.experimental.jax2tf", "jax._src.export")


def _called_from(prefixes):
    """Whether a frame of a module named with one of `prefixes` is on the stack (read at trace time
    only: the jitted computation keeps what the trace chose)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(prefixes):
            return True
        frame = frame.f_back
    return False


def product_key_search(query, sub_keys, knn: int):
    """query [B, heads, 2, half], sub_keys [heads, 2, n_keys, half] ->
    (slots [B, heads*knn] int32, or int64 when n_keys**2 needs it; softmax
    weights float32 [B, heads*knn])."""
    num_rows = query.shape[0]
    heads, n_keys = sub_keys.shape[0], sub_keys.shape[2]
    index_dtype = "int32" if n_keys * n_keys < 2**31 else "int64"
    sub_scores = ops.einsum("bhsd,hsnd->bhsn", query, ops.cast(sub_keys, query.dtype))
    sub_best, sub_index = top_k_lowest_ties(sub_scores, knn)
    sub_index = ops.cast(sub_index, index_dtype)
    pair_scores = sub_best[:, :, 0, :, None] + sub_best[:, :, 1, None, :]
    pair_index = sub_index[:, :, 0, :, None] * n_keys + sub_index[:, :, 1, None, :]
    pair_scores = ops.reshape(pair_scores, (num_rows, heads, knn * knn))
    pair_index = ops.reshape(pair_index, (num_rows, heads, knn * knn))
    best_scores, best_pos = top_k_lowest_ties(pair_scores, knn)
    best_index = _take_along_last_axis(pair_index, ops.cast(best_pos, index_dtype))
    best_scores = ops.cast(best_scores, "float32")
    # knn=1: one slot of weight 1 (keras.ops.softmax warned "softmax over axis ... has size 1 ... Did you
    # mean to use a sigmoid" at every call); exp(s - s) keeps the scores' (zero) gradient.
    weights = ops.softmax(best_scores, axis=-1) if knn > 1 else ops.exp(best_scores - best_scores)
    return (ops.reshape(best_index, (num_rows, heads * knn)),
            ops.reshape(weights, (num_rows, heads * knn)))
