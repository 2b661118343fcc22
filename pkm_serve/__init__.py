"""pkm_serve: fused EmbeddingBag / Product-Key Memory ops for TensorFlow,
TF Serving and TFLite.

The TF op lives in ``pkm_serve.ops``; Keras layers in ``pkm_serve.layers``;
export (fusion) in ``pkm_serve.export``; the model server in
``pkm_serve.serving``; the TFLite delegate helpers in ``pkm_serve.tflite``.

Importing ``pkm_serve`` registers the op library with TensorFlow and the
layers and optimizers with Keras (the tensorflow_text convention), so
``tf.saved_model.load`` and ``keras.models.load_model`` work after it, and the
``torch.library`` ops with PyTorch (``torch.export.load``). It does
so without importing TensorFlow itself: registration happens as soon as ``tensorflow`` (or
``keras``, ``torch``) has been imported, now if it already was, or right after its import
finishes. That keeps ``pkm-serve <command> --help`` instant and lets the
device part (``pkm_serve.tflite``) run where TensorFlow is not installed.
"""

import contextlib
import functools
import importlib.abc
import importlib.util
import sys
import threading
import warnings

__version__ = "0.1.0"


def _register_ops():
    # pkm_serve.ops loads the op library when imported. The device wheel ships
    # no pkm_serve.ops: a tf.lite interpreter there needs no TF op.
    if importlib.util.find_spec("pkm_serve.ops") is not None:
        importlib.import_module("pkm_serve.ops")


def _register_torch_ops():
    # torch.export.load (a program saved with our ops) needs them registered before it reads one.
    # The TF and device wheels ship no pkm_serve.backends; a torch before torch.library.custom_op
    # (2.4) cannot hold them, and its users' `import torch` must not warn for a backend they never use.
    torch = sys.modules["torch"]
    if importlib.util.find_spec("pkm_serve.backends") is not None and \
            hasattr(getattr(torch, "library", None), "custom_op"):
        importlib.import_module("pkm_serve.backends").register_torch_ops()


# Modules whose import registers their classes for `.keras` files (register_keras_serializable).
_KERAS_MODULES = ("pkm_serve.layers", "pkm_serve.optimizers")


def _register_keras_objects():
    keras = sys.modules["keras"]
    # The layers run on every Keras backend (TF op; JAX and PyTorch: pkm_serve.backends); the
    # optimizers run TF ops, so only the TF backend registers them. The device wheel ships neither.
    modules = _KERAS_MODULES if keras.backend.backend() == "tensorflow" else ("pkm_serve.layers",)
    for module in modules:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def _imported(name):
    """``name`` is in sys.modules and not half-way through its own import."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing",
                                              False)


# top-level module -> what to register once it is imported
_REGISTRATIONS = {"tensorflow": _register_ops, "keras": _register_keras_objects, "torch": _register_torch_ops}
_registered = set()
_registration_lock = threading.RLock()
_deferrals = 0  # > 0: inside _registration_deferred(), imports register nothing yet


def _own_import_in_progress():
    """A ``pkm_serve.`` module is half-way through its import (``import pkm_serve._library`` importing
    TensorFlow): registering now would import it again half-initialised, a circular ImportError."""
    # (a None entry blocks that import, it is no import in progress)
    return any(name.startswith("pkm_serve.") and sys.modules.get(name) is not None and not _imported(name)
               for name in list(sys.modules))


def _register(module_name):
    """Runs the registration for ``module_name`` once (thread-safe); a failure
    warns instead of breaking the user's ``import tensorflow``. While one of our own
    modules is importing, it waits for that import's end (_RegistrationFinder)."""
    with _registration_lock:
        if module_name in _registered or _deferrals or _own_import_in_progress():
            return
        if module_name == "keras" and "tensorflow" in sys.modules \
                and "tensorflow" not in _registered and not _imported("tensorflow"):
            return  # keras imported from inside TF's import: registered when TF's import ends
        _registered.add(module_name)
        try:
            _REGISTRATIONS[module_name]()
        except Exception as err:  # noqa: BLE001 - reported, and load_library() raises it again
            warnings.warn(f"pkm_serve: registration after importing {module_name} failed: {err}",
                          RuntimeWarning, stacklevel=2)
        if module_name == "tensorflow" and _imported("keras"):
            _register("keras")


class _RegisterAfterLoad(importlib.abc.Loader):
    """Wraps a module's real loader: executes the module, then runs ``after_load``."""

    def __init__(self, loader, after_load, after_failure=None):
        self._loader = loader
        self._after_load = after_load
        self._after_failure = after_failure

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        # (from __dict__: copy and pickle look attributes up before __init__'s have been set)
        if "_loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_loader"], name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # The module sees its own loader, as without us.
        module.__loader__ = module.__spec__.loader = self._loader
        try:
            self._loader.exec_module(module)
        except Exception:
            if self._after_failure is not None:
                self._after_failure(module)
            raise
        self._after_load()


class _RegistrationFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module, or one of ours (whose import's end runs a
    registration it held back), it asks the finders after it and wraps the loader they return."""

    def find_spec(self, name, path=None, target=None):
        after_failure = None
        if name.startswith("pkm_serve."):
            after_load = functools.partial(_register_after_own_import, name)
            after_failure = functools.partial(_register_after_failed_own_import, name)
        elif name in _REGISTRATIONS and name not in _registered:
            after_load = functools.partial(_register, name)
        else:
            return None
        finders = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfterLoad(spec.loader, after_load, after_failure)
                return spec
        return None


def _register_after_own_import(name):
    module = sys.modules.get(name)
    if module is not None:  # executed: no longer half-way for _own_import_in_progress (importlib says so next)
        module.__spec__._initializing = False
    _register_imported()


def _register_after_failed_own_import(name, module):
    # importlib drops the failed module next; dropped now, it holds back nothing, and what it held
    # back (TensorFlow imported before the failing line) registers, else nothing would until
    # another of our imports ends
    if sys.modules.get(name) is module:
        del sys.modules[name]
    _register_imported()


def _register_imported():
    for name in _REGISTRATIONS:
        if _imported(name):
            _register(name)


@contextlib.contextmanager
def _registration_deferred(before_registering=None):
    """Imports inside the block register nothing; after it, ``before_registering()`` runs and
    then what was imported registers. The CLI announces the op library's load apart from
    TensorFlow's import this way, so that a native crash in either names its step."""
    global _deferrals
    with _registration_lock:
        _deferrals += 1
    try:
        yield
    finally:
        with _registration_lock:
            _deferrals -= 1
    if before_registering is not None:
        before_registering()
    _register_imported()


def _install_registration():
    if not any(isinstance(f, _RegistrationFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistrationFinder())
    _register_imported()  # what was imported before pkm_serve registers now


_install_registration()
