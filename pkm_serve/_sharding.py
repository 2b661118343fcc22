"""``embedding_bag`` over a row-partitioned table (a ``ShardedVariable`` or a
list of shards): one fused lookup per shard, combined once."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import ops  # colocate_with without v1's deprecation warning

from pkm_serve import _xla
from pkm_serve._composite import _inverse_norm, bag_of_each_value
from pkm_serve._fused import fused_embedding_bag
from pkm_serve._op_args import (_as_indices, _as_weights, _check_combiner, _ragged_weights_and_splits,
                                _refuse_sparse_tensors)

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
    multiplied by a power of two near 1 / mean's or sqrtn's denominator over all
    valid entries; the added partial bags, times the rest of that factor in
    float32, equal the unsharded op. Gradients reach each
    shard (row-sparse with ``sparse_gradient=True``).
    """
    _check_combiner(combiner, weights)
    _refuse_sparse_tensors(indices, weights)
    if combiner == "max":
        raise ValueError("combiner 'max' over a sharded table is not supported: pass one [N, D] table")
    shards = _table_shards(params)
    with tf.name_scope(name or "sharded_embedding_bag"):
        if isinstance(indices, tf.RaggedTensor):
            flat = indices.flat_values
            w_flat, checked_splits = _ragged_weights_and_splits(indices, weights)
            # The shards' ops get the checked splits: they refuse a mismatch that XLA's dropped Assert let by.
            shard_bags = tf.RaggedTensor.from_nested_row_splits(
                flat, indices.nested_row_splits[:-1] + (checked_splits,), validate=False)
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
        flat, under_xla = _checked_ids(flat, total, dtype)
        w_flat, bag_scale = _combined_weights(indices, flat, w_flat, combiner, weights is not None)
        partial = None
        offset = tf.zeros([], flat.dtype)
        for i, (shard, size) in enumerate(zip(shards, sizes)):
            local = flat - offset
            # Ids past the table go to the last shard, whose kernel refuses them where the
            # Assert above is dropped (TFLite): as padding they vanished silently. Under XLA
            # _checked_under_xla refuses them, naming them as the Assert does.
            last = i == len(shards) - 1 and not under_xla
            mine = (local >= 0) if last else (local >= 0) & (local < size)
            local = tf.where(mine, local, -tf.ones_like(local))
            bags = shard_bags.with_flat_values(local) if isinstance(indices, tf.RaggedTensor) else local
            bag_w = shard_bags.with_flat_values(w_flat) if isinstance(indices, tf.RaggedTensor) else w_flat
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
        if bag_scale is not None:  # mean's / sqrtn's denominator, divided in float32
            partial = partial * bag_scale
        partial = tf.cast(partial, dtype)
        return template.with_flat_values(partial) if template is not None else partial


def _checked_ids(flat, total, dtype):
    """(the ids after the check that none is past the table, whether XLA compiles
    them for a backend with our custom-call target)."""
    under_xla = _xla.compile_device_type() in _xla.xla_device_types()
    outside_xla = _xla.compile_device_type() is None
    if outside_xla:
        # The fused op's check before the Assert (its input reads the checked ids): on the CPU
        # it names the first id past the table by position and value, as the unsharded op does
        # (the Assert, run first, raised TF's "Expected 'tf.Tensor(False, ...)' to be true" with
        # the largest id); the Assert stays for a kernel that takes such an id as padding (GPU).
        flat = _checked_in_tflite(flat, total, dtype)
    check = tf.debugging.Assert(
        tf.reduce_all(flat < total),
        ["embedding_bag: index", tf.reduce_max(flat), "is out of range [0,", total,
         ") of the sharded table (negative indices are padding)"])
    with tf.control_dependencies([check]):
        flat = tf.identity(flat)
    if under_xla:
        return _checked_under_xla(flat, total, dtype), True
    if not outside_xla:
        # XLA without our target (the shards run the composite): the Assert is dropped and
        # nothing can fail, so an id past the table is padding, as on the GPU.
        return tf.where(flat < total, flat, -tf.ones_like(flat)), False
    return flat, False


def _checked_in_tflite(flat, total, dtype):
    """The ids, checked by the fused op over a [total, 0] table as under XLA, its zero-width
    output added to them: the TFLite converter drops the Assert and control dependencies
    (the last shard's kernel then named an id past the table by its shard-local value and
    range), but keeps an op whose output the ids read."""
    table = tf.zeros(tf.stack([tf.cast(total, tf.int64), tf.constant(0, tf.int64)]), dtype)
    check = fused_embedding_bag(table, tf.reshape(flat, [-1, 1]))
    return flat + tf.cast(tf.reduce_sum(tf.cast(check, tf.float32)), flat.dtype)


def _checked_under_xla(flat, total, dtype):
    """The ids, after the fused op over a [total, 0] table checked them: XLA
    drops the Assert, and the last shard's kernel named an id past the table
    by its shard-local value and range ("indices[1] = 634 is out of range
    [0, 400)" for id 1234 of 1000 rows). The zero-width table takes no memory,
    and the lowering keeps zero-sized calls (side-effecting) so the check runs."""
    table = tf.zeros(tf.stack([tf.cast(total, tf.int64), tf.constant(0, tf.int64)]), dtype)
    check = fused_embedding_bag(table, tf.reshape(flat, [-1]))
    with tf.control_dependencies([check]):
        return tf.identity(flat)


def _combined_weights(indices, flat, w_flat, combiner, weighted):
    """(weights for the shards' sum lookups, per-bag float32 factor of their
    summed partials or None). For mean / sqrtn the factor is 1 / the
    denominator over every valid entry of the bag (as the unsharded op counts
    it), and the weights are multiplied by a power of two near it, so each
    half shard's partial is about its share of the bag: an undivided partial
    overflowed (a mean of 480 rows of 300 was inf in float16). A power of two,
    not the denominator itself: the weights stay exact in the table's dtype
    and the kernels accumulate the unsharded op's float32 sums, only scaled
    (weights 1/K for a mean of K > 2**14 float16 entries fell below float16's
    normal range: a mean of 1e6 ones came out 1.014), and 1/K summed K times
    in float32 drifted (0.9988 at K = 1e6) where the unsharded op sums ones."""
    if combiner == "sum":
        return w_flat, None
    valid_w = tf.where(flat >= 0, tf.cast(w_flat, tf.float32), tf.zeros_like(w_flat, tf.float32))
    bag_sum, to_entries = _bag_reductions(indices, valid_w)
    if combiner == "mean":
        factor = tf.math.divide_no_nan(1.0, bag_sum(valid_w))
    else:  # sqrtn; a bag of no weight stays 0, with finite derivatives
        factor = _inverse_norm(bag_sum(valid_w * valid_w))
    power = _power_of_two_near(factor, bag_sum, valid_w if weighted else None, w_flat.dtype)
    return tf.cast(valid_w * to_entries(power), w_flat.dtype), factor / power


def _bag_reductions(indices, entries):
    """(bag_sum, to_entries): per-bag sums of flat entries, shaped to multiply
    the bags' [..., D] output, and the per-bag values spread back to the entries."""
    if isinstance(indices, tf.RaggedTensor) and entries.shape.rank == 1:
        # The bag axis is the innermost ragged one: sums per row of it.
        innermost = indices
        while isinstance(innermost.values, tf.RaggedTensor):
            innermost = innermost.values
        rows = bag_of_each_value(innermost)  # value_rowids does not compile for bags masked inside jit
        return (lambda x: tf.math.unsorted_segment_sum(x, rows, innermost.nrows(out_type=tf.int32))[:, None],
                lambda per_bag: tf.gather(per_bag[:, 0], rows))
    # Dense bags (also the flat values of a ragged tensor with a uniform bag axis).
    return lambda x: tf.reduce_sum(x, axis=-1, keepdims=True), lambda per_bag: per_bag


# Smallest normal number of each weights dtype (numpy's finfo has no bfloat16).
_SMALLEST_NORMAL = {tf.float16: 2.0 ** -14, tf.bfloat16: 2.0 ** -126, tf.float32: 2.0 ** -126}


def _power_of_two_near(factor, bag_sum, valid_w, dtype):
    """Per bag, 2**round(log2(factor)), 1 where factor is 0 (a bag of no weight:
    its partials are multiplied by 0). Ones times it are exact down to 2**-24
    in float16; given weights (valid_w) keep their mantissa only in the normal
    range, so there it is raised until the bag's mean weight magnitude is at
    least `dtype`'s smallest normal number (float16: 2**-14), and no further,
    which keeps half partials finite (raised, a bag of n entries is at most
    n * 2**-14 times its share)."""
    log2 = lambda x: tf.math.log(x) / tf.math.log(2.0)  # noqa: E731
    exponent = tf.round(log2(factor))
    if valid_w is not None:
        magnitude = tf.abs(valid_w)
        tiny = _SMALLEST_NORMAL.get(dtype, 2.0 ** -126)
        floor = tf.math.divide_no_nan(tiny * bag_sum(tf.cast(magnitude > 0, tf.float32)), bag_sum(magnitude))
        exponent = tf.maximum(exponent, tf.math.ceil(log2(floor)))
    return tf.stop_gradient(tf.where(factor > 0, tf.pow(2.0, exponent), tf.ones_like(factor)))
