"""A Keras model (Keras 3 or tf_keras) written as an inference SavedModel with a
serving_default signature, for quantize_tables to export."""
from __future__ import annotations

import contextlib
import inspect
import io

from pkm_serve.export.errors import ExportError


def write_inference_saved_model(model, path: str) -> None:
    """model.export(path) with the arguments this Keras takes: Keras 3's takes
    format (and verbose since 3.x), tf_keras' only the path (it always writes
    a SavedModel)."""
    export = getattr(model, "export", None)
    if not callable(export):
        raise ExportError(f"quantize_tables: model must be a Keras model (Keras 3 or tf_keras, with "
                          f"model.export), got {type(model).__name__}")
    parameters = inspect.signature(export).parameters
    wanted = {"format": "tf_saved_model", "verbose": False}
    quiet = contextlib.nullcontext() if "verbose" in parameters else contextlib.redirect_stdout(io.StringIO())
    with quiet:  # tf_keras prints the endpoints it writes
        export(path, **{name: value for name, value in wanted.items() if name in parameters})
