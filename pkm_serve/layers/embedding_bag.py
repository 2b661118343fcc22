"""`EmbeddingBag`: a Keras layer over the fused PkmEmbeddingBag op."""
import contextlib

import keras
import numpy as np

from pkm_serve.layers._lookup import (from_config_keeping_tf_training_options, is_tensorflow_backend,
                                     jax_wraps_64_bit_ids, lookup_supports_jit, refuse_ids_past_int32,
                                     refuse_rounded_half_float_ids, refuse_rows_past_int32, refuse_table_dtype,
                                     refuse_tf_keras, refuse_tf_training_options, refuse_unsigned_ids_past,
                                     clip_unsigned_ids,
                                     require_positive_ints, resolve_lookup)

COMBINERS = ("sum", "mean", "sqrtn", "max")


@keras.saving.register_keras_serializable(package="pkm_serve")
class EmbeddingBag(keras.layers.Layer):
    """out[..., :] = combine_k weights[..., k] * embeddings[indices[..., k], :].

    Like `keras.layers.Embedding` followed by a (weighted) reduction over the
    bag axis, but fused: no `[..., K, output_dim]` buffer exists in forward or
    backward, and the table's gradient is one dense tensor.

    Args:
        input_dim: number of table rows (largest index + 1).
        output_dim: width of each row and of the output.
        combiner: "sum", "mean" (sum(w*x)/sum(w)), "sqrtn" (sum(w*x)/sqrt(sum(w^2))) or "max"
            (elementwise max over the bag, weights None; as torch's mode="max").
        embeddings_initializer / embeddings_regularizer / embeddings_constraint:
            as in `keras.layers.Embedding`.
        implementation: "fused" (the custom op) or "composite" (stock TF ops).
        fallback: None (a missing op library is an error) or "composite" (use
            the composite when the op library does not load).
        sparse_gradient: if True, the table's gradient is a `tf.IndexedSlices`
            of the distinct rows touched (pair it with
            `pkm_serve.optimizers.LazyAdam` / `RowwiseAdagrad` to update only
            those rows); default False, a dense gradient.
        fused_optimizer: if True (float32 table, dense indices, the fused
            op), `pkm_serve.optimizers.LazyAdam` / `RowwiseAdagrad` apply
            their update to the table inside the backward pass, never forming
            its gradient (pkm_serve/_fused_update.py); default False.
        weights: the table's starting rows, `[matrix]` or `matrix` of shape
            `(input_dim, output_dim)` (e.g. pretrained vectors), as
            `keras.layers.Embedding(weights=...)` takes them; default None.

    Call:
        indices: int `[..., K]`, or a `tf.RaggedTensor` whose last dimension is
            ragged (bags of varying size), or (TF) a `[batch, K]`
            `tf.SparseTensor` whose entries present form each bag (weights: one
            at the same positions; under JAX a `[batch, K]` BCOO, as from
            `keras.Input(sparse=True)`, alike, one entry per position); otherwise under JAX / PyTorch dense only (pad ragged
            bags with -1; a list `[indices, weights]` is refused: pass weights as the
            second argument). Negative indices are padding: they
            add nothing and are not counted by mean/sqrtn. Float indices are
            cast to int64, as `keras.layers.Embedding` does (NaN and +inf ones and
            ones past int64, as uint64 ids past it on TF, are out of range); float16 / bfloat16
            ones (an enclosing layer's autocast under a mixed policy) into a
            table with ids past the largest integer they hold with all below it
            (float16 2048, bfloat16 256) are refused.
        weights: per-index weights shaped like `indices` (ragged when indices
            are), or None for all ones.

    Returns `[..., output_dim]` in the layer's compute dtype. A Keras mask over the
    leading dims `[...]` passes on; one over the bag axis is refused (see compute_mask).

    Mixed precision: the op reads the table in its stored dtype (float32 under
    the `mixed_*` policies, called directly or in a model) and the weights are cast to that dtype; only the
    `[..., output_dim]` result is cast to the compute dtype. Casting the whole
    table to float16 every step would cost O(input_dim * output_dim) per call.
    Under a pure `float16`/`bfloat16` policy the table itself is half and the
    op runs in half (accumulating in float32). Another layer that reads `embeddings`
    (weight tying) gets it in its own compute dtype, as a `keras.layers.Embedding`'s.
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        combiner="sum",
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        implementation="fused",
        fallback=None,
        sparse_gradient=False,
        fused_optimizer=False,
        weights=None,
        **kwargs,
    ):
        input_dim, output_dim = require_positive_ints("EmbeddingBag", input_dim=input_dim,
                                                      output_dim=output_dim)
        if combiner not in COMBINERS:
            raise ValueError(
                f"EmbeddingBag: combiner must be one of {COMBINERS}, got {combiner!r}"
            )
        refuse_tf_training_options("EmbeddingBag", sparse_gradient, fused_optimizer)
        refuse_rows_past_int32("EmbeddingBag", input_dim)
        super().__init__(**kwargs)
        refuse_table_dtype("EmbeddingBag", self.dtype_policy)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.combiner = combiner
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.implementation = implementation
        self.fallback = fallback
        self.sparse_gradient = bool(sparse_gradient)
        self.fused_optimizer = bool(fused_optimizer)
        if self.fused_optimizer and implementation != "fused":
            raise ValueError("EmbeddingBag: fused_optimizer=True needs implementation='fused'")
        if self.fused_optimizer and combiner == "max":
            raise ValueError("EmbeddingBag: fused_optimizer=True takes the combiners sum, mean and sqrtn (the fused "
                             "update has no max); use sparse_gradient=True for combiner='max'")
        self._lookup = resolve_lookup(implementation, fallback, "EmbeddingBag")
        # The sparse gradient's row count is data-dependent: XLA cannot compile it.
        self.supports_jit = (lookup_supports_jit(self._lookup) and not self.sparse_gradient
                             and not self.fused_optimizer)
        # The table is read in its stored dtype (see the class docstring).
        self.autocast = False
        if weights is not None:
            self.build()
            self.set_weights(weights if isinstance(weights, list) and len(weights) == 1 else [weights])

    def build(self, input_shape=None):
        if self.built:
            return
        self.embeddings = self.add_weight(
            shape=(self.input_dim, self.output_dim),
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
            name="embeddings",
            trainable=True,
        )
        if self.fused_optimizer and is_tensorflow_backend():
            from pkm_serve import _fused_update

            _fused_update.request(self.embeddings)
        self.built = True

    def __call__(self, *args, **kwargs):
        indices = args[0] if args else kwargs.get("indices")
        _refuse_listed_inputs(indices)
        _refuse_tf_composite_ids(indices)
        if keras.backend.is_keras_tensor(indices) and len(indices.shape) == 1:
            raise ValueError(
                f"EmbeddingBag: indices are [..., K] bags, but this Keras input has shape {indices.shape}: its "
                "only axis is the batch axis, so each bag would be the whole batch (one output for all "
                "examples). Give each example its bag: keras.Input((K,)), or keras.Input((1,)) for one id.")
        # Host ids are checked before Keras converts them (under JAX, wrapping int64 into int32).
        refuse_ids_past_int32("EmbeddingBag", indices)
        with _no_autocast_scope():
            return super().__call__(*args, **kwargs)

    def call(self, indices, weights=None):
        table = self.embeddings.value
        if not is_tensorflow_backend():
            return self._call_keras_ops(table, indices, weights)
        refuse_tf_keras("EmbeddingBag", (indices, weights))
        import tensorflow as tf

        if isinstance(indices, tf.SparseTensor):
            indices, weights = _sparse_bags_as_ragged(indices, weights)
        if isinstance(indices, tf.RaggedTensor):
            refuse_rounded_half_float_ids("EmbeddingBag", indices.dtype.name, self.input_dim)
            indices = indices.with_flat_values(_as_index_dtype(indices.flat_values))
            if weights is not None:
                if not isinstance(weights, tf.RaggedTensor):
                    raise ValueError(
                        "EmbeddingBag: indices are ragged, so weights must be a "
                        f"tf.RaggedTensor with the same row splits (got {type(weights).__name__})"
                    )
                weights = weights.with_flat_values(
                    tf.cast(weights.flat_values, table.dtype)
                )
        else:
            indices = tf.convert_to_tensor(indices)
            refuse_rounded_half_float_ids("EmbeddingBag", indices.dtype.name, self.input_dim)
            indices = _as_index_dtype(indices)
            if indices.shape.rank == 0:
                raise ValueError(
                    "EmbeddingBag: indices must have at least one dimension (the bag "
                    "axis, [..., K]); got a scalar"
                )
            if weights is not None:
                weights = tf.cast(weights, table.dtype)
                if weights.shape.is_fully_defined() and indices.shape.is_fully_defined():
                    if weights.shape != indices.shape:
                        raise ValueError(
                            "EmbeddingBag: weights must have the shape of indices, got "
                            f"weights {weights.shape} and indices {indices.shape}"
                        )
        if self.fused_optimizer:
            from pkm_serve import _fused_update

            outputs = _fused_update.fused_embedding_bag(self.embeddings, indices, weights, self.combiner)
        else:
            if self.sparse_gradient:
                from pkm_serve import _copy_on_write

                # Stock Keras optimizers apply the row-sparse gradient with scatter updates.
                _copy_on_write.stay_copy_on_write_after_scatters(table)
            outputs = self._lookup(table, indices, weights, combiner=self.combiner,
                                   sparse_gradient=self._sparse_gradient_here())
        return tf.cast(outputs, self.compute_dtype)

    def _sparse_gradient_here(self):
        """sparse_gradient, but not for a frozen layer under XLA: Keras leaves its tf.Variable
        trainable, so the step's tape watches it as it is read (and sparse_gradient=True raised
        the ValueError meant for training the table under XLA), yet asks no gradient of it. A tape
        that does ask gets the plain lookup's dense gradient there."""
        if not self.sparse_gradient or self.embeddings.trainable:
            return self.sparse_gradient
        from pkm_serve import _xla

        return _xla.compile_device_type() is None

    def _call_keras_ops(self, table, indices, weights):
        """call() under JAX / PyTorch: dense [..., K] bags (ragged bags: pkm_serve.backends.embedding_bag)."""
        ops = keras.ops
        unchecked_bags = None
        if type(indices).__name__ == "BCOO":   # keras.Input(sparse=True) under JAX
            from pkm_serve.layers._jax_sparse import jax_sparse_bags_as_padded

            indices, weights, unchecked_bags = jax_sparse_bags_as_padded(indices, weights)
        indices = ops.convert_to_tensor(indices)
        if len(indices.shape) == 0:
            raise ValueError(
                "EmbeddingBag: indices must have at least one dimension (the bag "
                "axis, [..., K]); got a scalar"
            )
        dtype = keras.backend.standardize_dtype(indices.dtype)
        if dtype not in ("int32", "int64"):
            if not (dtype.startswith(("int", "uint", "float", "bfloat"))):
                raise TypeError(f"EmbeddingBag: indices must be integers (int32/int64), got {dtype}")
            refuse_rounded_half_float_ids("EmbeddingBag", dtype, self.input_dim)
            target = "int32" if jax_wraps_64_bit_ids() else "int64"  # JAX: int64 needs x64
            if dtype.startswith("uint") and np.iinfo(dtype).max > np.iinfo(target).max:
                # Cast, an id past the signed range wrapped to a negative one (padding, no error, for
                # uint32 ids under JAX): clipped, it stays past the table, an out-of-range error.
                if self.implementation == "fused":
                    indices = refuse_unsigned_ids_past("EmbeddingBag", indices, target, self.input_dim)
                indices = clip_unsigned_ids("EmbeddingBag", indices, target, self.input_dim)
            indices = _float_ids_as(indices, target) if dtype.startswith(("float", "bfloat")) \
                else ops.cast(indices, target)
        if weights is not None:
            weights = ops.convert_to_tensor(weights)
            if tuple(weights.shape) != tuple(indices.shape):
                raise ValueError(
                    "EmbeddingBag: weights must have the shape of indices, got "
                    f"weights {tuple(weights.shape)} and indices {tuple(indices.shape)}"
                )
            weights = ops.cast(weights, table.dtype)
        outputs = self._lookup(table, indices, weights, combiner=self.combiner)
        if unchecked_bags is not None:   # malformed sparse bags no check could refuse: NaN, not a value
            outputs = ops.where(unchecked_bags[:, None], float("nan"), outputs)
        return ops.cast(outputs, self.compute_dtype)

    def compute_mask(self, indices, mask=None):
        """A Keras mask over the leading dims (e.g. `Masking` over `[batch, time, K]` ids) passes on,
        so a following mask-aware layer skips those positions; a mask over the bag axis is refused."""
        if mask is None:
            return None
        mask_rank, ids_rank = len(mask.shape), len(indices.shape)
        if mask_rank != ids_rank - 1:
            raise ValueError(
                f"EmbeddingBag: a Keras mask must cover the leading dims of indices [..., K] (rank "
                f"{ids_rank - 1}), got one of rank {mask_rank}: mark padding ids in a bag with negative "
                "indices instead of a mask over the bag axis")
        return mask

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "input_dim": self.input_dim,
                "output_dim": self.output_dim,
                "combiner": self.combiner,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer
                ),
                "embeddings_regularizer": keras.regularizers.serialize(
                    self.embeddings_regularizer
                ),
                "embeddings_constraint": keras.constraints.serialize(
                    self.embeddings_constraint
                ),
                "implementation": self.implementation,
                "fallback": self.fallback,
                "sparse_gradient": self.sparse_gradient,
                "fused_optimizer": self.fused_optimizer,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        return from_config_keeping_tf_training_options(super().from_config, config)


def _refuse_listed_inputs(indices):
    """ValueError for a list or tuple of tensors as indices, e.g. layer([ids, weights]) as Keras'
    multi-input layers take them: it failed deep in Keras ("Cannot convert '8' to a shape", "'list'
    object has no attribute 'shape'") or, eagerly under TF, packed ids and weights into one tensor.
    Where every tensor holds integers the caller meant several id tensors, not ids and weights.
    Python ids (numbers, nested lists) get a ValueError naming np.asarray."""
    if isinstance(indices, (int, float)):   # (bool too) Keras said "pass it as a keyword argument"
        raise ValueError(f"EmbeddingBag: indices must have at least one dimension (the bag axis, [..., K]); "
                         f"got a Python {type(indices).__name__} ({indices!r}): pass np.asarray([[id]], 'int32')")
    if not isinstance(indices, (list, tuple)):
        return
    if not any(_is_tensor_like(x) for x in keras.tree.flatten(indices)):
        _refuse_python_ids(indices)
    if any(_is_tensor_like(x) for x in indices):
        listed = f"a {type(indices).__name__} of {len(indices)} tensors"
        takes = ("EmbeddingBag takes layer(indices) or layer(indices, weights): indices one integer "
                 "[..., K] tensor (each row along the last axis a bag; -1 pads)")
        if len(indices) == 1:   # (Keras' functional habit of wrapping a lone input)
            raise ValueError(f"{takes}, got a {type(indices).__name__} of 1 tensor: pass the tensor itself, "
                             f"layer(indices), not in a {type(indices).__name__}")
        if all(_holds_integers(x) for x in indices):
            raise ValueError(f"{takes}, got {listed} of ids: stack them into one tensor "
                             "(keras.ops.stack / np.stack, bags of one length) or call the layer on each")
        raise ValueError(f"{takes}, got {listed}: pass per-index weights as the second argument, "
                         "layer(indices, weights), not in a list with the indices")


def _is_tensor_like(x):
    """A tensor, KerasTensor or array; not a numpy scalar (np.int64(3), as iterating an array gives):
    a list of those is Python ids, and counted as tensors it got "a list of 2 tensors" or, nested,
    AttributeError "'list' object has no attribute 'shape'"."""
    if isinstance(x, np.generic):
        return False
    return keras.ops.is_tensor(x) or keras.backend.is_keras_tensor(x) or hasattr(x, "__array__")


def _refuse_python_ids(indices):
    """ValueError for ids as nested Python lists / tuples: Keras' own layers refuse them too, but with
    "should be passed as a keyword argument" (pointing the wrong way) or, for [] and [[]], an
    AttributeError from deep inside the layer."""
    kind = type(indices).__name__
    raise ValueError(
        f"EmbeddingBag: indices must be a tensor or array, got a Python {kind} ({_describe(indices)}); "
        "Keras layers take no Python lists: pass np.asarray(ids, 'int32') of [..., K] bags (bags of "
        "different lengths: pad them with -1, which adds nothing)")


def _describe(nested):
    """`[[1, 2], [3]]`-style text, cut short."""
    text = repr(nested)
    return text if len(text) <= 40 else text[:37] + "..."


def _holds_integers(x):
    """Whether x (a tensor, KerasTensor or array-like) has an integer dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(x).dtype
        except (TypeError, ValueError):
            return False
    try:
        return keras.backend.standardize_dtype(dtype).startswith(("int", "uint"))
    except ValueError:
        return False


def _refuse_tf_composite_ids(indices):
    """ValueError for a tf.RaggedTensor / tf.SparseTensor of ids under JAX or PyTorch, which take dense
    bags: Keras refused them with "Only input tensors may be passed as positional arguments ... should
    be passed as a keyword argument", which points the wrong way."""
    kind = type(indices).__name__
    if is_tensorflow_backend() or kind not in ("RaggedTensor", "SparseTensor") \
            or not type(indices).__module__.startswith("tensorflow."):
        return
    padded = "ids.to_tensor(default_value=-1)" if kind == "RaggedTensor" else "tf.sparse.to_dense(ids, -1)"
    raise ValueError(
        f"EmbeddingBag: under the {keras.backend.backend()} backend indices are a dense [..., K] tensor, got a "
        f"tf.{kind}: pad the bags with -1 (padding ids add nothing), {padded}, or call "
        "pkm_serve.backends.embedding_bag with values and row_splits")


def _no_autocast_scope():
    """Where this layer reads its table uncast. The variable autocasts, as keras.layers.Embedding's
    (a layer that ties its weights to the table reads it in its compute dtype), but Layer.__call__
    opens an autocast scope of the compute dtype when none is open (a direct call under a mixed
    policy: the lookup read a 16-bit copy of the whole table); inside an open one, as this empty
    one, it opens none for a layer with autocast=False."""
    try:
        from keras.src.backend import AutocastScope  # Keras exports no public one
    except ImportError:
        return contextlib.nullcontext()
    return AutocastScope(None)


def _as_index_dtype(indices):
    import tensorflow as tf

    if indices.dtype in (tf.int32, tf.int64):
        return indices
    if not (indices.dtype.is_integer or indices.dtype.is_floating):
        raise TypeError(
            f"EmbeddingBag: indices must be integers (int32/int64), got {indices.dtype.name}"
        )
    as_int64 = tf.cast(indices, tf.int64)
    # Cast, a uint64 id >= 2**63 wrapped negative and a NaN, +inf or float id >= 2**63 became
    # int64's smallest value: padding, without an error. They are kept past the table instead.
    # (x < bound picks the cast, so NaN fails it: Grappler rewrites ~(x < bound) to x >= bound, false for NaN.)
    if indices.dtype == tf.uint64:
        representable = indices <= np.iinfo(np.int64).max
    elif indices.dtype.is_floating:
        representable = tf.cast(indices, tf.float32) < 2.0**63   # (float32: 2**63 overflows float16)
    else:
        return as_int64
    return tf.where(representable, as_int64, tf.constant(np.iinfo(np.int64).max))


def _float_ids_as(indices, target):
    """Float ids cast to the integer dtype `target`, with NaN, +inf and ids past its range kept past
    the table: cast, they became its smallest value under PyTorch (padding, without an error) and NaN
    became 0 under JAX (reading row 0)."""
    ops = keras.ops
    largest = np.iinfo(target).max
    representable = ops.cast(indices, "float32") < float(largest) + 1   # false for NaN
    return ops.where(representable, ops.cast(indices, target), ops.cast(largest, target))


def _sparse_bags_as_ragged(indices, weights):
    """`[batch, K]` tf.SparseTensor ids (and weights at the same positions) as ragged bags of the
    entries present, as tf.nn.embedding_lookup_sparse reads them (absent entries are not in a bag)."""
    import tensorflow as tf

    if indices.shape.rank != 2:
        raise ValueError(f"EmbeddingBag: tf.SparseTensor indices must be [batch, K] (rank 2), got rank "
                         f"{indices.shape.rank}; pass higher-rank bags as a tf.RaggedTensor")
    positions, ids = _row_major(indices)  # argsort, not tf.sparse.reorder: XLA compiles it
    bags = tf.RaggedTensor.from_value_rowids(ids, positions[:, 0], nrows=indices.dense_shape[0])
    if weights is None:
        return bags, None
    if not isinstance(weights, tf.SparseTensor):
        raise ValueError("EmbeddingBag: indices are a tf.SparseTensor, so weights must be one with the same "
                         f"positions (got {type(weights).__name__})")
    weight_positions, values = _row_major(weights)
    message = "EmbeddingBag: sparse weights must hold an entry at each position of the sparse indices"
    from pkm_serve import _op_args, _xla

    checked = _xla.checked_when_compiled(lambda: _op_args.same_entries(weight_positions, positions), values,
                                         message)  # XLA drops the asserts below
    if checked is not None:
        return bags, bags.with_flat_values(checked)
    same_count = tf.debugging.assert_equal(tf.shape(weight_positions), tf.shape(positions), message=message)
    with tf.control_dependencies([same_count]):
        same_positions = tf.debugging.assert_equal(weight_positions, positions, message=message)
    # XLA drops the asserts where it compiles this graph later (a SavedModel or concrete function
    # traced without jit_compile, called in a jit_compile function): there the op gets row splits
    # marked as mismatched and fails, instead of reading weights of other positions as the ids'.
    splits = _op_args.mark_mismatched_weights(bags.row_splits, _op_args.same_entries(weight_positions, positions))
    bags = tf.RaggedTensor.from_row_splits(bags.values, splits, validate=False)
    with tf.control_dependencies([same_positions]):
        return bags, bags.with_flat_values(tf.identity(values))


def _row_major(sparse):
    """(positions, values) of a 2-D tf.SparseTensor sorted row-major."""
    import tensorflow as tf

    key = sparse.indices[:, 0] * sparse.dense_shape[1] + sparse.indices[:, 1]
    order = tf.argsort(key, stable=True)
    return tf.gather(sparse.indices, order), tf.gather(sparse.values, order)
