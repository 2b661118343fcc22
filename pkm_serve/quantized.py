"""Row-wise int8 tables: quantise a float table, and look bags up in it.

A quantised table is int8 ``values [N, D]`` plus one scale and one bias per
row (``row_scales``, ``row_biases`` [N], float32 or float16): row ``r`` stands
for ``row_scales[r] * values[r] + row_biases[r]``. It is a quarter of the
float32 table's bytes (plus 8 bytes a row), and ``embedding_bag`` below reads
it with the ``PkmQuantizedEmbeddingBag`` op, which dequantises while it
accumulates in float32 (CPU and XLA CPU; the C ABI's CUDA launcher
``pkm_cuda_forward_int8``; TFLite's int8 tables share the layout). Forward
only: int8 tables are for serving; train the float table, then quantise it
(``pkm-serve export --quantize-table int8``, ``pkm_serve.export.quantize_tables``).

    from pkm_serve import quantized
    table = quantized.quantize_table(float_table)        # QuantizedTable
    out = quantized.embedding_bag(table, indices, weights, combiner="mean")
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from pkm_serve import _op_args, _sharding, ops

ROW_PARAM_DTYPES = ("float32", "float16")
_OUTPUT_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
_CHUNK_ROWS = 16384


class QuantizedTable(NamedTuple):
    """int8 values [N, D] and per-row row_scales / row_biases [N]."""
    values: object
    row_scales: object
    row_biases: object


def quantize_rows(table, row_param_dtype: str = "float32"):
    """Asymmetric row-wise int8: per row, [min, max] is mapped onto [-128, 127].

    Returns numpy (values int8 [N, D], row_scales [N], row_biases [N]) with
    row_scales * values + row_biases within row_scales / 2 of `table`
    (a constant row is exact up to its bias's precision). The scales and
    biases are rounded to `row_param_dtype` before the values are computed, so
    the rounding of float16 parameters is accounted for.
    """
    if row_param_dtype not in ROW_PARAM_DTYPES:
        raise ValueError(f"row_param_dtype must be one of {ROW_PARAM_DTYPES}, got {row_param_dtype!r}")
    table = np.asarray(table)
    if table.ndim != 2:
        raise ValueError(f"table must be [N, D], got shape {table.shape}")
    n = table.shape[0]
    values = np.empty(table.shape, np.int8)
    scales, biases = np.empty(n, row_param_dtype), np.empty(n, row_param_dtype)
    for start in range(0, n, _CHUNK_ROWS):  # float64 temporaries for a chunk, not the table
        stop = min(start + _CHUNK_ROWS, n)
        values[start:stop], scales[start:stop], biases[start:stop] = _quantize_chunk(
            np.asarray(table[start:stop], np.float64), row_param_dtype, start)
    return values, scales, biases


def _quantize_chunk(x, row_param_dtype, first_row):
    finite_rows = np.isfinite(x).all(axis=1)
    if not finite_rows.all():
        row = int(np.argmin(finite_rows))
        col = int(np.argmin(np.isfinite(x[row])))
        raise ValueError(f"row {first_row + row} of the table holds {x[row, col]} (column {col}): "
                         "an int8 row cannot hold a non-finite value (NaN or infinity)")
    lo = x.min(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    hi = x.max(axis=1) if x.shape[1] else np.zeros(x.shape[0])
    flat = hi <= lo
    with np.errstate(over="ignore"):  # float16 parameters overflow past 65504: refused below
        scales = np.where(flat, 1.0, (hi - lo) / 255.0).astype(row_param_dtype)
        biases = np.where(flat, lo, lo + 128.0 * scales.astype(np.float64)).astype(row_param_dtype)
    finite = np.isfinite(scales) & np.isfinite(biases)
    if not finite.all():  # they would dequantise to rows of inf / NaN
        row = int(np.argmin(finite))
        raise ValueError(f"row {first_row + row}'s range [{lo[row]:.6g}, {hi[row]:.6g}] needs a scale or bias beyond "
                         f"{row_param_dtype}; use row_param_dtype='float32'")
    # A range too narrow for the dtype's scale (it rounded to 0), or a bias whose rounding moved
    # it so far that [lo, hi] no longer fits 256 steps: the smallest scale of this dtype that
    # holds the row around the rounded bias, so every value stays within scale / 2.
    tiny = np.finfo(row_param_dtype).smallest_subnormal
    b = biases.astype(np.float64)
    need = np.maximum(np.maximum((hi - b) / 127.0, (b - lo) / 128.0), float(tiny))
    grow = ~flat & (scales.astype(np.float64) < need)
    for row in np.flatnonzero(grow):
        scale = np.array(need[row], row_param_dtype)
        while float(scale) < need[row]:  # rounded down: the next representable one up
            scale = np.nextafter(scale, np.array(np.inf, row_param_dtype))
        scales[row] = scale
    s64, b64 = scales.astype(np.float64)[:, None], biases.astype(np.float64)[:, None]
    return np.clip(np.rint((x - b64) / s64), -128, 127).astype(np.int8), scales, biases


def quantize_table(table, row_param_dtype: str = "float32") -> QuantizedTable:
    """quantize_rows as a QuantizedTable of tf constants (a tf.Variable or a tensor works as `table`;
    a row-sharded table, a ShardedVariable or a list of [N_i, D] shards as ops.embedding_bag takes
    it, becomes one int8 table of its rows in order)."""
    if _op_args.is_sharded(table):
        shards = _sharding._table_shards(table)  # pylint: disable=protected-access
        table = np.concatenate([np.asarray(shard) for shard in shards])
    if isinstance(table, (tf.Tensor, tf.Variable)):
        table = table.numpy()
    values, scales, biases = quantize_rows(table, row_param_dtype)
    return QuantizedTable(tf.constant(values), tf.constant(scales), tf.constant(biases))


def dequantize(table: QuantizedTable):
    """The float32 table a QuantizedTable stands for."""
    values = tf.cast(tf.convert_to_tensor(table.values), tf.float32)
    scales = tf.cast(tf.convert_to_tensor(table.row_scales), tf.float32)
    biases = tf.cast(tf.convert_to_tensor(table.row_biases), tf.float32)
    return values * scales[:, None] + (biases[:, None] if biases.shape[0] else 0.0)


def _table_tensors(table: QuantizedTable):
    values = tf.convert_to_tensor(table.values)
    if values.dtype != tf.int8:
        raise TypeError(f"QuantizedTable.values must be int8, got {values.dtype.name}")
    if values.shape.rank is not None and values.shape.rank != 2:
        raise ValueError(f"QuantizedTable.values must be [N, D], got shape {values.shape}")
    scales = tf.convert_to_tensor(table.row_scales)
    if scales.dtype not in (tf.float32, tf.float16):
        raise TypeError(f"row_scales must be float32 or float16, got {scales.dtype.name}")
    biases = table.row_biases
    biases = _op_args._no_weights(scales.dtype) if biases is None else tf.convert_to_tensor(biases)
    if biases.dtype != scales.dtype:
        raise TypeError(f"row_biases ({biases.dtype.name}) must have row_scales' dtype ({scales.dtype.name})")
    return values, scales, biases


def _weights(weights, dtype, like):
    if weights is None:
        return _op_args._no_weights(dtype), False
    weights = tf.convert_to_tensor(weights)
    if weights.dtype not in _OUTPUT_DTYPES:
        raise TypeError(f"weights must be float32, float16 or bfloat16, got {weights.dtype.name}")
    return _op_args._sizes_checked_when_compiled(weights, like), True  # pylint: disable=protected-access


# Plain Python with no tensor-dependent control flow, as ops.embedding_bag: converting it traced
# through the library loader and the argument checks (16 s for one call in a tf.function here).
@tf.autograph.experimental.do_not_convert
def embedding_bag(table: QuantizedTable, indices, weights=None, combiner="sum", output_dtype=tf.float32,
                  name=None):
    """ops.embedding_bag over a row-wise int8 table (forward only).

    indices: [..., K] int32/int64, or a tf.RaggedTensor whose last dim is ragged.
    weights: like indices, or None (all ones). The output is [..., D] of the
    weights' dtype (float32 / float16 / bfloat16), or of `output_dtype` without
    weights; the arithmetic is float32 either way.
    """
    if combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"combiner must be one of sum, mean, sqrtn for int8 tables, got {combiner!r}")
    _op_args._refuse_sparse_tensors(indices, weights)  # pylint: disable=protected-access
    lib = ops.load_library()  # with the XLA lowerings (also where TF built its JIT kernels first)
    with tf.name_scope(name or "quantized_embedding_bag"):
        values, scales, biases = _table_tensors(table)
        output_dtype = tf.as_dtype(output_dtype)
        if output_dtype not in _OUTPUT_DTYPES:
            raise TypeError(f"output_dtype must be float32, float16 or bfloat16, got {output_dtype.name}")
        if isinstance(indices, tf.RaggedTensor):
            # pylint: disable-next=protected-access
            weight_values, checked_splits = _op_args._ragged_weights_and_splits(indices, weights)
            flat = tf.convert_to_tensor(indices.flat_values)
            if flat.shape.rank is not None and flat.shape.rank > 1:
                if _op_args.may_mark_mismatched_weights(checked_splits):  # as ops.embedding_bag's
                    bags, bag_weights = _op_args.uniform_bags_as_ragged(flat, weight_values, checked_splits)
                    out = embedding_bag(table, bags, bag_weights, combiner, output_dtype)
                    return indices.with_flat_values(_op_args.uniform_bags_output(out, flat))
                return indices.with_flat_values(
                    embedding_bag(table, flat, weight_values, combiner, output_dtype))
            w, has_w = _weights(weight_values, output_dtype, flat)
            splits = indices.nested_row_splits
            out = lib.pkm_quantized_ragged_embedding_bag(values, scales, biases, flat, checked_splits, w,
                                                         combiner=combiner, has_weights=has_w)
            if len(splits) == 1:
                return out
            return tf.RaggedTensor.from_nested_row_splits(out, splits[:-1], validate=False)
        indices = tf.convert_to_tensor(indices)
        if indices.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"indices must be int32 or int64, got {indices.dtype.name}")
        w, has_w = _weights(weights, output_dtype, indices)
        return lib.pkm_quantized_embedding_bag(values, scales, biases, indices, w, combiner=combiner,
                                               has_weights=has_w)


_NO_GRADIENT = ("{op} has no gradient: an int8 table is for serving (forward only). Train with the float "
                "table (pkm_serve.ops.embedding_bag) and quantise it afterwards.")


@tf.RegisterGradient("PkmQuantizedEmbeddingBag")
def _quantized_grad(op, grad):
    raise LookupError(_NO_GRADIENT.format(op=op.type))


@tf.RegisterGradient("PkmQuantizedRaggedEmbeddingBag")
def _quantized_ragged_grad(op, grad):
    raise LookupError(_NO_GRADIENT.format(op=op.type))
