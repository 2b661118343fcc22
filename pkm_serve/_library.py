"""Finding and loading the TF op library (once, thread-safe); importing this
module registers the ops with TensorFlow so SavedModels using them load."""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import tensorflow as tf

_LIB_NAME = "_pkm_ops.so"
_GPU_LIB_NAME = "_pkm_ops_gpu.so"  # CPU + GPU kernels, built by `make gpu` (nvcc)
_lib = None
_lib_lock = threading.Lock()


class OpLibraryNotFoundError(ImportError):
    """The compiled op library is missing (not built, or not shipped)."""


def library_path() -> str:
    """Path of the TF op library: ``$PKM_SERVE_OPS_LIB``, else the packaged
    build — the one with GPU kernels when it was built and TF sees a GPU."""
    if os.environ.get("PKM_SERVE_OPS_LIB"):
        return os.environ["PKM_SERVE_OPS_LIB"]
    lib_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
    gpu_lib = os.path.join(lib_dir, _GPU_LIB_NAME)
    # Both libraries register the same ops: load exactly one of them.
    if os.path.exists(gpu_lib) and tf.config.list_physical_devices("GPU"):
        return gpu_lib
    return os.path.join(lib_dir, _LIB_NAME)


def load_library():
    """Loads (once) and returns the op library module; registers the ops with TF.

    Must run before a graph or SavedModel that uses the ops is imported.
    """
    global _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            if not os.path.exists(path):
                raise OpLibraryNotFoundError(
                    f"pkm_serve op library not found at {path}{_from_environment()}. In a source checkout run "
                    "`make build`; to install, use the TF wheel (`make wheel`, then "
                    "`pip install dist/pkm_serve-*.whl`) rather than `pip install .`; the device "
                    "wheel has no TF op. pkm_serve.ops.embedding_bag_composite needs no library.")
            lib = tf.load_op_library(path)
            if not hasattr(lib, "pkm_embedding_bag"):
                # Another library (e.g. lib/libpkm_tflite.so) loads too, registering no op: every
                # use then failed with an AttributeError on the op's wrapper.
                raise OpLibraryNotFoundError(
                    f"{path}{_from_environment()} is not the pkm_serve op library: it registers no "
                    f"PkmEmbeddingBag op (the TF op library is {_LIB_NAME}, or {_GPU_LIB_NAME} with GPU kernels)")
            _lib = lib
            register_xla_lowerings_late(path)
        return _lib


def _from_environment() -> str:
    return " (from $PKM_SERVE_OPS_LIB)" if os.environ.get("PKM_SERVE_OPS_LIB") else ""


# Exported by the op library (kernels/xla), each for the ops it lowers: adds their XLA JIT kernels
# where TF built its own before the library was loaded (docs/XLA.md "Late loading").
_LATE_XLA_REGISTRATIONS = ("pkm_xla_register_late", "pkm_xla_register_late_gpu",
                           "pkm_xla_register_late_quantized")


def _tf_built_xla_kernels() -> bool:
    """Whether TF turned its XLA op registry into JIT kernels already (it does once per process,
    when it first creates devices); True where TF's private kernel list is missing, as then
    registering is the safe answer (a jit_compile trace of the op registers anyway)."""
    try:
        from tensorflow.python.framework import kernels  # no public kernel list

        return any(k.device_type.endswith("_JIT") for k in kernels.get_registered_kernels_for_op("Identity").kernel)
    except (ImportError, AttributeError):
        return True


def register_xla_lowerings_late(path):
    """Makes the library's XLA lowerings visible when TF built its JIT kernels before the library
    was loaded (e.g. ``import pkm_serve`` after running a TF op): else a SavedModel saved from a
    jit_compile function fails with "No registered 'PkmEmbeddingBag' OpKernel for XLA_CPU_JIT",
    as nothing traces ops.embedding_bag there. Left alone before TF built them: TF's own
    registration then picks the lowerings up, and that of op libraries loaded after this one."""
    if not _tf_built_xla_kernels():
        return
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # loaded: NOLOAD returns its handle
    except OSError:
        return
    for register in _LATE_XLA_REGISTRATIONS:
        if hasattr(handle, register):
            getattr(handle, register)()


def is_available() -> bool:
    try:
        load_library()
        return True
    except (OpLibraryNotFoundError, tf.errors.NotFoundError):
        return False


def _register_at_import():
    """Importing this module registers the ops (so SavedModels using them
    load); a missing library is only an error when the op is used."""
    try:
        load_library()
    except OpLibraryNotFoundError:
        pass
    except tf.errors.NotFoundError as err:  # e.g. built against another TF (undefined symbols)
        warnings.warn(f"pkm_serve: the op library at {library_path()} does not load into "
                      f"TensorFlow {tf.__version__}: {err}", RuntimeWarning, stacklevel=3)


_register_at_import()
