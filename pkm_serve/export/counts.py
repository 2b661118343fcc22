"""Count-vector sites: a bag written as counts of the ids times the table.

  DenseBincount(ids [B, K], size, w) [-> Cast] -> MatMul(counts [B, N], table [N, D])
      Keras CategoryEncoding(output_mode="count") [count_weights=w] + Dense(use_bias=False),
      tf.math.bincount(ids, w, minlength=N, maxlength=N, axis=-1) @ table
  RaggedBincount(row_splits, values, size, w) [-> Cast] -> MatMul(counts [B, N], table [N, D])
      the same of ragged ids (Keras TextVectorization(output_mode="count") + Dense(use_bias=False),
      tf.math.bincount(ragged_ids, minlength=N, maxlength=N, axis=-1) @ table): one ragged bag a row
  SparseBincount(indices, values, dense_shape, size, w) [-> Cast] -> MatMul(counts [B, N], table [N, D])
      tf.math.bincount(sparse_ids, ...) @ table: the bags of the values by indices[:, 0]
  any of these counts [-> Identity] [-> Reshape to [-1, N] / [batch, N]] -> MatMul
      tf.feature_column's indicator_column in DenseFeatures + Dense(use_bias=False)
  Sum(OneHot(ids [B, K], N, 1, 0), axis=1) [-> Cast] -> MatMul(counts, table)
      tf.reduce_sum(tf.one_hot(ids, N), 1) @ table
  Sum(OneHot(ids, N) * w[..., None], axis=1) -> MatMul(counts, table)
      weighted counts: tf.reduce_sum(tf.one_hot(ids, N) * w[..., None], 1) @ table

counts[b, n] = sum_k w[b, k] [ids[b, k] == n], so counts @ table is the bag
sum_k w[b, k] table[ids[b, k]]. An id outside [0, N) counts nowhere (bincount
drops ids >= its size and refuses negative ones; one_hot gives them a zero
row): the fused op reads it as padding. A multi-hot encoding (binary_output:
CategoryEncoding multi_hot) counts each distinct id once, which no sum over
the ids is (a duplicate would count twice): reported, not fused.

  SparseTensorDenseMatMul(sp [B, N], table [N, D])   tf.sparse.sparse_dense_matmul(sp, table)
      out[b] = sum over sp's values v at (b, id) of v * table[id]: the ragged
      bag of ids sp.indices[:, 1] weighted by sp.values, rows sp.indices[:, 0]
      (sorted, as the fused op's row_splits need) of dense_shape[0] bags.
"""
from __future__ import annotations

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_shape

from pkm_serve.export.einsum import match_matmul
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.position_slices import attr_value
from pkm_serve.export.sites import (INDEX_DTYPES, TABLE_DTYPES, Site, Skip, check_private, dims,
                                    dtype_name, itemsize, same_dims, tensor_dtype)

_INTEGER_COUNTS = (types_pb2.DT_INT32, types_pb2.DT_INT64)
_FLAT_BINCOUNTS = ("RaggedBincount", "SparseBincount")  # of flat values, bags by row_splits / indices
_BINCOUNTS = ("DenseBincount",) + _FLAT_BINCOUNTS
_SIZE_INPUT = {"DenseBincount": 1, "RaggedBincount": 2, "SparseBincount": 3}  # the bincount's size


def match_matmul_site(fg: FunctionGraph, node, site: Site) -> Site:
    """A matmul of counts by a table (this module), else one of gathered rows (einsum.py)."""
    if _counts_producer(fg, fg.inputs(node)[0])[0] is not None:
        site.pattern = "counts-matmul"
        return _match_counts_matmul(fg, node, site)
    if _scaled_counts(fg, fg.inputs(node)[0]):
        site.pattern = "counts-matmul"
        _fill_table(fg, site, fg.inputs(node)[1], _operand_type(node))
        raise Skip("id counts multiplied by a tensor before the matmul (Keras output_mode='tf_idf': counts * "
                   "idf weights): not fused, the op weighs ids by a tensor shaped as the ids, not by a "
                   "factor per table row")
    return match_matmul(fg, node, site)


def _operand_type(node) -> int:
    """The matmul's operand dtype: T, or BatchMatMulV3's Ta (it has no T: indexing would add one)."""
    return node.attr["Ta" if node.op == "BatchMatMulV3" else "T"].type


def _scaled_counts(fg: FunctionGraph, ref: Ref) -> bool:
    """`ref` is Mul(counts, factor) (either order) of counts the matcher above takes."""
    node = fg.producer(ref)
    return node is not None and node.op == "Mul" and \
        any(_counts_producer(fg, factor)[0] is not None for factor in fg.inputs(node))


def match_sparse_dense_matmul(fg: FunctionGraph, node, site: Site) -> Site:
    """tf.sparse.sparse_dense_matmul(sp, table): a weighted ragged bag (module doc)."""
    sp_indices, sp_values, sp_shape, table = fg.inputs(node)[:4]
    site.pattern, site.weighted = "sparse_dense_matmul", True
    if _flag(node, "adjoint_a") or _flag(node, "adjoint_b"):
        raise Skip("sparse_dense_matmul with an adjoint operand: not sp [B, N] @ table [N, D]")
    _fill_table(fg, site, table, node.attr["T"].type)
    if tensor_dtype(fg, sp_indices) != types_pb2.DT_INT64:
        raise Skip("sparse indices that are not int64")
    site.sparse_indices, site.dense_shape, site.ids_are_sparse_columns = sp_indices, sp_shape, True
    site.indices, site.index_dtype, site.weights = sp_indices, types_pb2.DT_INT64, sp_values
    site.intermediate_itemsizes = (0,)  # the composite builds no [ids, D] rows either
    return site


def _flag(node, name: str) -> bool:
    """A bool attr, default False; read with `in`: indexing the attr map adds the key."""
    return name in node.attr and node.attr[name].b


def _counts_producer(fg: FunctionGraph, ref: Ref):
    """(the DenseBincount, RaggedBincount, SparseBincount or Sum(OneHot) node, the Cast between it and `ref` or None,
    the names of the Identity / no-op Reshape nodes between them and what only they read)."""
    node, cast, passed = fg.producer(ref), None, []
    while node is not None and node.op in ("Identity", "Reshape", "Cast"):
        if node.op == "Cast":
            if cast is not None:
                return None, None, []
            cast = node
        elif node.op == "Identity" or _unchanged_counts(fg, node, passed):
            passed.append(node.name)
        else:
            return None, None, []
        node = fg.producer(fg.inputs(node)[0])
    if node is None:
        return None, None, []
    if node.op in _BINCOUNTS:
        return node, cast, passed
    if node.op == "Sum" and _one_hot_of_sum(fg, node)[0] is not None:
        return node, cast, passed
    return None, None, []


def _unchanged_counts(fg: FunctionGraph, reshape, passed: list) -> bool:
    """A Reshape of [B, N] counts to [B, N] itself (tf.feature_column's indicator_column reshapes
    its counts to [shape(counts)[0], N]): the target, a constant or computed from Shape(counts)
    and constants, read symbolically, is [-1 or B, N or -1]. A target that only infers to
    [?, N] is not enough: [shape(counts)[1], N] refuses every batch but N, the fused op none.
    The nodes computing the target go with the site (into `passed`)."""
    counts, target = fg.inputs(reshape)[:2]
    before = fg.shape(counts)
    if before.rank != 2 or not before[-1]:
        return False
    shape_nodes = []
    dims = _shape_value(fg, target, counts, shape_nodes)
    if dims is None or len(dims) != 2 or dims[0] not in ("B", -1, before[0]) or dims[1] not in (before[-1], -1) \
            or dims == [-1, -1]:
        return False
    passed.extend(name for name in dict.fromkeys(shape_nodes) if name not in passed)
    return True


def _shape_value(fg: FunctionGraph, ref: Ref, counts: Ref, nodes: list, depth: int = 4):
    """The int vector `ref` ("B" for Shape(counts)[0]): a constant, Shape(counts), a unit-stride
    StridedSlice of one, Pack or ConcatV2 (axis 0) of them; None otherwise. A scalar is [v]."""
    value = fg.const_value(ref)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.ndim <= 1 else None
    node = fg.producer(ref)
    if node is None or depth == 0 or ref.index != 0 or node.op not in ("Shape", "StridedSlice", "Pack", "ConcatV2"):
        return None
    nodes.append(node.name)
    ins = fg.inputs(node)
    if node.op == "Shape":
        return ["B", fg.shape(counts)[-1]] if ins[0] == counts else None
    parts = [_shape_value(fg, r, counts, nodes, depth - 1) for r in ins[:-1 if node.op == "ConcatV2" else None]]
    if any(p is None for p in parts):
        return None
    if node.op == "Pack":
        return [d for p in parts for d in p] if attr_value(node, "axis", "i") == 0 else None
    if node.op == "ConcatV2":
        axis = fg.const_value(ins[-1])
        return [d for p in parts for d in p] if axis is not None and int(axis) == 0 else None
    vector, begin, end, stride = parts
    if [len(begin), len(end), stride] != [1, 1, [1]] or any(
            attr_value(node, m, "i") for m in ("ellipsis_mask", "new_axis_mask")):
        return None
    start = None if attr_value(node, "begin_mask", "i") & 1 else begin[0]
    stop = None if attr_value(node, "end_mask", "i") & 1 else end[0]
    if attr_value(node, "shrink_axis_mask", "i") & 1:  # vector[begin]
        return None if start is None or not -len(vector) <= start < len(vector) else [vector[start]]
    return vector[start:stop]


def _one_hot_of_sum(fg: FunctionGraph, node):
    """(the OneHot that Sum `node` adds up, directly or times a multiplier; that Mul or None;
    the multiplier or None)."""
    summed = fg.producer(fg.inputs(node)[0])
    if summed is not None and summed.op == "OneHot":
        return summed, None, None
    if summed is not None and summed.op == "Mul":
        factors = fg.inputs(summed)
        for i, ref in enumerate(factors):
            one_hot = fg.producer(ref)
            if one_hot is not None and one_hot.op == "OneHot":
                return one_hot, summed, factors[1 - i]
    return None, None, None


def _match_counts_matmul(fg: FunctionGraph, node, site: Site) -> Site:
    counts_node, cast, passed = _counts_producer(fg, fg.inputs(node)[0])
    table = fg.inputs(node)[1]
    if any(_flag(node, name) for name in ("transpose_a", "transpose_b", "adj_x", "adj_y")):
        raise Skip("a matmul of id counts with a transposed operand: not counts [B, N] @ table [N, D]")
    if node.op == "BatchMatMulV3" and len({node.attr[a].type for a in ("Ta", "Tb", "Tout")}) != 1:
        raise Skip("a BatchMatMulV3 of id counts whose operand and output types differ")
    _fill_table(fg, site, table, _operand_type(node))
    if counts_node.op in _BINCOUNTS:
        ids, nodes = _bincount_ids(fg, counts_node, cast, site)
    else:
        ids, nodes = _one_hot_ids(fg, counts_node, site, cast)
    counts = Ref(counts_node.name, 0)
    n_rows, counted = site.table_shape[0], fg.shape(counts)
    if counted.rank is None and counts_node.op in _FLAT_BINCOUNTS:  # TF infers no shape: [rows, size]
        counted = tensor_shape.TensorShape([None, None])
    if counted.rank == 2 and counted[-1] is None and counts_node.op in _BINCOUNTS:
        size = fg.inputs(counts_node)[_SIZE_INPUT[counts_node.op]]
        counted = counted[:1].concatenate([_fixed_size(fg, size)])
    if counted.rank != 2 or counted[-1] is None or n_rows not in (None, counted[-1]):
        raise Skip(f"id counts of shape {counted} are not [B, N] with N fixed to the table's rows")
    ids_shape = fg.shape(ids)
    if ids_shape.rank != (1 if counts_node.op in _FLAT_BINCOUNTS else 2):
        raise Skip(f"ids of shape {ids_shape}: only [B, K] ids are counted into one bag per row")
    site.rows_from_counts = n_rows is None  # the matmul refuses a table of other rows: fuse.py asserts N
    site.table_shape = [counted[-1], site.table_shape[1]]
    site.indices, site.index_dtype = ids, tensor_dtype(fg, ids)
    if site.index_dtype not in INDEX_DTYPES:
        raise Skip(f"index dtype {dtype_name(site.index_dtype)} is not int32/int64")
    site.ids_past_rows_padding = True
    site.gathered_shape = dims(counted)
    site.internal = tuple(nodes + ([cast.name] if cast is not None else []) + passed)
    site.intermediate_itemsizes = (itemsize(site.table_dtype),)
    private = [Ref(n, 0) for n in site.internal]
    check_private(fg, private, set(site.internal) | {node.name})
    return site


def _fixed_size(fg: FunctionGraph, ref: Ref):
    """The bincount size that tf.math.bincount(minlength=N, maxlength=N) fixes:
    min(N, max(N, max(ids) + 1)) = N; None where it is not fixed."""
    value = fg.const_value(ref)
    if value is not None:
        return int(value)
    node = fg.producer(ref)
    if node is None or node.op != "Minimum":
        return None
    bounds = [fg.const_value(r) for r in fg.inputs(node)]
    inner = [fg.producer(r) for r in fg.inputs(node)]
    for upper, other in ((bounds[0], inner[1]), (bounds[1], inner[0])):
        if upper is None or other is None or other.op != "Maximum":
            continue
        lower = [fg.const_value(r) for r in fg.inputs(other)]
        if any(v is not None and int(v) == int(upper) for v in lower):
            return int(upper)
    return None


def _fill_table(fg: FunctionGraph, site: Site, table: Ref, dtype: int) -> None:
    site.params, site.params_is_resource = table, False
    producer = fg.producer(table)
    site.table = fg.inputs(producer)[0].node if producer is not None and producer.op == "ReadVariableOp" \
        else table.node
    shape = fg.shape(table)
    site.table_shape, site.table_dtype, site.dtype = dims(shape), dtype, dtype_name(dtype)
    if shape.rank != 2:
        raise Skip("table is not known to be 2-D")
    if dtype not in TABLE_DTYPES:
        raise Skip(f"table dtype {dtype_name(dtype)} is not float32/float16/bfloat16")


def _bincount_ids(fg: FunctionGraph, node, cast, site: Site):
    """ids (and weights into `site`) of DenseBincount(ids, size, weights), or the values of
    RaggedBincount(row_splits, values, size, weights) / SparseBincount(indices, values, dense_shape,
    size, weights), their row_splits / indices and dense_shape into `site`."""
    if node.op == "RaggedBincount":
        site.row_splits, ids, _, weights = fg.inputs(node)[:4]
    elif node.op == "SparseBincount":  # bags of the values by indices[:, 0], dense_shape[0] of them
        site.sparse_indices, ids, site.dense_shape, _, weights = fg.inputs(node)[:5]
        site.sparse_any_order = True  # as SparseBincount takes them: fuse.py puts them in row order
        if not same_dims(fg.shape(site.dense_shape), tensor_shape.TensorShape([2])):
            raise Skip("id counts of a SparseTensor not known to be 2-D: only [B, K] ids are counted into "
                       "one bag per row")
        # SparseBincount counts a negative id nowhere (the other two refuse it): a sparse site's negative
        # ids are padding, unchecked (fuse.py), as safe_embedding_lookup_sparse's are
    else:
        ids, _, weights = fg.inputs(node)[:3]
    if _flag(node, "binary_output"):
        raise Skip("a multi-hot encoding (bincount binary_output=True, CategoryEncoding "
                   "output_mode='multi_hot') counts each distinct id once: the op's sum would count a "
                   "duplicate id twice, so the site stays composite")
    counts_dtype = node.attr["T"].type
    w_shape = fg.shape(weights)
    if w_shape.num_elements() != 0:
        site.weighted = True
        if not same_dims(w_shape, fg.shape(ids)):
            raise Skip(f"count weights of shape {w_shape} do not match the ids' shape {fg.shape(ids)}")
        if cast is not None or counts_dtype != site.table_dtype:
            raise Skip(f"count weights of dtype {dtype_name(counts_dtype)} cast before the matmul")
        site.weights = weights
    else:
        _check_counts_dtype(counts_dtype, cast, site)
    return ids, [node.name]


def _check_counts_dtype(counts_dtype: int, cast, site: Site) -> None:
    """Counts in the table's dtype, or integer/float counts cast to it."""
    if cast is None and counts_dtype != site.table_dtype or \
            cast is not None and counts_dtype not in _INTEGER_COUNTS + TABLE_DTYPES:
        raise Skip(f"id counts of dtype {dtype_name(counts_dtype)} multiply a {site.dtype} table")


def _one_hot_ids(fg: FunctionGraph, node, site: Site, cast):
    """ids of Sum(OneHot(ids, depth, on=1, off=0, axis=-1) [* w[..., None]], axis=-2); weights into `site`."""
    one_hot, multiply, weights = _one_hot_of_sum(fg, node)
    ids, depth, on, off = fg.inputs(one_hot)[:4]
    axis = one_hot.attr["axis"].i if "axis" in one_hot.attr else -1  # a default attr is stripped
    summed_axis = fg.const_value(fg.inputs(node)[1])
    reason = "a sum of one_hot(ids) that is not the count of each id in the bag axis of [B, K] ids"
    if fg.shape(ids).rank != 2 or axis not in (-1, 2) or _flag(node, "keep_dims") or \
            summed_axis is None or summed_axis.size != 1 or int(summed_axis.reshape(())) not in (1, -2):
        raise Skip(reason)
    on_value, off_value = fg.const_value(on), fg.const_value(off)
    if on_value is None or off_value is None or on_value.reshape(()) != 1 or off_value.reshape(()) != 0:
        raise Skip("one_hot with on_value/off_value other than 1/0")
    depth_value = fg.const_value(depth)
    if depth_value is None or site.table_shape[0] not in (None, int(depth_value)):
        raise Skip("one_hot depth is not the table's rows")
    site.negative_ids_padding = True  # one_hot gives them a zero row, the op skips them
    if multiply is None:
        _check_counts_dtype(node.attr["T"].type, cast, site)
        return ids, [one_hot.name, node.name]
    _one_hot_weights(fg, weights, ids, node.attr["T"].type, cast, site)
    return ids, [one_hot.name, multiply.name, node.name]


def _one_hot_weights(fg: FunctionGraph, weights: Ref, ids: Ref, counts_dtype: int, cast, site: Site) -> None:
    """The multiplier of one_hot(ids, N) * w[..., None]: per index ([B, K, 1], the ids' [B, K])
    and in the table's dtype; the fused op weighs each id by it."""
    site.weighted = True
    w_shape = fg.shape(weights)
    if w_shape.rank != 3 or w_shape[-1] != 1 or not same_dims(w_shape[:-1], fg.shape(ids)):
        raise Skip(f"a multiplier of shape {w_shape} on one_hot(ids) that is not per index "
                   f"(w[..., None] with w shaped as the ids {fg.shape(ids)})")
    if cast is not None or counts_dtype != site.table_dtype:
        raise Skip(f"weighted one_hot counts of dtype {dtype_name(counts_dtype)} cast before the matmul")
    site.weights, site.weights_squeeze, site.weights_on_one_hot = weights, True, True
