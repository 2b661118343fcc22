"""Export tooling: fuse composite gather-sum sites of a SavedModel into the
`PkmEmbeddingBag` op and write a serving SavedModel (and a .tflite).

CLI: ``pkm-serve export SRC DST [--version N] [--tflite FILE] ...``
(``pkm_serve.export.main(argv)``).
"""
from pkm_serve.export.exporter import (ExportError, ExportResult, build_parser,
                                       export_saved_model, format_report, main,
                                       read_saved_model)

__all__ = ["ExportError", "ExportResult", "build_parser", "export_saved_model",
           "format_report", "main", "read_saved_model"]
