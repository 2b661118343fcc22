"""The product-key search of a PKM read (Lample et al. 2019), as one TF function.

Each head splits its query in two halves, scores each half against its own
n_keys sub-keys, keeps the top knn of each, and ranks the knn x knn sums; slot
i * n_keys + j of the n_keys^2 value table gets the softmax of its score. Tied
scores pick the lowest indices, as on the other Keras backends. The
value lookup itself (an EmbeddingBag over the slots) is left to the caller:
the fused op, the Keras layer or a composite gather.
"""

from __future__ import annotations


def top_k_lowest_ties(scores, k: int):
    """tf.math.top_k over the last axis, (values, indices) in ascending index order, where scores tied
    at the k-th value go to the lowest indices. top_k(sorted=True) orders ties by index on TF's kernels,
    XLA and TFLite (sorted=False keeps other tied entries per runtime); a top_k of the k kept indices
    then puts them in index order, which makes the pair search's ties go to the lowest slot."""
    import tensorflow as tf

    from pkm_serve import _xla

    batch_dims = len(scores.shape) - 1
    if _xla.compile_device_type() is None and not _xla.cpu_autoclustering():
        values, index = tf.math.top_k(scores, k=k, sorted=True)
        ascending = tf.math.top_k(-index, k=k, sorted=True).indices  # k distinct keys: no ties
        return tf.gather(values, ascending, batch_dims=batch_dims), tf.gather(index, ascending, batch_dims=batch_dims)
    # XLA's TopK ranks in IEEE total order, 0.0 above -0.0, where TF's kernel and TFLite tie them:
    # ranked with -0.0 as 0.0, the values gathered from the scores themselves (their gradient).
    # Only there: outside XLA the extra pass cost the search ~10%.
    ranked = tf.where(tf.equal(scores, 0), tf.zeros_like(scores), scores)
    index = tf.math.top_k(ranked, k=k, sorted=True).indices
    ascending = tf.math.top_k(-index, k=k, sorted=True).indices
    index = tf.gather(index, ascending, batch_dims=batch_dims)
    return tf.gather(scores, index, batch_dims=batch_dims), index


def product_key_search(query, sub_keys, knn: int):
    """query [B, heads, 2, half], sub_keys [heads, 2, n_keys, half] ->
    (slots int64 [B, heads*knn], softmax weights float32 [B, heads*knn])."""
    import tensorflow as tf  # here, so that importing pkm_serve stays free of TensorFlow

    num_rows = tf.shape(query)[0]
    heads, n_keys = sub_keys.shape[0], sub_keys.shape[2]
    keys = tf.cast(sub_keys, query.dtype)
    # [B, heads, 2 halves, n_keys] scores against each half's sub-keys.
    sub_scores = tf.einsum("bhsd,hsnd->bhsn", query, keys)
    sub_best, sub_index = top_k_lowest_ties(sub_scores, knn)
    sub_index = tf.cast(sub_index, tf.int64)  # slot = i * n_keys + j can exceed 2^31
    # knn x knn candidates per head: score s1[i] + s2[j], slot i * n_keys + j.
    pair_scores = sub_best[:, :, 0, :, None] + sub_best[:, :, 1, None, :]
    pair_index = sub_index[:, :, 0, :, None] * n_keys + sub_index[:, :, 1, None, :]
    pair_scores = tf.reshape(pair_scores, [num_rows, heads, knn * knn])
    pair_index = tf.reshape(pair_index, [num_rows, heads, knn * knn])
    # Ties go to the lowest pair position, i.e. the lowest slot (both halves' indices ascend).
    best_scores, best_pos = top_k_lowest_ties(pair_scores, knn)
    best_index = tf.gather(pair_index, best_pos, batch_dims=2)
    weights = tf.nn.softmax(tf.cast(best_scores, tf.float32), axis=-1)
    return (tf.reshape(best_index, [num_rows, heads * knn]),
            tf.reshape(weights, [num_rows, heads * knn]))
