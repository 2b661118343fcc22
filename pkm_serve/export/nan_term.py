"""The step fuse.py adds after a fused bag that has a dropped-row NaN term (dropped_nan.py, which builds the term
and imports fuse.py: this step lives apart so that fuse.py need not import it)."""
from __future__ import annotations

from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType
from pkm_serve.export.sites import Site


def nan_term_steps(site: Site, out_dtype: int) -> list:
    """bag + nan_term; a half bag (a float16 table) in float32, the term's dtype: TFLite has no half ADD."""
    if out_dtype not in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):
        return [("AddV2", {"T": DType(out_dtype)}, lambda bag: [bag, site.nan_term])]
    float_attrs = {"T": DType(types_pb2.DT_FLOAT)}
    return [("Cast", {"SrcT": DType(out_dtype), "DstT": DType(types_pb2.DT_FLOAT), "Truncate": False},
             lambda bag: [bag]),
            ("AddV2", float_attrs, lambda bag: [bag, site.nan_term]),
            ("Cast", {"SrcT": DType(types_pb2.DT_FLOAT), "DstT": DType(out_dtype), "Truncate": False},
             lambda bag: [bag])]
