"""float64 reference of the row-wise optimizers the fused backward applies
(kernels/core/row_optimizer.h): the table gradient from tests/reference.py's
bag_forward_backward, then the update of every touched row (rows no valid
index names, and their state, stay as they are)."""

import numpy as np

from tests.reference import bag_forward_backward


def touched_rows(indices, num_rows):
    flat = np.asarray(indices).reshape(-1)
    return np.unique(flat[(flat >= 0) & (flat < num_rows)])


def apply_rows(kind, table, grad_rows, rows, state, lr, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=1):
    """Updates float64 copies of table/state at `rows` with gradient rows
    grad_rows [len(rows), D]; returns (table, state)."""
    # The hyperparameters are float32 in every implementation (Keras casts them
    # to the variable's dtype): 1 - float32(0.999) is 1.3e-5 off 0.001.
    lr, epsilon, beta_1, beta_2 = (float(np.float32(x)) for x in (lr, epsilon, beta_1, beta_2))
    table = np.array(table, np.float64)
    state = tuple(np.array(s, np.float64) for s in state)
    g = np.asarray(grad_rows, np.float64)
    if kind == "sgd":
        table[rows] -= lr * g
    elif kind == "rowwise_adagrad":
        (acc,) = state
        acc[rows] += np.mean(g * g, axis=1)
        table[rows] -= lr * g / np.sqrt(acc[rows] + epsilon)[:, None]
    elif kind == "adam":
        m, v = state
        alpha = lr * np.sqrt(1 - beta_2 ** step) / (1 - beta_1 ** step)
        m[rows] += (g - m[rows]) * (1 - beta_1)
        v[rows] += (g * g - v[rows]) * (1 - beta_2)
        table[rows] -= alpha * m[rows] / (np.sqrt(v[rows]) + epsilon)
    else:
        raise ValueError(kind)
    return table, state


def fused_update(kind, table, indices, weights, combiner, grad, state, **hyper):
    """(new table, new state, d_weights [B, K]) in float64 for dense bags [B, K]."""
    bags = [list(row) for row in np.asarray(indices)]
    w = None if weights is None else [list(row) for row in np.asarray(weights, np.float64)]
    _, d_table, d_weights = bag_forward_backward(table, bags, w, combiner, grad)
    rows = touched_rows(indices, table.shape[0])
    new_table, new_state = apply_rows(kind, table, d_table[rows], rows, state, **hyper)
    return new_table, new_state, np.array(d_weights)


def initial_state(kind, num_rows, dim, rng=None):
    """A non-trivial starting state (as after some steps)."""
    rng = rng or np.random.default_rng(0)
    if kind == "sgd":
        return ()
    if kind == "rowwise_adagrad":
        return (rng.uniform(0.05, 0.5, num_rows).astype(np.float32),)
    return (rng.normal(0, 0.01, (num_rows, dim)).astype(np.float32),
            rng.uniform(1e-5, 1e-3, (num_rows, dim)).astype(np.float32))
