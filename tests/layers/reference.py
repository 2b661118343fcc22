"""Independent numpy references for the layers (float64, loops where that is clearer)."""
import numpy as np


def embedding_bag_numpy(table, indices, weights=None, combiner="sum"):
    """Dense [..., K] indices (negative = padding) -> [..., D] in float64."""
    table = np.asarray(table, np.float64)
    indices = np.asarray(indices)
    flat_idx = indices.reshape(-1, indices.shape[-1])
    flat_w = (
        np.ones(flat_idx.shape) if weights is None else np.asarray(weights, np.float64).reshape(flat_idx.shape)
    )
    out = np.zeros((flat_idx.shape[0], table.shape[1]))
    for bag, (row_idx, row_w) in enumerate(zip(flat_idx, flat_w)):
        out[bag] = ragged_bag_numpy(table, row_idx, row_w, combiner)
    return out.reshape(indices.shape[:-1] + (table.shape[1],))


def ragged_bag_numpy(table, bag_indices, bag_weights, combiner):
    total = np.zeros(table.shape[1])
    w_sum = 0.0
    w_sq = 0.0
    for index, weight in zip(bag_indices, bag_weights):
        if index < 0:
            continue
        total += weight * table[index]
        w_sum += weight
        w_sq += weight * weight
    if combiner == "mean":
        return total / w_sum if w_sum != 0 else np.zeros_like(total)
    if combiner == "sqrtn":
        return total / np.sqrt(w_sq) if w_sq != 0 else np.zeros_like(total)
    return total


def product_key_memory_numpy(layer, x):
    """Inference-mode PKM output computed from the layer's weights, in float64.

    Follows the paper's reference code (XLM HashingMemory.get_indices) head by
    head and row by row."""
    x = np.asarray(x, np.float64)
    lead_shape, d_model = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, d_model)
    kernel = np.asarray(layer.query_proj.kernel.numpy(), np.float64)
    bias = np.asarray(layer.query_proj.bias.numpy(), np.float64)
    query = x @ kernel + bias
    if layer.query_bn is not None:
        bn = layer.query_bn
        query = (query - bn.moving_mean.numpy()) / np.sqrt(bn.moving_variance.numpy() + bn.epsilon)
        query = query * bn.gamma.numpy() + bn.beta.numpy()
    keys = np.asarray(layer.keys.numpy(), np.float64)  # [heads, 2, n_keys, half]
    values = np.asarray(layer.memory.embeddings.numpy(), np.float64)
    heads, knn, n_keys, half = layer.heads, layer.knn, layer.n_keys, layer.k_dim // 2
    out = np.zeros((x.shape[0], values.shape[1]))
    for row in range(x.shape[0]):
        for head in range(heads):
            q = query[row, head * layer.k_dim : (head + 1) * layer.k_dim]
            s1 = keys[head, 0] @ q[:half]
            s2 = keys[head, 1] @ q[half:]
            top1 = np.argsort(-s1)[:knn]
            top2 = np.argsort(-s2)[:knn]
            candidates = [(s1[i] + s2[j], i * n_keys + j) for i in top1 for j in top2]
            candidates.sort(key=lambda c: -c[0])
            best = candidates[:knn]
            scores = np.array([c[0] for c in best])
            slots = np.array([c[1] for c in best])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[row] += p @ values[slots]
    return out.reshape(lead_shape + (values.shape[1],))
