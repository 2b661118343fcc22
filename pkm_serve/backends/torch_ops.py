"""The bag lookup under PyTorch: a `torch.library` custom op over the C ABI.

`pkm_serve::embedding_bag` (and its gradient op) run the core's CPU kernels on
CPU tensors and the CUDA launchers on CUDA tensors, on torch's current stream.
`register_autograd` wires the gradient op in (and its own gradient, for double
backward: _torch_second_order); `register_fake` gives both ops
shapes without running them, so `torch.compile` traces through them. On a CPU
an index >= N is a ValueError naming it (the core's message); on a GPU it is
read as padding, as in the TF GPU kernel.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

import torch

from pkm_serve.backends import _capi, _native, _torch_second_order, _torch_transforms

TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_available = {}  # device type -> None (kernel loads) or the error
_warned = set()


@torch.library.custom_op("pkm_serve::embedding_bag", mutates_args=())
def _bag_op(table: torch.Tensor, indices: torch.Tensor, weights: Optional[torch.Tensor],
            row_splits: Optional[torch.Tensor], combiner: int) -> torch.Tensor:
    bags = _capi.make_bags(table, indices, weights, row_splits, combiner)
    out = torch.empty((bags.num_bags, table.shape[1]), dtype=table.dtype, device=table.device)
    _capi.forward(bags, out)
    return out


@torch.library.custom_op("pkm_serve::embedding_bag_backward", mutates_args=())
def _bag_grad_op(grad: torch.Tensor, table: torch.Tensor, indices: torch.Tensor,
                 weights: Optional[torch.Tensor], row_splits: Optional[torch.Tensor],
                 combiner: int) -> tuple[torch.Tensor, torch.Tensor]:
    bags = _capi.make_bags(table, indices, weights, row_splits, combiner)
    if grad.shape != (bags.num_bags, bags.dim) or grad.dtype != table.dtype or grad.device != table.device:
        raise ValueError(f"grad must be [{bags.num_bags}, {bags.dim}] {table.dtype} on {table.device}, got "
                         f"{tuple(grad.shape)} {grad.dtype} on {grad.device}")
    d_table = torch.empty_like(table)
    # No weights: an empty d_weights (an op returns tensors only).
    d_weights = torch.empty_like(weights) if weights is not None else table.new_empty([0])
    _capi.backward(bags, grad.contiguous(), d_table, d_weights if weights is not None else None)
    return d_table, d_weights


@_bag_op.register_fake
def _(table, indices, weights, row_splits, combiner):
    num_bags = indices.shape[0] if row_splits is None else row_splits.shape[0] - 1
    return table.new_empty((num_bags, table.shape[1]))


@_bag_grad_op.register_fake
def _(grad, table, indices, weights, row_splits, combiner):
    return torch.empty_like(table), (torch.empty_like(weights) if weights is not None else table.new_empty([0]))


def _setup_context(ctx, inputs, output):
    table, indices, weights, row_splits, combiner = inputs
    ctx.save_for_backward(table, indices, weights, row_splits)
    ctx.combiner = combiner


def _backward(ctx, grad):
    table, indices, weights, row_splits = ctx.saved_tensors
    d_table, d_weights = _bag_grad_op(grad, table, indices, weights, row_splits, ctx.combiner)
    return d_table, None, (d_weights if weights is not None else None), None, None


_bag_op.register_autograd(_backward, setup_context=_setup_context)
# create_graph=True differentiates the gradient op too (a gradient penalty, a Hessian-vector product).
_bag_grad_op.register_autograd(_torch_second_order.backward, setup_context=_torch_second_order.setup_context)


def kernel_device(device):
    """'cpu' or 'cuda' when our library serves tensors on `device` (or 'meta'), else None."""
    kind = torch.device(device).type
    if kind == "meta":  # shape inference (Keras' symbolic build): the fake kernel serves it
        return kind
    if kind not in ("cpu", "cuda"):
        return None
    return kind if _library_loads(kind) else None


def _marked_constant_for_torch_compile(fn):
    """torch.compiler.assume_constant_result(fn) without importing torch._dynamo, which that call
    does (~1 s added to every `import torch` after `import pkm_serve`, which registers these ops):
    the decorator only sets this mark (tests/backends/test_torch_import_cost.py checks it still does)."""
    fn._dynamo_marked_constant = True
    return fn


@_marked_constant_for_torch_compile
def _library_loads(kind):
    """Whether our library for `kind` loads (cached). A constant to torch.compile, which runs it while
    tracing: a first lookup inside torch.compile(fullgraph=True) failed on the loader's lock."""
    if kind not in _available:
        try:
            _capi.library(kind)
            _available[kind] = None
        except (OSError, AttributeError, _native.NativeLibraryUnavailableError) as err:
            _available[kind] = err
    return _available[kind] is None


def embedding_bag(params, indices, weights=None, combiner="sum", row_splits=None):
    """Fused bag lookup: params [N, D]; indices [..., K] int32/int64 (or
    values [V] with row_splits [B+1]); weights like indices or None -> [..., D]
    in params' dtype. Falls back to the composite (warning once) on a device
    without our kernels."""
    code = _native.combiner_code(combiner, weights)
    params, indices, weights, row_splits = (_unwrapped(x) for x in (params, indices, weights, row_splits))
    params = torch.as_tensor(params)   # (first: the others go to its device)
    indices = torch.as_tensor(indices, device=params.device)
    _check(params, indices, weights)
    if kernel_device(params.device) is None:
        _warn_composite(params.device)
        from pkm_serve.backends.composite import embedding_bag_composite

        return embedding_bag_composite(params, indices, weights, combiner, row_splits)
    w = None if weights is None else torch.as_tensor(weights, device=params.device).to(params.dtype)
    if w is not None and w.shape != indices.shape:
        raise ValueError(f"weights shape {tuple(w.shape)} must equal indices shape {tuple(indices.shape)}")
    if row_splits is not None:
        row_splits = torch.as_tensor(row_splits, device=params.device)
        if row_splits.dtype not in (torch.int32, torch.int64):  # the kernel reads them as one of these
            raise TypeError(f"row_splits must be int32 or int64, got {row_splits.dtype}")
        if indices.dim() != 1 or row_splits.dim() != 1 or row_splits.shape[0] < 1:
            raise ValueError("ragged bags need values [V] and row_splits [B+1] vectors, got "
                             f"{tuple(indices.shape)} and {tuple(row_splits.shape)}")
        return _bag(params.contiguous(), indices.contiguous(), _contiguous(w), row_splits.contiguous(), code)
    if indices.dim() == 0:
        raise ValueError("indices must have at least one dimension (the bag axis, [..., K]); got a scalar")
    lead, k = tuple(indices.shape[:-1]), indices.shape[-1]
    if k == 0:  # every bag empty: zeros, as on TF (the flat [-1, 0] view has no row count)
        # params[:0].sum(0) is zeros [D] that autograd links to the table (a zero gradient).
        return params.new_zeros(lead + (params.shape[1],)) + params[:0].sum(0)
    flat_w = None if w is None else w.reshape(-1, k).contiguous()
    out = _bag(params.contiguous(), indices.reshape(-1, k).contiguous(), flat_w, None, code)
    return out.reshape(lead + (params.shape[1],))


def _bag(table, indices, weights, row_splits, code):
    """The op; under forward-mode AD or torch.func, through an autograd.Function that supports them."""
    if _torch_transforms.transforms_active(table, weights):
        return _torch_transforms.TransformableBag.apply(table, indices, weights, row_splits, code)
    return _bag_op(table, indices, weights, row_splits, code)


def _unwrapped(x):
    """A Keras Variable's torch tensor (its gradient goes to the variable, as through keras.ops): torch
    cannot convert the Variable itself ("object of type 'Variable' has no len()"). Keras is not
    imported for this: without it there is no Keras Variable."""
    keras = sys.modules.get("keras")
    if isinstance(x, torch.Tensor) or x is None or keras is None or not isinstance(x, keras.Variable):
        return x
    return x.value


def _contiguous(t):
    return None if t is None else t.contiguous()


def _check(params, indices, weights):
    if params.dtype not in TABLE_DTYPES:
        raise TypeError(f"params must be float32, float16 or bfloat16, got {params.dtype}")
    if params.dim() != 2:
        raise ValueError(f"params must be a [N, D] matrix, got shape {tuple(params.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if weights is not None and not torch.as_tensor(weights).is_floating_point():
        raise TypeError(f"weights must be floating point, got {torch.as_tensor(weights).dtype}")


def _warn_composite(device):
    if device.type not in _warned:
        _warned.add(device.type)
        warnings.warn(f"pkm_serve.embedding_bag (PyTorch): no fused kernel for {device.type} "
                      f"({_available.get(device.type, 'unsupported device')}); using the composite "
                      "gather-multiply-reduce, which materialises the [..., K, D] gather in forward and "
                      "backward.", RuntimeWarning, stacklevel=3)


def unavailable_reason():
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return _available.get(kind, f"no pkm_serve kernel for torch device {kind!r}")
