"""The PyTorch op under forward-mode AD and `torch.func` transforms.

`pkm_serve::embedding_bag`'s autograd comes from `register_autograd`, whose generated
`autograd.Function` has no `setup_context` staticmethod and no `jvp`: `torch.func.grad`, `vjp`,
`jacrev` and `hessian` failed ("must override the setup_context staticmethod", PyTorch issues
168393, 170834), and forward-mode AD (`torch.func.jvp`, `jacfwd`, `torch.autograd.forward_ad`)
ran the op without its tangent: a zero tangent, silently. Where such a transform is active the
lookup goes through `TransformableBag` instead, an `autograd.Function` with both: its forward is
the kernel's; its jvp, and its backward wherever a transform is active (torch.func.grad, jacrev,
hessian: the backward runs inside the transform), differentiate the lookup written in torch ops
(`_torch_second_order.lookup`, a [B, K, D] gather, on these paths only).
Plain autograd, `torch.compile` and `torch.export` keep calling the op itself: dynamo cannot trace
this Function's jvp. Under torch.compile, vmap works, torch.func.grad of the op fails (a fake-tensor
error), and forward-mode AD is refused (it traced a zero tangent, silently): a graph break, so the
transform runs eagerly, or an error with fullgraph=True.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad
from torch._C._functorch import TransformType

from pkm_serve.backends import _torch_second_order


def transforms_active(*tensors):
    """True inside a torch.func transform but functionalize, or where a tensor carries a forward-mode
    tangent."""
    if torch.compiler.is_compiling():
        # Dynamo cannot trace TransformableBag's jvp, and traced the op under torch.func.jvp / jacfwd
        # with a zero tangent, silently: refused, so that torch.compile runs the transform eagerly
        # (a graph break), or fullgraph=True fails.
        if _carries_tangent(tensors):
            raise NotImplementedError("pkm_serve.embedding_bag: forward-mode AD (torch.func.jvp, jacfwd, "
                                      "forward_ad) through the op cannot be compiled; run it eagerly")
        return False
    innermost = torch._C._functorch.peek_interpreter_stack()
    if innermost is not None and innermost.key() != TransformType.Functionalize:
        return True   # (functionalize has no rule for an autograd.Function: "NYI"; the op is functional)
    return _carries_tangent(tensors)


def _carries_tangent(tensors):
    if forward_ad._current_level < 0:
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _reference_first_derivative(grad, table, indices, weights, row_splits, combiner):
    """(d table, d weights) of the torch-ops lookup, which transforms can differentiate again."""
    def lookup(table, *weights):
        return _torch_second_order.lookup(table, indices, weights[0] if weights else None, combiner, row_splits)

    primals = (table,) + (() if weights is None else (weights,))
    d_table, *d_weights = torch.func.vjp(lookup, *primals)[1](grad.to(table.dtype))
    return d_table, (d_weights[0] if d_weights else None)


class TransformableBag(torch.autograd.Function):
    """The op for forward-mode AD and torch.func (module docstring); vmap runs the op per row. It calls
    the ops torch_ops registers (torch.ops.pkm_serve), which only torch_ops uses this from."""

    generate_vmap_rule = True

    @staticmethod
    def forward(table, indices, weights, row_splits, combiner):
        return torch.ops.pkm_serve.embedding_bag(table, indices, weights, row_splits, combiner)

    @staticmethod
    def setup_context(ctx, inputs, output):
        table, indices, weights, row_splits, combiner = inputs
        ctx.save_for_backward(table, indices, weights, row_splits)
        ctx.save_for_forward(table, indices, weights, row_splits)
        ctx.combiner = combiner

    @staticmethod
    def backward(ctx, grad):
        table, indices, weights, row_splits = ctx.saved_tensors
        if transforms_active(grad, table, weights):  # differentiated again (hessian, jacfwd of jacrev)
            d_table, d_weights = _reference_first_derivative(
                grad, table, indices, weights, row_splits, _torch_second_order.COMBINERS[ctx.combiner])
        else:
            d_table, d_weights = torch.ops.pkm_serve.embedding_bag_backward(grad, table, indices, weights,
                                                                            row_splits, ctx.combiner)
        return d_table, None, (d_weights if weights is not None else None), None, None

    @staticmethod
    def jvp(ctx, d_table, d_indices, d_weights, d_row_splits, d_combiner):
        table, indices, weights, row_splits = ctx.saved_tensors
        combiner = _torch_second_order.COMBINERS[ctx.combiner]

        def lookup(table, *weights):
            return _torch_second_order.lookup(table, indices, weights[0] if weights else None, combiner,
                                              row_splits)

        primals = (table,) + (() if weights is None else (weights,))
        tangents = (torch.zeros_like(table) if d_table is None else d_table,)
        if weights is not None:
            tangents += (torch.zeros_like(weights) if d_weights is None else d_weights,)
        # J t as the vjp of the (linear) vjp, reverse mode twice: a torch.func.jvp here would nest
        # forward-mode AD inside torch.autograd.forward_ad's, which PyTorch refuses.
        output, pullback = torch.func.vjp(lookup, *primals)
        return torch.func.vjp(pullback, torch.zeros_like(output))[1](tangents)[0]
