"""The bag lookup under JAX: `jax.ffi` calls into the typed-FFI handlers.

The handlers are the very ones TF's XLA runs (kernels/xla/*_targets.cc), in
libpkm_xla_cpu.so ("Host", on the core) and libpkm_xla_gpu.so ("CUDA", on the
launchers, XLA's stream and scratch allocator); neither links TensorFlow. A
`custom_vjp` routes the gradient to the backward handlers, so no [..., K, D]
buffer exists in either direction. Shapes are static (jit-safe); under `vmap`
the calls run once per batch element. On a CPU an index >= N fails the
computation with the core's message (as TF's InvalidArgument); on a GPU it is
read as padding, as in the TF GPU kernel.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pkm_serve.backends import _native

# XLA platform names the handlers register for, per JAX device kind.
_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}
_SYMBOL_PREFIX = {"cpu": "pkm_xla_cpu", "cuda": "pkm_xla_gpu"}
_HANDLERS = {  # custom-call target -> exported handler after the prefix
    "pkm_embedding_bag_forward": "forward",
    "pkm_embedding_bag_backward": "backward",
    "pkm_ragged_embedding_bag_forward": "ragged_forward",
    "pkm_ragged_embedding_bag_backward": "ragged_backward",
}
TABLE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
_registered = {}  # device kind -> True (targets registered) or the load error
_lock = threading.Lock()
_warned = set()


def _device_kind():
    platform = jax.default_backend()
    return "cuda" if platform == "gpu" else platform


def kernel_device():
    """'cpu' or 'cuda' when our handlers serve JAX's default device, else None."""
    kind = _device_kind()
    if kind not in _PLATFORMS:
        return None
    with _lock:
        if kind not in _registered:
            try:
                lib = ctypes.CDLL(_native.library_path("jax", kind))
                for target, handler in _HANDLERS.items():
                    symbol = getattr(lib, f"{_SYMBOL_PREFIX[kind]}_{handler}")
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform=_PLATFORMS[kind])
                _registered[kind] = True
            except (OSError, AttributeError, _native.NativeLibraryUnavailableError) as err:
                _registered[kind] = err
            except Exception as err:  # noqa: BLE001 - XLA refusing the handlers (JAX's own error type)
                _registered[kind] = _native.NativeLibraryUnavailableError(
                    f"JAX {jax.__version__} does not take pkm_serve's FFI handlers (built for XLA's FFI API 0.2, "
                    f"JAX >= 0.8.3): {err}")
    return kind if _registered[kind] is True else None


def unavailable_reason():
    kind = _device_kind()
    return _registered.get(kind, f"no pkm_serve kernel for JAX platform {kind!r}")


def _check_64_bit_ids(indices, name="indices"):
    """Without jax_enable_x64, jnp.asarray turns int64 ids into int32 and wraps any past 2^31
    (2^32 + 1 reads row 1; row_splits [0, 2^32 + 2] read as [0, 2]): host ids that do not fit
    are refused before that."""
    if isinstance(indices, (np.ndarray, list, tuple)) and not jax.config.jax_enable_x64:
        ids = np.asarray(indices)
        wide = ids.dtype.kind in "iu" and np.iinfo(ids.dtype).max >= 2**31  # int32 and narrower fit
        if wide and ids.size and (ids.min() < -2**31 or ids.max() >= 2**31):
            raise ValueError(f"{name} hold values past int32, which JAX without jax_enable_x64 wraps "
                             "around: enable it (jax.config.update('jax_enable_x64', True)) for such ids")


def embedding_bag(params, indices, weights=None, combiner="sum", row_splits=None):
    """Fused bag lookup: params [N, D]; indices [..., K] int32/int64 (or
    values [V] with row_splits [B+1]); weights like indices or None -> [..., D]
    in params' dtype. Falls back to the composite (warning once) where the
    default device has no kernel."""
    code = _native.combiner_code(combiner, weights)
    params = jnp.asarray(params)
    _check_64_bit_ids(indices)
    if row_splits is not None:
        _check_64_bit_ids(row_splits, "row_splits")
    indices = jnp.asarray(indices)
    _check_dtypes(params, indices, weights)
    if kernel_device() is None:
        _warn_composite()
        from pkm_serve.backends.composite import embedding_bag_composite

        return embedding_bag_composite(params, indices, weights, combiner, row_splits)
    has_weights = weights is not None
    w = jnp.asarray(weights).astype(params.dtype) if has_weights else jnp.zeros([0], params.dtype)
    if has_weights and w.shape != indices.shape:
        raise ValueError(f"weights shape {w.shape} must equal indices shape {indices.shape}")
    if row_splits is not None:
        row_splits = jnp.asarray(row_splits)
        if row_splits.dtype not in (jnp.int32, jnp.int64):
            raise TypeError(f"row_splits must be int32 or int64, got {row_splits.dtype}")
        if indices.ndim != 1 or row_splits.ndim != 1 or row_splits.shape[0] < 1:
            raise ValueError("ragged bags need values [V] and row_splits [B+1] vectors, got "
                             f"{indices.shape} and {row_splits.shape}")
        return _ragged_bag(code, has_weights, params, indices, row_splits, w)
    if indices.ndim == 0:
        raise ValueError("indices must have at least one dimension (the bag axis, [..., K]); got a scalar")
    lead, k = indices.shape[:-1], indices.shape[-1]
    if k == 0:  # every bag empty: zeros, as on TF (the flat [-1, 0] view has no row count)
        return jnp.zeros(lead + (params.shape[1],), params.dtype)
    flat_w = w.reshape(-1, k) if has_weights else w
    out = _dense_bag(code, has_weights, params, indices.reshape(-1, k), flat_w)
    return out.reshape(lead + (params.shape[1],))


def _check_dtypes(params, indices, weights):
    if params.dtype not in TABLE_DTYPES:
        raise TypeError(f"params must be float32, float16 or bfloat16, got {params.dtype}")
    if params.ndim != 2:
        raise ValueError(f"params must be a [N, D] matrix, got shape {params.shape}")
    if indices.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if weights is not None and not jnp.issubdtype(jnp.asarray(weights).dtype, jnp.floating):
        raise TypeError(f"weights must be floating point, got {jnp.asarray(weights).dtype}")


def _warn_composite():
    kind = _device_kind()
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"pkm_serve.embedding_bag (JAX): no fused kernel for {kind} ({unavailable_reason()}); "
                      "using the composite gather-multiply-reduce, which materialises the [..., K, D] "
                      "gather in forward and backward.", RuntimeWarning, stacklevel=3)


def _call(target, results, *operands, code, has_weights):
    # XLA replaces a call whose results are all zero-sized (a [N, 0] table, no bags) by constants, and the
    # ids would go unchecked; a side effect keeps the call, so an index >= N fails as for any other shape.
    zero_sized = all(0 in r.shape for r in (results if isinstance(results, tuple) else (results,)))
    return jax.ffi.ffi_call(target, results, vmap_method="sequential", has_side_effect=zero_sized)(
        *operands, combiner=np.int32(code), has_weights=np.int32(has_weights))


def _make_bag(prefix):
    """A custom_vjp bag function over the `prefix` forward/backward targets;
    index_args are (indices,) or (values, row_splits)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def bag(code, has_weights, params, index_args, w):
        num_bags = index_args[0].shape[0] if len(index_args) == 1 else index_args[1].shape[0] - 1
        out = jax.ShapeDtypeStruct((num_bags, params.shape[1]), params.dtype)
        return _call(f"{prefix}_forward", out, params, *index_args, w, code=code, has_weights=has_weights)

    def forward(code, has_weights, params, index_args, w):
        return bag(code, has_weights, params, index_args, w), (params, index_args, w)

    def backward(code, has_weights, saved, grad):
        params, index_args, w = saved
        results = (jax.ShapeDtypeStruct(params.shape, params.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
        d_params, d_w = _call(f"{prefix}_backward", results, grad.astype(params.dtype), params, *index_args, w,
                              code=code, has_weights=has_weights)
        # Integer operands get no cotangent (None = zero).
        return d_params, tuple(None for _ in index_args), d_w

    bag.defvjp(forward, backward)
    return bag


_dense_bag_vjp = _make_bag("pkm_embedding_bag")
_ragged_bag_vjp = _make_bag("pkm_ragged_embedding_bag")


def _dense_bag(code, has_weights, params, indices, w):
    return _dense_bag_vjp(code, has_weights, params, (indices,), w)


def _ragged_bag(code, has_weights, params, values, row_splits, w):
    return _ragged_bag_vjp(code, has_weights, params, (values, row_splits), w)
