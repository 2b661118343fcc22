"""The bag lookup on every Keras backend, through our kernels.

    from pkm_serve.backends import embedding_bag
    out = embedding_bag(table, indices, weights=None, combiner="sum", row_splits=None)

dispatches on `keras.backend.backend()`: TensorFlow -> the TF op
(`pkm_serve.ops`), JAX -> `jax.ffi` into the typed-FFI handlers
(`jax_ops`), PyTorch -> the `torch.library` op over the C ABI (`torch_ops`).
Ragged bags are values [V] + row_splits [B+1] (a `tf.RaggedTensor` on TF).
Each backend module is imported only when used, so that importing this
package under JAX or PyTorch never imports TensorFlow.
"""

from __future__ import annotations

import importlib
import sys

from pkm_serve.backends._native import NativeLibraryUnavailableError

_MODULES = {"jax": "pkm_serve.backends.jax_ops", "torch": "pkm_serve.backends.torch_ops"}

__all__ = ["embedding_bag", "embedding_bag_composite", "kernel_device", "NativeLibraryUnavailableError"]


_loaded = {}  # backend -> its module, once imported


def backend_module(backend=None):
    """The module (jax_ops / torch_ops) of `backend` (default: Keras')."""
    import keras

    backend = backend or keras.backend.backend()
    module = _loaded.get(backend)
    if module is not None:  # a dict lookup: torch.compile(fullgraph=True) traces it
        return module
    if backend not in _MODULES:
        raise ValueError(f"pkm_serve.backends: no native lookup for Keras backend {backend!r} "
                         f"(TensorFlow uses pkm_serve.ops; JAX and PyTorch this package)")
    module = _loaded[backend] = importlib.import_module(_MODULES[backend])
    return module


def _load_keras_backend_module():
    """Imports the module of Keras' backend now, so that a first call inside
    torch.compile finds it loaded (dynamo cannot trace importlib). Only where Keras
    is imported already: importing it here chose its backend (TensorFlow, unless
    KERAS_BACKEND said otherwise) for a process that imported torch alone."""
    keras = sys.modules.get("keras")
    if keras is None or getattr(getattr(keras, "__spec__", None), "_initializing", False):
        return
    if keras.backend.backend() in _MODULES:
        backend_module()


def register_torch_ops():
    """Registers the torch.library ops (pkm_serve::embedding_bag and its gradient) with PyTorch:
    `import pkm_serve` calls it once torch is imported, so that torch.export.load of a program
    holding them resolves them."""
    _loaded["torch"] = importlib.import_module(_MODULES["torch"])


def kernel_device(backend=None):
    """'cpu'/'cuda' when our kernels serve `backend`'s default device, else None."""
    import keras

    backend = backend or keras.backend.backend()
    if backend == "torch":
        import torch

        return backend_module("torch").kernel_device("cuda" if torch.cuda.is_available() else "cpu")
    return backend_module(backend).kernel_device()


def _check_framework(params, backend):
    """A TypeError naming KERAS_BACKEND where `params` is another framework's tensor: the lookup dispatches on
    Keras' backend, and TF's op took a CPU torch tensor as an array (returning a tf.Tensor) and failed on one
    that requires grad. Not checked under the torch backend, whose calls torch.compile traces."""
    framework = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "tensorflow": "tensorflow"}.get(
        type(params).__module__.partition(".")[0])
    if framework is not None and framework != backend:
        raise TypeError(f"pkm_serve.backends.embedding_bag: params is a {framework} tensor but Keras' backend is "
                        f"{backend!r} (the lookup runs on Keras' backend): set KERAS_BACKEND={framework} before "
                        f"Keras is first imported")


def embedding_bag(params, indices, weights=None, combiner="sum", row_splits=None):
    """Fused bag lookup on the current Keras backend (see the module docstring)."""
    import keras

    backend = keras.backend.backend()
    if backend != "torch":
        _check_framework(params, backend)
    if backend == "tensorflow":
        from pkm_serve import ops

        if row_splits is not None:
            import tensorflow as tf

            indices = tf.RaggedTensor.from_row_splits(indices, row_splits)
            weights = None if weights is None else tf.RaggedTensor.from_row_splits(weights, row_splits)
        return ops.embedding_bag(params, indices, weights, combiner=combiner)
    return backend_module().embedding_bag(params, indices, weights, combiner, row_splits)


def embedding_bag_composite(params, indices, weights=None, combiner="sum", row_splits=None):
    """The same lookup in stock keras.ops (materialises the [..., K, D] gather)."""
    from pkm_serve.backends.composite import embedding_bag_composite as composite

    return composite(params, indices, weights, combiner, row_splits)


_load_keras_backend_module()
