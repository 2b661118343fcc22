"""The seam between the model manager and what it loads (TF Serving's core/loader.h).

The manager decides *when* a version loads, serves and unloads (manager.py);
a Loader knows *how*: `load()` once (raising on failure), then `servable()`
while the version is AVAILABLE, then `unload()` once after the last request
that holds the version has finished. Tests drive the manager with fake
loaders; the server uses `make_loader_factory`, which picks the SavedModel
Session servable or, with --prefer_tflite_model, the TFLite servable.
"""
import logging
import os

import grpc

from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.servable import Servable
from pkm_serve.serving.tflite_servable import TFLITE_MODEL_FILE, TfLiteServable

log = logging.getLogger("pkm_serve.serving")

BATCHING_PARAMS_FILE = "batching_params.pbtxt"   # bundle_factory_util.cc's kBatchingParamsFilename


class Loader:
    """One version's lifecycle; subclasses implement the three steps."""

    def load(self):
        """Makes the servable; raises ServingError (or any exception) on failure."""
        raise NotImplementedError

    def servable(self):
        """The loaded object requests run on (valid between load() and unload())."""
        raise NotImplementedError

    def unload(self):
        """Frees what load() made; called once, when no request holds the servable."""
        raise NotImplementedError


class ServableLoader(Loader):
    """A Loader over a constructor whose result has release() (servable.Servable,
    tflite_servable.TfLiteServable)."""

    def __init__(self, make):
        self._make = make
        self._servable = None

    def load(self):
        self._servable = self._make()

    def servable(self):
        return self._servable

    def unload(self):
        servable, self._servable = self._servable, None
        if servable is not None:
            servable.release()


def load_with_retries(make_loader, servable_id, max_num_load_retries, wait_or_cancel):
    """TF Serving's LoaderHarness::Load (through util/retrier.cc): a load that fails is
    tried again, up to max_num_load_retries more times, while `wait_or_cancel()` (which
    waits the retry interval) returns False; a cancelled retry (the version is no longer
    wanted, the server stops) ends the tries. Returns the loaded Loader or raises the
    last attempt's error. `servable_id` is "{name: M version: V}", as upstream logs it."""
    description = f"Loading servable: {servable_id}"
    tries = 0
    while True:
        try:
            loader = make_loader()
            loader.load()
            return loader
        except Exception as e:  # noqa: BLE001 - logged and retried, or raised after the last try
            message = e.message if isinstance(e, ServingError) else f"{type(e).__name__}: {e}"
            log.error("%s failed: %s", description, message)
            tries += 1
            if tries > max_num_load_retries:
                if max_num_load_retries:
                    log.info("Retrying of %s exhausted max_num_retries: %d", description, max_num_load_retries)
                raise
            if wait_or_cancel():
                log.info("Retrying of %s was cancelled.", description)
                raise
        log.info("Retrying of %s retry: %d", description, tries)


def make_loader_factory(warmup=True, prefer_tflite_model=False, num_tflite_interpreters=1,
                        tflite_threads=1, per_model_batching=False, saved_model_tags=("serve",),
                        gpu_memory_fraction=0.0, tflite_interpreters_per_pool=1):
    """factory(model_name, version, path) -> Loader, as the server configures it.

    With prefer_tflite_model a version directory holding model.tflite is served from
    it (TF Serving's --prefer_tflite_model); any other directory is a SavedModel.
    `warmup`: times each warmup record runs (True: once; 0 or False: no warmup).
    `per_model_batching` (--enable_per_model_batching_parameters): each version is
    batched with its own batching_params.pbtxt, or not at all without one;
    `saved_model_tags`: the SavedModel MetaGraph loaded (--saved_model_tags);
    `gpu_memory_fraction`: --per_process_gpu_memory_fraction of each Session;
    `tflite_interpreters_per_pool`: --num_tflite_interpreters_per_pool (above 1, each
    TFLite version batches its own requests, as upstream's TfLiteSession)."""

    def factory(name, version, path):
        if prefer_tflite_model and _is_file(os.path.join(path, TFLITE_MODEL_FILE)):
            make = lambda: TfLiteServable(  # noqa: E731
                name, version, path, warmup=warmup, num_interpreters=num_tflite_interpreters,
                num_threads=tflite_threads, interpreters_per_pool=tflite_interpreters_per_pool)
        else:
            make = lambda: _saved_model_servable(name, version, path, warmup, saved_model_tags,  # noqa: E731
                                                 gpu_memory_fraction)
        return ServableLoader(_with_own_batching(make, path) if per_model_batching else make)

    return factory


def _with_own_batching(make, path):
    def make_with_batch_options():
        options = per_model_batch_options(path)   # first: a bad file fails the load, nothing held
        servable = make()
        servable.batch_options = options
        return servable
    return make_with_batch_options


def per_model_batch_options(path):
    """BatchOptions of the version directory's batching_params.pbtxt (bundle_factory_util.cc
    reads it from the SavedModel directory itself, not assets.extra), or None without one:
    upstream does not batch such a version. A file that does not parse or holds values the
    batch queue refuses fails the load, as upstream."""
    import tensorflow as tf
    from google.protobuf import text_format

    from pkm_serve.serving import protos
    from pkm_serve.serving.batching import BatchOptions
    file = os.path.join(path, BATCHING_PARAMS_FILE)
    if not _is_file(file):
        log.info("%s: no %s, the version is not batched (--enable_per_model_batching_parameters)",
                 path, BATCHING_PARAMS_FILE)
        return None
    with tf.io.gfile.GFile(file, "r") as fh:
        text = fh.read()
    try:
        return BatchOptions(text_format.Parse(text, protos.BatchingParameters()))
    except text_format.ParseError as e:
        raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "Error parsing text-format "
                           f"tensorflow.serving.BatchingParameters from {file}: {e}") from None
    except ValueError as e:
        raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{file}: {e}") from None


def _saved_model_servable(name, version, path, warmup, tags, gpu_memory_fraction):
    # A directory of model.tflite alone got TF's "SavedModel file does not exist" only.
    if _holds_only_tflite(path):
        raise ServingError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{path} holds {TFLITE_MODEL_FILE} but no SavedModel: serve it with "
                           f"--prefer_tflite_model=true")
    return Servable(name, version, path, warmup=warmup, tags=tags, gpu_memory_fraction=gpu_memory_fraction)


def _is_file(path) -> bool:
    """os.path.isfile through tf.io.gfile: a base path may be a URL (file://, gs://)."""
    import tensorflow as tf
    return tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path)


def _holds_only_tflite(path) -> bool:
    """Whether `path` holds model.tflite and no saved_model.pb(txt)."""
    return _is_file(os.path.join(path, TFLITE_MODEL_FILE)) and not any(
        _is_file(os.path.join(path, f)) for f in ("saved_model.pb", "saved_model.pbtxt"))
