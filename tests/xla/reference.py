"""float64 numpy forward and gradients of the EmbeddingBag contract, written
from the formulas (not from our kernels): out = combine(sum_j w_j x_j)."""
import numpy as np


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
