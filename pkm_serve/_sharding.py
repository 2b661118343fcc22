"""``embedding_bag`` over a row-partitioned table (a ``ShardedVariable`` or a
list of shards): one fused lookup per shard, combined once."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import ops  # colocate_with without v1's deprecation warning

from pkm_serve._composite import _inverse_norm
from pkm_serve._fused import fused_embedding_bag
from pkm_serve._op_args import _as_indices, _as_weights, _check_combiner, _ragged_weight_values

def _table_shards(params):
    shards = list(params.variables) if type(params).__name__ == "ShardedVariable" else list(params)
    if not shards:
        raise ValueError("a sharded table needs at least one shard")
    shards = [s if isinstance(s, (tf.Variable, tf.Tensor)) else tf.convert_to_tensor(s) for s in shards]
    for i, shard in enumerate(shards):
        if shard.shape.rank is not None and shard.shape.rank != 2:
            raise ValueError(f"table shard {i} must be a [N_i, D] matrix, got shape {shard.shape}")
        if shard.dtype != shards[0].dtype:
            raise TypeError(f"table shards must share one dtype: shard {i} is {shard.dtype.name}, "
                            f"shard 0 {shards[0].dtype.name}")
    dims = {int(s.shape[1]) for s in shards if s.shape[1] is not None}
    if len(dims) > 1:
        raise ValueError(f"table shards must all have the same width, got widths {sorted(dims)}")
    return shards


@tf.autograph.experimental.do_not_convert
def sharded_embedding_bag(params, indices, weights=None, combiner="sum", name=None,
                          sparse_gradient=False):
    """``embedding_bag`` over a row-partitioned table, one fused lookup per shard.

    ``params`` is a ``ShardedVariable`` (e.g. from ``ParameterServerStrategy``'s
    ``variable_partitioner``) or a list of ``[N_i, D]`` shards holding
    consecutive rows: shard ``i`` holds global rows ``[sum(N_<i), sum(N_<=i))``
    (the "div" partitioning of ``embedding_lookup``/``ShardedVariable``). Each
    shard runs the fused op, on the shard's device, over the indices that fall
    into it (the others become padding) with combiner ``sum`` and the weights
    divided by mean's / sqrtn's denominator over all valid entries, so the
    added partial bags equal the unsharded op. Gradients reach each
    shard (row-sparse with ``sparse_gradient=True``).
    """
    _check_combiner(combiner, weights)
    if combiner == "max":
        raise ValueError("combiner 'max' over a sharded table is not supported: pass one [N, D] table")
    shards = _table_shards(params)
    with tf.name_scope(name or "sharded_embedding_bag"):
        if isinstance(indices, tf.RaggedTensor):
            flat = indices.flat_values
            w_flat = _ragged_weight_values(indices, weights)
        else:
            if isinstance(weights, tf.RaggedTensor):
                raise TypeError("weights is ragged but indices is not")
            flat = indices
            w_flat = weights
        flat = _as_indices(flat)
        dtype = shards[0].dtype
        if w_flat is None:
            w_flat = tf.ones(tf.shape(flat), dtype)
        else:
            w_flat, _ = _as_weights(w_flat, dtype, flat)
            # The same shape as the ids, also where it is known only when the graph runs:
            # AddN does not broadcast (tf.where below would, and a mean then took weights
            # of another shape).
            w_flat = tf.math.add_n([w_flat, tf.zeros(tf.shape(flat), dtype)])
        sizes = [tf.shape(s, out_type=flat.dtype)[0] for s in shards]
        total = tf.add_n(sizes)
        check = tf.debugging.Assert(
            tf.reduce_all(flat < total),
            ["embedding_bag: index", tf.reduce_max(flat), "is out of range [0,", total,
             ") of the sharded table (negative indices are padding)"])
        with tf.control_dependencies([check]):
            flat = tf.identity(flat)
        w_flat = _combined_weights(indices, flat, w_flat, combiner)
        partial = None
        offset = tf.zeros([], flat.dtype)
        for i, (shard, size) in enumerate(zip(shards, sizes)):
            local = flat - offset
            # Ids past the table go to the last shard, whose kernel refuses them where the
            # Assert above is dropped (XLA, TFLite): as padding they vanished silently.
            last = i == len(shards) - 1
            mine = (local >= 0) if last else (local >= 0) & (local < size)
            local = tf.where(mine, local, -tf.ones_like(local))
            bags = indices.with_flat_values(local) if isinstance(indices, tf.RaggedTensor) else local
            bag_w = indices.with_flat_values(w_flat) if isinstance(indices, tf.RaggedTensor) else w_flat
            # Colocated, not tf.device(shard.device): the PS task's device was saved with the
            # op, and the SavedModel then ran nowhere else; a colocation follows the variable.
            with ops.colocate_with(shard):
                part = fused_embedding_bag(shard, bags, bag_w, "sum", sparse_gradient=sparse_gradient)
            # Ragged parts share the ids' row partition: adding their flat values skips
            # RaggedTensor addition's partition checks (RaggedRange, which XLA lacks).
            template = part if isinstance(part, tf.RaggedTensor) else None
            part = tf.cast(part.flat_values if template is not None else part, tf.float32)
            partial = part if partial is None else partial + part
            offset = offset + size
        partial = tf.cast(partial, dtype)
        return template.with_flat_values(partial) if template is not None else partial


def _combined_weights(indices, flat, w_flat, combiner):
    """The weights of the flat entries with mean's / sqrtn's denominator (over
    every valid entry of the bag, as the unsharded op counts it) divided in, so
    each shard's partial sum is already its share of the combined bag: a half
    shard's partial of an undivided sum overflowed (a mean of 480 rows of 300
    was inf in float16)."""
    if combiner == "sum":
        return w_flat
    valid_w = tf.where(flat >= 0, tf.cast(w_flat, tf.float32), tf.zeros_like(w_flat, tf.float32))
    ragged_bags = isinstance(indices, tf.RaggedTensor) and valid_w.shape.rank == 1
    if ragged_bags:  # the bag axis is the innermost ragged one: sums per row of it
        innermost = indices
        while isinstance(innermost.values, tf.RaggedTensor):
            innermost = innermost.values
        row_of_entry = innermost.value_rowids()
        totals = tf.math.unsorted_segment_sum(valid_w if combiner == "mean" else valid_w * valid_w,
                                              row_of_entry, innermost.nrows())
        denom = tf.gather(totals, row_of_entry)
    else:  # dense bags (also the flat values of a ragged tensor with a uniform bag axis)
        denom = tf.reduce_sum(valid_w if combiner == "mean" else valid_w * valid_w, axis=-1, keepdims=True)
    if combiner == "mean":
        scaled = tf.math.divide_no_nan(valid_w, denom)
    else:  # sqrtn; a bag of no weight stays 0, with finite derivatives
        scaled = valid_w * _inverse_norm(denom)
    return tf.cast(scaled, w_flat.dtype)
