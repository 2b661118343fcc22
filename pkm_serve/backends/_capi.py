"""ctypes over the C ABI (kernels/capi/pkm_capi.h) for torch tensors.

The forward/backward calls the PyTorch op makes: the core's CPU kernels on
host tensors (libpkm_capi_cpu.so), the CUDA launchers on device tensors and
torch's current stream (libpkm_cuda.so). The PkmBags mirror is checked against
the library's own layout (pkm_bags_layout) when a library loads.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from pkm_serve.backends import _native
from pkm_serve.backends._bag_problem import PkmBags, layout_mismatch

_ELEM_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
INVALID_ARGUMENT = -1


_libs = {}
_lock = threading.Lock()


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None and t.numel() > 0 else None


def _check_layout(lib):
    mismatch = layout_mismatch(lib)
    if mismatch:
        raise _native.NativeLibraryUnavailableError(f"pkm_serve: the C ABI library does not match: {mismatch}")


def library(device):
    """The loaded C ABI library for "cpu" or "cuda" (cached)."""
    with _lock:
        if device not in _libs:
            lib = ctypes.CDLL(_native.library_path("torch", device))
            _check_layout(lib)
            bags_p, vp, err = ctypes.POINTER(PkmBags), ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_size_t]
            lib.pkm_cpu_forward.argtypes = [bags_p, vp, ctypes.c_int] + err
            lib.pkm_cpu_backward.argtypes = [bags_p, vp, vp, vp, ctypes.c_int] + err
            if device == "cuda":
                lib.pkm_cuda_forward.argtypes = [bags_p, vp, vp, vp]
                lib.pkm_cuda_backward_workspace_bytes.argtypes = [bags_p, vp]
                lib.pkm_cuda_backward_workspace_bytes.restype = ctypes.c_size_t
                lib.pkm_cuda_backward.argtypes = [bags_p, vp, vp, vp, vp, ctypes.c_size_t, vp, vp]
                lib.pkm_cuda_last_error.restype = ctypes.c_char_p
            _libs[device] = lib
        return _libs[device]


def check_bag_tensors(table, indices, weights, row_splits):
    """What the kernels read through raw pointers, checked: the ops are callable directly
    (torch.ops.pkm_serve.*), past embedding_bag's own checks. TypeError / ValueError."""
    if table.dtype not in _ELEM_TYPES or table.dim() != 2:
        raise TypeError(f"table must be a [N, D] float32, float16 or bfloat16 tensor, got {tuple(table.shape)} "
                        f"{table.dtype}")
    for name, t in (("indices", indices), ("row_splits", row_splits)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if indices.dim() != (2 if row_splits is None else 1):
        raise ValueError(f"indices must be {'[B, K]' if row_splits is None else 'values [V]'}, got shape "
                         f"{tuple(indices.shape)}")
    if row_splits is not None and (row_splits.dim() != 1 or row_splits.shape[0] < 1):
        raise ValueError(f"row_splits must be a [B + 1] vector, got shape {tuple(row_splits.shape)}")
    if weights is not None and (weights.shape != indices.shape or weights.dtype != table.dtype):
        raise ValueError(f"weights must be {tuple(indices.shape)} {table.dtype} like the indices and table, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    for name, t in (("table", table), ("indices", indices), ("weights", weights), ("row_splits", row_splits)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels read it in storage order)")
        if t is not None and t.device != table.device:
            raise ValueError(f"{name} is on {t.device}, the table on {table.device}")


def make_bags(table, indices, weights, row_splits, combiner_code):
    """PkmBags over contiguous tensors on one device (which must outlive the call)."""
    check_bag_tensors(table, indices, weights, row_splits)
    bags = PkmBags()
    bags.table, bags.elem_type = _ptr(table), _ELEM_TYPES[table.dtype]
    bags.num_rows, bags.dim = table.shape
    bags.indices, bags.indices_int64 = _ptr(indices), int(indices.dtype == torch.int64)
    bags.num_indices = indices.numel()
    if row_splits is None:
        bags.num_bags, bags.bag_size = indices.shape
    else:
        bags.row_splits, bags.row_splits_int64 = _ptr(row_splits), int(row_splits.dtype == torch.int64)
        bags.num_bags = row_splits.numel() - 1
    bags.weights = _ptr(weights)
    bags.weights_type = _ELEM_TYPES[weights.dtype] if weights is not None else bags.elem_type
    bags.combiner = combiner_code
    return bags  # index_policy 0: negative indices are padding


def _raise_cuda(lib, rc, what):
    if rc != 0:
        message = lib.pkm_cuda_last_error().decode()
        raise (ValueError if rc == INVALID_ARGUMENT else RuntimeError)(f"{what}: {message}")


def forward(bags, out):
    """out [B, D] on bags' device <- the bag lookup."""
    if out.is_cuda:
        lib = library("cuda")
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _raise_cuda(lib, lib.pkm_cuda_forward(ctypes.byref(bags), _ptr(out), None, stream), "PkmEmbeddingBag")
        return
    err = ctypes.create_string_buffer(512)
    if library("cpu").pkm_cpu_forward(ctypes.byref(bags), _ptr(out), 0, err, len(err)) != 0:
        raise ValueError(f"PkmEmbeddingBag: {err.value.decode()}")


def backward(bags, grad, d_table, d_weights):
    """d_table [N, D] (and d_weights like the weights, or None) <- grad [B, D]."""
    if grad.is_cuda:
        lib = library("cuda")
        ws_bytes = lib.pkm_cuda_backward_workspace_bytes(ctypes.byref(bags), None)
        workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=grad.device)
        stream = torch.cuda.current_stream(grad.device).cuda_stream
        rc = lib.pkm_cuda_backward(ctypes.byref(bags), _ptr(grad), _ptr(d_table), _ptr(d_weights),
                                   _ptr(workspace), workspace.numel(), None, stream)
        _raise_cuda(lib, rc, "PkmEmbeddingBagGrad")
        return
    err = ctypes.create_string_buffer(512)
    rc = library("cpu").pkm_cpu_backward(ctypes.byref(bags), _ptr(grad), _ptr(d_table), _ptr(d_weights), 0,
                                         err, len(err))
    if rc != 0:
        raise ValueError(f"PkmEmbeddingBagGrad: {err.value.decode()}")
