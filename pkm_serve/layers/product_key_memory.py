"""`ProductKeyMemory`: the product-key memory layer of Lample et al. 2019.

"Large Memory Layers with Product Keys", arXiv 1907.05242. Per head, a query
q is split into halves q1, q2; each half is scored against its own set of
n_keys sub-keys, the top knn of each are combined into knn^2 candidate slots
(score s1[i] + s2[j], slot i * n_keys + j) and the best knn of those are read
from a shared table of n_keys^2 values, weighted by the softmax of their
scores. The value read is one fused EmbeddingBag over heads * knn slots with
per-sample weights, so no [batch, heads * knn, v_dim] buffer is built.
"""
import math
import warnings

import keras

from pkm_serve.layers._lookup import (from_config_keeping_tf_training_options, is_tensorflow_backend,
                                     lookup_supports_jit, refuse_rows_past_int32, refuse_table_dtype, refuse_tf_keras,
                                     refuse_tf_training_options, require_positive_ints, resolve_lookup)
from pkm_serve.layers.embedding_bag import EmbeddingBag
from pkm_serve.product_keys import product_key_search


class _QueryProjection(keras.layers.Dense):
    """The query's Dense, left out of `model.quantize`: int8 queries change which slots the
    product-key search picks (outputs moved by 20-44% where a quantized Dense moves ~1%)."""

    def quantize(self, mode, **kwargs):
        warnings.warn(f"ProductKeyMemory's query projection '{self.name}' is not quantized ({mode}): "
                      "quantized queries change which memory slots the search picks", stacklevel=2)

    def call(self, inputs, training=None):
        bits = {"bfloat16": (8, 7), "float16": (5, 10)}.get(self.compute_dtype)
        if bits is None or keras.backend.backend() not in ("jax", "tensorflow"):
            return super().call(inputs, training=training)
        if keras.backend.backend() == "tensorflow":
            return self._call_rounding_each_op(inputs)
        # Under jax.jit XLA keeps float32 between 16-bit ops (it drops the converts to and from
        # bfloat16), so the query and the slots it picks differed from eager JAX and TF (14 of
        # 256 rows, outputs 29% apart under mixed_bfloat16): each 16-bit result is rounded here.
        from jax import lax

        def rounded(x):  # on float32: a reduce_precision on the 16-bit type itself is dropped
            return lax.reduce_precision(keras.ops.cast(x, "float32"), *bits).astype(x.dtype)

        x = rounded(keras.ops.matmul(inputs, self.kernel))
        if self.bias is not None:
            x = rounded(keras.ops.add(x, self.bias))
        return x if self.activation is None else self.activation(x)

    def _call_rounding_each_op(self, inputs):
        """TF: in a tf.function (predict, fit, evaluate) grappler fused the 16-bit MatMul and bias add into
        one op that rounds once, so the query and its slots differed from eager TF, JAX and PyTorch (33 of
        256 rows under mixed_bfloat16). Here the bias is added in float32 to the 16-bit MatMul's rounded
        result and the sum rounded, as JAX and PyTorch do: grappler fuses no bias add across the casts.
        The MatMul stays 16-bit (a float32 one cost 3x at 512x1024x2048); TF's CPU MatMul without
        oneDNN (TF_ENABLE_ONEDNN_OPTS=0) rounds its 16-bit products otherwise, eager and in graphs alike."""
        x = keras.ops.matmul(inputs, self.kernel)
        if self.bias is not None:
            ops = keras.ops
            x = ops.cast(ops.add(ops.cast(x, "float32"), ops.cast(self.bias, "float32")), self.compute_dtype)
        return x if self.activation is None else self.activation(x)


@keras.saving.register_keras_serializable(package="pkm_serve")
class ProductKeyMemory(keras.layers.Layer):
    """Product-key memory: input `[..., d_model]` -> output `[..., v_dim]`.

    Args:
        v_dim: width of the memory values and the output (default: d_model).
        k_dim: query/key width per head (even: split into two sub-keys).
        n_keys: sub-keys per half; the memory holds n_keys**2 values.
        heads: independent query heads sharing one value table.
        knn: slots kept per sub-key search and per head after combining.
        query_batchnorm: batch-normalise the queries (the paper does).
        input_dropout / query_dropout / value_dropout: dropout rates.
        keys_initializer: default uniform(+-1/sqrt(k_dim/2)), as in the paper's code.
        values_initializer: default normal(0, v_dim**-0.5), as in the paper's code.
        implementation / fallback / sparse_gradient / fused_optimizer: as for
            `EmbeddingBag` (they apply to the value table).

    A Keras mask over the input's leading dims (e.g. from `Embedding(mask_zero=True)`) is passed
    on to the output; masked rows are left out of the query batch-norm's training statistics
    (a batch of masked rows alone leaves its moving moments as they are).
    """

    def __init__(
        self,
        v_dim=None,
        k_dim=128,
        n_keys=512,
        heads=4,
        knn=32,
        query_batchnorm=True,
        input_dropout=0.0,
        query_dropout=0.0,
        value_dropout=0.0,
        keys_initializer=None,
        values_initializer=None,
        implementation="fused",
        fallback=None,
        sparse_gradient=False,
        fused_optimizer=False,
        **kwargs,
    ):
        # Python ints: a numpy int32 n_keys would wrap in n_keys * n_keys.
        k_dim, n_keys, heads, knn = require_positive_ints(
            "ProductKeyMemory", k_dim=k_dim, n_keys=n_keys, heads=heads, knn=knn)
        if v_dim is not None:
            try:
                (v_dim,) = require_positive_ints("ProductKeyMemory", v_dim=v_dim)
            except ValueError:
                raise ValueError(
                    f"ProductKeyMemory: v_dim must be a positive integer or None, got {v_dim!r}") from None
        if k_dim % 2:
            raise ValueError(f"ProductKeyMemory: k_dim must be even (two sub-keys), got {k_dim}")
        if knn > n_keys:
            raise ValueError(f"ProductKeyMemory: knn ({knn}) must not exceed n_keys ({n_keys})")
        refuse_tf_training_options("ProductKeyMemory", sparse_gradient, fused_optimizer)
        # Its slots i * n_keys + j would wrap in int32 (product_key_search's int64 is int32 there).
        refuse_rows_past_int32("ProductKeyMemory", n_keys * n_keys)
        # Fail at construction, not at first call, when the op library is missing.
        lookup = resolve_lookup(implementation, fallback, "ProductKeyMemory")
        super().__init__(**kwargs)
        refuse_table_dtype("ProductKeyMemory", self.dtype_policy)
        # The sparse gradient's row count is data-dependent: XLA cannot compile it.
        self.supports_jit = lookup_supports_jit(lookup) and not sparse_gradient and not fused_optimizer
        self.v_dim = v_dim
        self.k_dim = k_dim
        self.n_keys = n_keys
        self.heads = heads
        self.knn = knn
        self.query_batchnorm = query_batchnorm
        self.input_dropout = input_dropout
        self.query_dropout = query_dropout
        self.value_dropout = value_dropout
        half = k_dim // 2
        self.keys_initializer = keras.initializers.get(
            keys_initializer
            or keras.initializers.RandomUniform(-1.0 / math.sqrt(half), 1.0 / math.sqrt(half))
        )
        self.values_initializer = (
            None if values_initializer is None else keras.initializers.get(values_initializer)
        )
        self.implementation = implementation
        self.fallback = fallback
        self.sparse_gradient = bool(sparse_gradient)
        self.fused_optimizer = bool(fused_optimizer)

        # Every sub-layer takes this layer's policy (saved in get_config's "dtype"), not the
        # global one: a reloaded model then computes what the saved one did.
        self.query_proj = _QueryProjection(heads * k_dim, name="query_proj", dtype=self.dtype_policy)
        self.query_bn = (
            keras.layers.BatchNormalization(name="query_bn", dtype=self.dtype_policy)
            if query_batchnorm
            else None
        )
        self.input_dropout_layer = keras.layers.Dropout(input_dropout, dtype=self.dtype_policy)
        self.query_dropout_layer = keras.layers.Dropout(query_dropout, dtype=self.dtype_policy)
        self.value_dropout_layer = keras.layers.Dropout(value_dropout, dtype=self.dtype_policy)
        self.memory = None  # the EmbeddingBag over n_keys**2 values; made in build()
        # A mask over the leading dims passes through; masked rows stay out of the query batch-norm moments.
        self.supports_masking = True
        self.input_spec = keras.layers.InputSpec(min_ndim=1)  # [..., d_model]: a scalar has no d_model

    def build(self, input_shape):
        if self.built:
            return
        d_model = input_shape[-1]
        if d_model is None:
            raise ValueError("ProductKeyMemory: the last input dimension (d_model) must be known")
        v_dim = self.v_dim or d_model
        self.query_proj.build(tuple(input_shape[:-1]) + (d_model,))
        if self.query_bn is not None:
            self.query_bn.build((None, self.heads * self.k_dim))
        self.keys = self.add_weight(
            shape=(self.heads, 2, self.n_keys, self.k_dim // 2),
            initializer=self.keys_initializer,
            name="keys",
            autocast=False,  # the search reads them in their stored dtype (select_slots)
        )
        with warnings.catch_warnings():
            # A fallback to the composite was already announced by __init__.
            warnings.simplefilter("ignore", RuntimeWarning)
            self.memory = self._make_memory(v_dim)
        self.memory.build()
        # Sub-layers are made trainable: a layer frozen before build (trainable=False in the
        # constructor or a reloaded config) freezes them, as Keras' setter does after build.
        if not self.trainable:
            for layer in self._layers:
                layer.trainable = False
        self.built = True

    def _make_memory(self, v_dim):
        return EmbeddingBag(
            self.n_keys * self.n_keys,
            v_dim,
            combiner="sum",
            embeddings_initializer=self.values_initializer
            or keras.initializers.RandomNormal(stddev=v_dim**-0.5),
            implementation=self.implementation,
            fallback=self.fallback,
            # Kept from a TF-saved config under JAX / PyTorch, where they change nothing.
            sparse_gradient=self.sparse_gradient and is_tensorflow_backend(),
            fused_optimizer=self.fused_optimizer and is_tensorflow_backend(),
            name="values",
            dtype=self.dtype_policy,
        )

    def call(self, inputs, training=None, mask=None):
        if not is_tensorflow_backend():
            return self._call_keras_ops(inputs, training, mask)
        refuse_tf_keras("ProductKeyMemory", inputs)
        import tensorflow as tf

        d_model = inputs.shape[-1]
        if d_model is None:  # e.g. an input_signature of [None, None]: the built width, checked when run
            d_model = self.query_proj.kernel.shape[0]
            check = tf.debugging.assert_equal(
                tf.shape(inputs)[-1], d_model,
                message=f"ProductKeyMemory: the last input dimension must be d_model = {d_model}, as built")
            with tf.control_dependencies([check]):
                inputs = tf.identity(inputs)
        leading_shape = tf.shape(inputs)[:-1]
        if mask is not None:
            mask = tf.reshape(tf.broadcast_to(mask, leading_shape), [-1])
        outputs = self._read_memory(tf.reshape(inputs, [-1, d_model]), training, mask)
        return tf.reshape(outputs, tf.concat([leading_shape, [self.memory.output_dim]], 0))

    def _call_keras_ops(self, inputs, training, mask):
        """call() under JAX / PyTorch, where shapes are static."""
        ops = keras.ops
        if mask is not None:
            mask = ops.reshape(ops.broadcast_to(mask, tuple(inputs.shape[:-1])), (-1,))
        outputs = self._read_memory(ops.reshape(inputs, (-1, inputs.shape[-1])), training, mask)
        return ops.reshape(outputs, tuple(inputs.shape[:-1]) + (self.memory.output_dim,))

    def _read_memory(self, x, training, mask=None):
        """[rows, d_model] -> [rows, output_dim]: the query, its slots and one weighted bag of
        values per row (heads * knn slots, weighted by their softmax score). mask [rows]: the
        rows the query batch-norm's training moments count."""
        x = self.input_dropout_layer(x, training=training)
        query = self.query_proj(x)
        if self.query_bn is not None:
            query = self._normalize_query(query, training, mask)
        query = self.query_dropout_layer(query, training=training)
        indices, scores = self.select_slots(query)
        return self.value_dropout_layer(self.memory(indices, weights=scores), training=training)

    def _normalize_query(self, query, training, mask):
        """The query batch-norm. A training batch whose every row is masked keeps the moving
        moments: Keras' masked moments divide by sum(mask) + epsilon, so they would decay
        towards 0 on such a batch."""
        bn = self.query_bn
        if not training or mask is None:
            return bn(query, training=training, mask=mask)
        ops = keras.ops
        moving = (bn.moving_mean, bn.moving_variance)
        before = [ops.copy(v.value) for v in moving]
        query = bn(query, training=training, mask=mask)
        any_row = ops.any(ops.cast(mask, "bool"))
        for v, old in zip(moving, before):
            v.assign(ops.where(any_row, v.value, old))
        return query

    def select_slots(self, query):
        """Product-key search: query [B, heads*k_dim] -> (slot indices int64
        (int32 under JAX/PyTorch when n_keys**2 fits) [B, heads*knn], softmax
        scores float32 [B, heads*knn])."""
        # Scores are ranked in float32 under mixed precision: 16-bit scores tie often and round
        # differently on each backend (a .keras file picked other slots in 20-30% of rows on JAX,
        # PyTorch and TF under mixed_bfloat16). Exact ties go to the lowest index everywhere.
        if keras.backend.standardize_dtype(query.dtype) in ("float16", "bfloat16"):
            query = keras.ops.cast(query, "float32")
        if not is_tensorflow_backend():
            from pkm_serve.backends.product_keys import product_key_search as keras_ops_search

            query = keras.ops.reshape(query, (query.shape[0], self.heads, 2, self.k_dim // 2))
            return keras_ops_search(query, self.keys.value, self.knn)
        import tensorflow as tf

        num_rows = tf.shape(query)[0]
        query = tf.reshape(query, [num_rows, self.heads, 2, self.k_dim // 2])
        return product_key_search(query, self.keys.value, self.knn)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.v_dim or input_shape[-1],)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "v_dim": self.v_dim,
                "k_dim": self.k_dim,
                "n_keys": self.n_keys,
                "heads": self.heads,
                "knn": self.knn,
                "query_batchnorm": self.query_batchnorm,
                "input_dropout": self.input_dropout,
                "query_dropout": self.query_dropout,
                "value_dropout": self.value_dropout,
                "keys_initializer": keras.initializers.serialize(self.keys_initializer),
                "values_initializer": None
                if self.values_initializer is None
                else keras.initializers.serialize(self.values_initializer),
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
