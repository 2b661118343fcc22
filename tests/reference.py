"""The one numpy reference the Python tests compare the kernels against.

float64 throughout and loops over bags, so it shares nothing with the kernels
(float32 accumulation, vector code) or with TF's composite. Semantics as in
DESIGN.md "The op": a negative index is padding (adds nothing, not counted by
mean/sqrtn); sum = sum w*x, mean = sum(w*x)/sum(w), sqrtn = sum(w*x)/sqrt(sum w^2);
a zero denominator gives 0; max = elementwise max over the valid rows (0 for an
empty bag, no weights), its gradient to the row holding each maximum, ties to
the first position.
"""

import numpy as np


def combine_bag(table, ids, weights=None, combiner="sum"):
    """One bag: [D] float64 from the rows `ids` of `table` (weights: one per id, None = ones)."""
    table = np.asarray(table, np.float64)
    ids = np.asarray(ids, np.int64).reshape(-1)
    w = np.ones(ids.shape) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    keep = ids >= 0
    ids, w = ids[keep], w[keep]
    if combiner == "max":
        return table[ids].max(axis=0) if len(ids) else np.zeros(table.shape[1])
    total = np.zeros(table.shape[1])
    for index, weight in zip(ids, w):
        total += weight * table[index]
    denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
    return total / denom if denom != 0 else np.zeros_like(total)


def bag_list(table, bags, weights=None, combiner="sum"):
    """A list of bags (each a list of ids, any lengths) -> [len(bags), D]."""
    out = np.zeros((len(bags), np.shape(table)[1]))
    for b, ids in enumerate(bags):
        out[b] = combine_bag(table, ids, None if weights is None else weights[b], combiner)
    return out


def embedding_bag(table, indices, weights=None, combiner="sum"):
    """Dense bags: indices [..., K] (weights shaped like them, None = ones) -> [..., D]."""
    indices = np.asarray(indices)
    flat_ids = indices.reshape(-1, indices.shape[-1])
    flat_w = None if weights is None else np.asarray(weights, np.float64).reshape(flat_ids.shape)
    out = bag_list(table, list(flat_ids), None if flat_w is None else list(flat_w), combiner)
    return out.reshape(indices.shape[:-1] + (np.shape(table)[1],))


def ragged_embedding_bag(table, values, row_splits, weights=None, combiner="sum"):
    """Ragged bags: bag b holds values[row_splits[b]:row_splits[b+1]] -> [len(row_splits)-1, D]."""
    values = np.asarray(values)
    bags = [values[row_splits[b]:row_splits[b + 1]] for b in range(len(row_splits) - 1)]
    w = None
    if weights is not None:
        weights = np.asarray(weights, np.float64)
        w = [weights[row_splits[b]:row_splits[b + 1]] for b in range(len(row_splits) - 1)]
    return bag_list(table, bags, w, combiner)


def embedding_bag_sum_grads(table, indices, weights, grad_out):
    """Gradients of the dense sum combiner: d_table [N, D] and d_weights shaped like indices."""
    table = np.asarray(table, np.float64)
    indices = np.asarray(indices)
    weights = np.asarray(weights, np.float64)
    grad_out = np.asarray(grad_out, np.float64)
    d_table = np.zeros_like(table)
    d_weights = np.zeros(indices.shape)
    for b in range(indices.shape[0]):
        for k in range(indices.shape[1]):
            r = indices[b, k]
            if r >= 0:
                d_table[r] += weights[b, k] * grad_out[b]
                d_weights[b, k] = grad_out[b] @ table[r]
    return d_table, d_weights


def product_key_memory(layer, x):
    """Inference-mode PKM output computed from a ProductKeyMemory layer's weights.

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
            top1 = np.argsort(-s1, kind="stable")[:knn]  # tied scores: the lowest index
            top2 = np.argsort(-s2, kind="stable")[:knn]
            candidates = [(s1[i] + s2[j], i * n_keys + j) for i in top1 for j in top2]
            candidates.sort(key=lambda c: (-c[0], c[1]))
            best = candidates[:knn]
            scores = np.array([c[0] for c in best])
            slots = np.array([c[1] for c in best])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[row] += p @ values[slots]
    return out.reshape(lead_shape + (values.shape[1],))


def bag_forward_backward(table, bags, weights, combiner, grad):
    """bags: list of index lists (negative = padding); weights: matching lists
    or None; grad: [len(bags), D] upstream gradient. Returns (out, d_table,
    d_weights as a list of lists), all float64."""
    table = np.asarray(table, np.float64)
    grad = np.asarray(grad, np.float64)
    out = np.zeros((len(bags), table.shape[1]))
    d_table = np.zeros_like(table)
    d_weights = []
    for b, bag in enumerate(bags):
        ws = np.ones(len(bag)) if weights is None else np.asarray(weights[b], np.float64)
        valid = [j for j, i in enumerate(bag) if i >= 0]
        if combiner == "max":
            d_weights.append(np.zeros(len(bag)))
            if valid:
                rows = table[[bag[j] for j in valid]]
                first_max = rows.argmax(axis=0)  # numpy's argmax: the first of equal maxima
                out[b] = rows[first_max, np.arange(table.shape[1])]
                for col, k in enumerate(first_max):
                    d_table[bag[valid[k]], col] += grad[b, col]
            continue
        s = sum((ws[j] * table[bag[j]] for j in valid), np.zeros(table.shape[1]))
        w_sum = sum(ws[j] for j in valid)
        w_sq = sum(ws[j] ** 2 for j in valid)
        denom = {"sum": 1.0, "mean": w_sum, "sqrtn": np.sqrt(w_sq)}[combiner]
        dw = np.zeros(len(bag))
        if denom != 0:
            out[b] = s / denom
            for j in valid:
                x = table[bag[j]]
                d_table[bag[j]] += ws[j] * grad[b] / denom
                if combiner == "sum":
                    dw[j] = grad[b] @ x
                elif combiner == "mean":
                    dw[j] = grad[b] @ (x - out[b]) / denom
                else:
                    dw[j] = (grad[b] @ x - (grad[b] @ out[b]) * ws[j] / denom) / denom
        d_weights.append(dw)
    return out, d_table, d_weights


def dequantize_rows(q, scales, biases=None):
    """A row-wise int8 table as float64: row r = scales[r] * q[r] + biases[r]."""
    q = np.asarray(q, np.float64)
    scales = np.asarray(scales, np.float64).reshape(-1, 1)
    biases = np.zeros_like(scales) if biases is None else np.asarray(biases, np.float64).reshape(-1, 1)
    return scales * q + biases
