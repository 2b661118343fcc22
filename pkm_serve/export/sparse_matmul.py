"""What a fused tf.sparse.sparse_dense_matmul(sp, table) site (or a SparseBincount's
counts times the table: counts.py) does before the op, so that it serves what the
composite serves:

- the composite takes sp's entries in any row order; the op's row_splits need
  each bag's ids together. The entries are put in row order (a TopK of the
  negated rows: TOPK_V2 in a .tflite, which has no Assert to refuse them), so
  unsorted entries give the composite's bags in the SavedModel and the .tflite.
  SparseBincount's ids (sp's values) and weights go along with them.
- the composite refuses an sp of dense_shape[1] != N (the table's rows); the
  fused SavedModel asserts the same. (The TFLite converter drops Asserts.)
"""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import DType, FunctionGraph, Ref
from pkm_serve.export.id_checks import _assert, _table_rows
from pkm_serve.export.sites import Site, tensor_dtype

I32 = DType(types_pb2.DT_INT32)
I64 = DType(types_pb2.DT_INT64)


def _column(fg: FunctionGraph, name: str, matrix: Ref, column: int) -> Ref:
    return fg.add_op(name, "GatherV2", [matrix, fg.add_const(name + "/column", np.array(column, np.int32)),
                                        fg.add_const(name + "/axis1", np.array(1, np.int32))],
                     {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[None]])


def sorted_columns_and_weights(fg: FunctionGraph, site: Site, weights: Ref, params: Ref):
    """(sp's values in row order, the dense_shape[1] == N Assert's name); site.indices
    becomes sp's columns in row order: the ids of the fused op."""
    weights, = _sort_entries_by_row(fg, site, {"weights": weights})
    check = _assert_columns_are_table_rows(fg, site, params)
    site.indices = _column(fg, site.root + "/pkm_sparse_ids", site.sparse_indices, 1)
    return weights, check


def values_in_row_order(fg: FunctionGraph, site: Site, weights: Ref):
    """SparseBincount's entries in row order: site.indices (sp's values, the ids) reordered
    with site.sparse_indices. Returns (the weights in that order (the unweighted op's empty
    ones as they are), the name of an Assert that each column is in [0, dense_shape[1]), as
    SparseBincount refuses others ("out of bounds"); the op never reads the columns)."""
    check = _assert_columns_in_shape(fg, site)
    if site.weights is None:
        site.indices, = _sort_entries_by_row(fg, site, {"ids": site.indices})
        return weights, check
    site.indices, weights = _sort_entries_by_row(fg, site, {"ids": site.indices, "weights": weights})
    return weights, check


def _sort_entries_by_row(fg: FunctionGraph, site: Site, values: dict):
    """Points site.sparse_indices at sp's indices in row order and returns the
    tensors `values` (name: [nnz] tensor) in that order. Within a row the order only
    changes the sum's rounding."""
    prefix = site.root + "/pkm_row_order"
    rows = _column(fg, prefix + "/rows", site.sparse_indices, 0)
    rows32 = fg.add_op(prefix + "/rows32", "Cast", [rows], {"SrcT": I64, "DstT": I32, "Truncate": False},
                       shapes=[[None]])
    negated = fg.add_op(prefix + "/negated", "Neg", [rows32], {"T": I32}, shapes=[[None]])
    count = fg.add_op(prefix + "/count", "Size", [rows32], {"T": I32, "out_type": I32}, shapes=[[]])
    top = fg.add_op(prefix + "/top", "TopKV2", [negated, count], {"T": I32, "sorted": True, "Tk": I32},
                    shapes=[[None], [None]])
    order = Ref(top.node, 1)
    axis0 = fg.add_const(prefix + "/axis0", np.array(0, np.int32))
    site.sparse_indices = fg.add_op(prefix + "/indices", "GatherV2", [site.sparse_indices, order, axis0],
                                    {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                                    shapes=[[None, 2]])
    return [fg.add_op(f"{prefix}/{name}", "GatherV2", [value, order, axis0],
                      {"Tparams": DType(tensor_dtype(fg, value)), "Tindices": I32, "Taxis": I32, "batch_dims": 0},
                      shapes=[[None]]) for name, value in values.items()]


def _assert_columns_are_table_rows(fg: FunctionGraph, site: Site, params: Ref) -> str:
    """An Assert that dense_shape[1] == N, as the composite's matmul refuses any other
    ("inner dimension does not match"); the op reads only the columns that are set.
    Returns its name (a control input of the fused op)."""
    prefix = site.root + "/pkm_sparse_columns_check"
    columns = fg.add_op(prefix + "/columns", "GatherV2",
                        [site.dense_shape, fg.add_const(prefix + "/one", np.array(1, np.int32)),
                         fg.add_const(prefix + "/axis0", np.array(0, np.int32))],
                        {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[]])
    rows = _table_rows(fg, site, params, prefix)  # int64: the site's ids are sp's indices
    ok = fg.add_op(prefix + "/same", "Equal", [columns, rows], {"T": I64, "incompatible_shape_error": True},
                   shapes=[[]])
    return _assert(fg, prefix, ok,
                   f"sparse_dense_matmul (fused as PkmRaggedEmbeddingBag of {site.table or 'the table'} in "
                   f"{site.root}): the SparseTensor has dense_shape[1] =", (columns, types_pb2.DT_INT64),
                   f"columns, but the table has {site.table_shape[0] if site.table_shape else 'N'} rows (the "
                   f"original model's matmul refuses it too: its inner dimensions must match)", "/message_columns")


def _assert_columns_in_shape(fg: FunctionGraph, site: Site) -> str:
    """An Assert that 0 <= sp's columns < dense_shape[1] (values_in_row_order). Returns its name."""
    prefix = site.root + "/pkm_sparse_columns_check"
    columns = _column(fg, prefix + "/columns", site.sparse_indices, 1)
    width = fg.add_op(prefix + "/width", "GatherV2",
                      [site.dense_shape, fg.add_const(prefix + "/one", np.array(1, np.int32)),
                       fg.add_const(prefix + "/axis0", np.array(0, np.int32))],
                      {"Tparams": I64, "Tindices": I32, "Taxis": I32, "batch_dims": 0}, shapes=[[]])
    below = fg.add_op(prefix + "/below", "Less", [columns, width], {"T": I64}, shapes=[[None]])
    non_negative = fg.add_op(prefix + "/non_negative", "GreaterEqual",
                             [columns, fg.add_const(prefix + "/zero", np.array(0, np.int64))], {"T": I64},
                             shapes=[[None]])
    inside = fg.add_op(prefix + "/inside", "LogicalAnd", [below, non_negative], {}, shapes=[[None]])
    ok = fg.add_op(prefix + "/all", "All", [inside, fg.add_const(prefix + "/axis", np.array(0, np.int32))],
                   {"Tidx": I32, "keep_dims": False}, shapes=[[]])
    return _assert(fg, prefix, ok, f"{site.pattern} of a SparseBincount (fused as PkmRaggedEmbeddingBag in "
                   f"{site.root}): a SparseTensor index has a column outside [0, dense_shape[1] =",
                   (width, types_pb2.DT_INT64), "), which the original SparseBincount refuses (out of bounds)",
                   "/message_end")
