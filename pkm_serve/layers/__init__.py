"""Keras 3 layers over the fused EmbeddingBag op.

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

Both are registered for `.keras` serialisation under the package name
``pkm_serve`` (importing this module is enough for `keras.models.load_model`).
They run on the TensorFlow, JAX and PyTorch Keras backends (pkm_serve.backends
holds the JAX and PyTorch kernels' bindings); the same `.keras` file loads on each.
"""
import keras

from pkm_serve.layers._lookup import OpLibraryUnavailableError
from pkm_serve.layers.embedding_bag import EmbeddingBag
from pkm_serve.layers.product_key_memory import ProductKeyMemory

__all__ = ["EmbeddingBag", "ProductKeyMemory", "OpLibraryUnavailableError"]

if keras.backend.backend() != "tensorflow":
    from pkm_serve.layers import _optimizer_placeholders  # noqa: F401  (names for .keras files)
