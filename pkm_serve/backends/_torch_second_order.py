"""Second derivatives of the PyTorch op: the gradient of its gradient op.

`torch.autograd.grad(..., create_graph=True)` (a gradient penalty, a Hessian-vector product) then
differentiates `pkm_serve::embedding_bag_backward`, which had no autograd formula. As on TF
(pkm_serve/_second_order.py), the gradient op's output is the gradient of the lookup written in torch
ops (a [B, K, D] gather, on this path only), so its own gradient is taken by differentiating that
with `torch.func.vjp`, in torch ops that autograd follows to higher orders. For `max` the first
derivative routes each column to the first row holding its maximum, as the kernels do.
"""

from __future__ import annotations

import torch

COMBINERS = {0: "sum", 1: "mean", 2: "sqrtn", 3: "max"}


def _dense_bags(indices, weights, row_splits):
    """Ragged values [V] + row_splits [B+1] as [B, K] ids padded with -1 (and weights with 0)."""
    if row_splits is None:
        return indices, weights
    lengths = (row_splits[1:] - row_splits[:-1]).long()
    width = int(lengths.max()) if lengths.numel() else 0
    slot = torch.arange(width, device=indices.device)
    inside = slot[None, :] < lengths[:, None]
    position = (row_splits[:-1].long()[:, None] + slot[None, :]).clamp(max=max(indices.shape[0] - 1, 0))
    ids = torch.where(inside, indices.long()[position], -1) if indices.numel() else \
        torch.full(inside.shape, -1, dtype=torch.long, device=indices.device)
    if weights is None:
        return ids, None
    w = torch.where(inside, weights[position], 0) if weights.numel() else ids.new_zeros(inside.shape, dtype=weights.dtype)
    return ids, w


def lookup(table, indices, weights, combiner, row_splits=None):
    """The fused lookup in torch ops: table [N, D]; indices [B, K] (or values + row_splits) -> [B, D]."""
    indices, weights = _dense_bags(indices, weights, row_splits)
    # Ids past the table are padding here: the forward already refused them on the CPU (GPU: padding).
    valid = (indices >= 0) & (indices < table.shape[0])
    rows = table[torch.where(valid, indices, 0).long()].float()  # [B, K, D]
    if combiner == "max":
        masked = torch.where(valid[..., None], rows, float("-inf"))
        first = masked.argmax(dim=1, keepdim=True)  # the first maximum (a NaN counts as one)
        top = masked.gather(1, first).squeeze(1)
        return torch.where(valid.any(dim=1)[:, None], top, 0.0).to(table.dtype)
    w = valid.float() if weights is None else weights.float() * valid
    total = (rows * w[..., None]).sum(dim=1)
    if combiner in ("mean", "sqrtn"):
        # Guarded before the root: sqrt's derivative at 0 made the second derivative NaN for the
        # weights of an all-padding bag (which have no effect: 0, as on TF).
        sums = w.sum(dim=1) if combiner == "mean" else (w * w).sum(dim=1)
        nonzero = (sums != 0)[:, None]
        safe = torch.where(nonzero, sums[:, None], 1.0)
        total = torch.where(nonzero, total / (safe if combiner == "mean" else safe.sqrt()), 0.0)
    return total.to(table.dtype)


def setup_context(ctx, inputs, output):
    grad, table, indices, weights, row_splits, combiner = inputs
    ctx.save_for_backward(grad, table, indices, weights, row_splits)
    ctx.combiner = COMBINERS[combiner]


def backward(ctx, d_d_table, d_d_weights):
    """The gradient op's vjp: (d grad, d table, None, d weights, None, None)."""
    grad, table, indices, weights, row_splits = ctx.saved_tensors
    has_weights = weights is not None

    def first_derivative(grad, table, *weights):
        def forward(table, *weights):
            return lookup(table, indices, weights[0] if weights else None, ctx.combiner, row_splits)

        return torch.func.vjp(forward, table, *weights)[1](grad)

    primals = (grad, table) + ((weights,) if has_weights else ())
    cotangents = (d_d_table,) + ((d_d_weights,) if has_weights else ())
    d_grad, d_table, *d_weights = torch.func.vjp(first_derivative, *primals)[1](cotangents)
    return d_grad, d_table, None, (d_weights[0] if has_weights else None), None, None
