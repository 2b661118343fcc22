"""Export tooling: fuse composite gather-sum sites of a SavedModel into the
`PkmEmbeddingBag` op and write a serving SavedModel (and a .tflite).

CLI: ``pkm-serve export SRC DST [--version N] [--tflite FILE] ...``
(``pkm_serve.export.main(argv)``).

The names below are imported from the exporter on first use, so that
``pkm_serve.export.arguments`` (the CLI's parser) loads without TensorFlow.
"""
import importlib

__all__ = ["ExportError", "ExportResult", "build_parser", "export_saved_model",
           "format_report", "main", "quantize_tables", "read_saved_model"]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module("pkm_serve.export.exporter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
