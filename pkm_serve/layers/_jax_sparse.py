"""`[batch, K]` BCOO ids under JAX (a `keras.Input(sparse=True)`'s batches) as EmbeddingBag's dense bags."""
import numpy as np


def jax_sparse_bags_as_padded(indices, weights):
    """`[batch, K]` BCOO ids, and BCOO weights at the same positions, as dense bags padded with -1 where
    no entry is present: the entries present form each bag, as TF reads a tf.SparseTensor (its
    `todense()` alone gave absent entries id 0, a real row). A position holds one id: two entries there
    (a BCOO built with repeated indices) summed into one other id, and weights at other positions than
    the ids' were read as 0 under jax.jit (predict, fit), both silently; both are a ValueError now,
    eagerly and under jit (there through a host callback). An export, or several devices, cannot hold
    that callback: there the position gets an id past the table, an out-of-range error of the CPU kernel,
    and the third value returned marks the bags holding such a position ([batch] bools; None where every
    position was checked), which the layer fills with NaN: the composite and the CUDA kernel read that id
    as padding, and the bag's other rows gave a plausible, wrong result."""
    import jax.numpy as jnp
    from jax.experimental import sparse

    if indices.ndim != 2:
        raise ValueError(f"EmbeddingBag: sparse indices must be [batch, K] (rank 2), got shape {indices.shape}")

    def entries_at(bcoo):   # entries per position (padding entries, out of bounds, drop out)
        return sparse.BCOO((jnp.ones_like(bcoo.data, jnp.int32), bcoo.indices), shape=bcoo.shape).todense()

    id_entries = entries_at(indices)
    ids = sparse.BCOO((_signed(indices.data), indices.indices), shape=indices.shape)
    padded = jnp.where(id_entries > 0, ids.todense(), -1)
    padded, unchecked = _refuse_where(id_entries > 1, padded, "EmbeddingBag: sparse indices hold {count} "
                                      "entries at position {position}: a bag reads one id per position (BCOO "
                                      "with repeated indices; give each id its own column)", id_entries)
    if weights is None:
        return padded, None, unchecked
    if type(weights).__name__ != "BCOO" or weights.shape != indices.shape:
        raise ValueError("EmbeddingBag: indices are a sparse BCOO, so weights must be one with the same "
                         f"positions (got {type(weights).__name__} of shape {getattr(weights, 'shape', None)})")
    weight_entries = entries_at(weights)
    padded, unchecked_weights = _refuse_where(
        weight_entries != id_entries, padded, "EmbeddingBag: sparse weights must hold an entry at each position "
        "of the sparse indices, and none elsewhere (position {position}: {count} weights)", weight_entries)
    if unchecked_weights is not None:
        unchecked = unchecked_weights if unchecked is None else jnp.logical_or(unchecked, unchecked_weights)
    return padded, weights.todense(), unchecked


def _signed(ids):
    """Unsigned ids as the layer's signed ids (int64, int32 without jax_enable_x64), so that -1 pads (in
    the unsigned dtype it was the largest id: every absent position an out-of-range error); an id past
    the signed range is clipped to its largest value, still past the table (an out-of-range error)."""
    import jax
    import jax.numpy as jnp

    if not jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
        return ids
    target = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    if jnp.iinfo(ids.dtype).max > jnp.iinfo(target).max:
        ids = jnp.minimum(ids, jnp.asarray(jnp.iinfo(target).max, ids.dtype))
    return ids.astype(target)


def _refuse_where(bad, passed, message, counts):
    """(`passed`, None), or a ValueError naming the first position where `bad` holds: eagerly at once,
    under jax.jit from a host callback that runs only for a batch with such a position. Where no host
    callback can run: (`passed` with an id past any table there, the [batch] bags holding one)."""
    import jax
    import jax.numpy as jnp

    from pkm_serve.backends.product_keys import _under_jax_export

    def refuse(value, bad, counts):
        bad = np.asarray(bad)
        if not bad.any():
            return np.asarray(value)
        position = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(message.format(position=list(position), count=int(np.asarray(counts)[position])))

    if not isinstance(bad, jax.core.Tracer):
        return (refuse(passed, bad, counts) if bool(jnp.any(bad)) else passed), None
    if _under_jax_export(passed) or jax.device_count() > 1:
        # No host callback there (see pkm_serve.layers._lookup.refuse_unsigned_ids_past): a bad position
        # gets an id past any table, which the CPU kernel refuses (naming that id), where it read another
        # row, or weight 0, silently. (The composite and the CUDA kernel read it as padding: the caller
        # marks those bags.)
        return jnp.where(bad, jnp.iinfo(passed.dtype).max, passed), jnp.any(bad, axis=-1)

    def host_check(value):
        return jax.pure_callback(refuse, jax.ShapeDtypeStruct(value.shape, value.dtype), value, bad, counts,
                                 vmap_method="expand_dims")
    return jax.lax.cond(jnp.any(bad), host_check, lambda value: value, passed), None
