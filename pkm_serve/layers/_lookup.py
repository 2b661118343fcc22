"""Chooses the bag-lookup function a layer calls: the fused op or the composite,
for the Keras backend in use (TF: pkm_serve.ops; JAX, PyTorch: pkm_serve.backends)."""
import operator
import sys
import warnings

import keras
import numpy as np

IMPLEMENTATIONS = ("fused", "composite")
FALLBACKS = (None, "composite")


class OpLibraryUnavailableError(RuntimeError):
    """The fused op library could not be loaded and no fallback was asked for."""


def require_positive_ints(layer_name, **values):
    """The values as Python ints, in order; ValueError naming the first that is not a positive
    integer (bools are not; numpy integers are, as Keras' own layers take them)."""
    ints = []
    for arg_name, value in values.items():
        try:
            number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
        except TypeError:
            number = None
        if number is None or number <= 0:
            raise ValueError(f"{layer_name}: {arg_name} must be a positive integer, got {value!r}")
        ints.append(int(number))
    return tuple(ints)


def refuse_tf_keras(layer_name, inputs):
    """TypeError when the layer is called on tf_keras (Keras 2) tensors or from a tf_keras layer's call:
    tf_keras would wrap its TF ops in TFOpLambda layers with the weights as untracked constants."""
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is None:
        return
    legacy_input = any(type(x).__module__.startswith("tf_keras.") for x in keras.tree.flatten(inputs))
    frame, depth = sys._getframe(1), 0
    while frame is not None and depth < 24 and not legacy_input:
        legacy_input = isinstance(frame.f_locals.get("self"), tf_keras.layers.Layer)
        frame, depth = frame.f_back, depth + 1
    if legacy_input:
        raise TypeError(
            f"{layer_name} is a Keras 3 layer and cannot be used with tf_keras (Keras 2, e.g. tf.keras under "
            "TF_USE_LEGACY_KERAS=1): a tf_keras model would not track or train its weights. Build the model "
            "with Keras 3 (`import keras`, TF_USE_LEGACY_KERAS unset).")


def refuse_tf_training_options(layer_name, sparse_gradient, fused_optimizer):
    """ValueError for options that only change TF training, asked for under JAX or PyTorch."""
    if is_tensorflow_backend():
        return
    backend = keras.backend.backend()
    if sparse_gradient:
        raise ValueError(
            f"{layer_name}: sparse_gradient=True needs the TensorFlow backend (its gradient is a "
            f"tf.IndexedSlices); under {backend!r} the table's gradient is dense")
    if fused_optimizer:
        raise ValueError(
            f"{layer_name}: fused_optimizer=True needs the TensorFlow backend (pkm_serve.optimizers' LazyAdam "
            f"and RowwiseAdagrad apply it in TF's backward pass); under {backend!r} drop it: the table gets "
            "a dense gradient that any Keras optimizer applies")


TABLE_DTYPE_NAMES = ("float32", "float16", "bfloat16")


def refuse_table_dtype(layer_name, dtype_policy):
    """TypeError at construction for a table dtype the lookup does not take (float64), on every
    backend alike: TensorFlow and PyTorch refused it at the first call, JAX without jax_enable_x64
    computed in float32 while the layer said float64, and the composite on PyTorch accumulated a
    float64 table in float32."""
    stored = dtype_policy.variable_dtype
    if stored not in TABLE_DTYPE_NAMES:
        raise TypeError(f"{layer_name}: the table would be stored as {stored} (dtype policy "
                        f"{dtype_policy.name!r}); the layers take float32, float16 or bfloat16 tables "
                        "(the lookup accumulates in float32) on every backend: build the layer with "
                        "dtype='float32' (or a mixed_* policy) and cast its output where a float64 model "
                        "needs it")


def jax_wraps_64_bit_ids():
    """True under the JAX backend without jax_enable_x64, where int64 arrays become int32:
    an id past 2**31 wraps (2**32 + 1 read row 1; 2**31 became padding) without an error."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return not jax.config.jax_enable_x64


_X64_HINT = "enable jax_enable_x64 (jax.config.update('jax_enable_x64', True)) before building the model"


def refuse_rows_past_int32(layer_name, rows):
    """ValueError at construction for a table whose rows int32 ids cannot all address."""
    if rows >= 2**31 and jax_wraps_64_bit_ids():
        raise ValueError(f"{layer_name}: a table of {rows} rows needs int64 ids, which JAX without "
                         f"jax_enable_x64 wraps into int32 (reading other rows): {_X64_HINT}")


def refuse_ids_past_int32(layer_name, indices):
    """ValueError for host ids (numpy, lists, other frameworks' tensors) past int32, checked before
    Keras converts them (Layer.__call__ turns them into JAX arrays, wrapping them, before call()).
    Ids that are JAX arrays already were converted by the caller (jax.jit's arguments, Model.fit's
    batches): those are int32 and cannot be checked here."""
    if indices is None or not jax_wraps_64_bit_ids() or keras.ops.is_tensor(indices) \
            or keras.backend.is_keras_tensor(indices):
        return
    if not isinstance(indices, (list, tuple)) and not hasattr(indices, "__array__"):
        return
    try:
        ids = np.asarray(indices)
    except ValueError:  # a ragged list: Keras' own conversion names the problem
        return
    if ids.dtype.kind in "iuf" and ids.size and (ids.min() < -2**31 or ids.max() >= 2**31):
        raise ValueError(f"{layer_name}: indices hold values past int32 ({ids.min()} .. {ids.max()}), which "
                         f"JAX without jax_enable_x64 wraps around (reading other rows): {_X64_HINT}")


def refuse_unsigned_ids_past(layer_name, indices, target, rows):
    """indices (unsigned JAX ids, some maybe past `target`'s range), with a check where the fused
    kernel runs on the CPU: an id past `target` fails naming the caller's value, in the kernel's words.
    The layer clips such ids to target's largest value to keep them out of range, and the kernel then
    named that value (2147483647 for uint32 4294967295 without jax_enable_x64). The check calls back to
    the host only for a batch that holds such an id (under jax.vmap, where the cond is a select, once
    every call); elsewhere (CUDA: padding, an export: no host callbacks, several devices: see below)
    the ids pass unchanged."""
    from pkm_serve import backends
    from pkm_serve.backends.product_keys import _under_jax_export

    if keras.backend.backend() != "jax" or backends.kernel_device() != "cpu" or _under_jax_export(indices):
        return indices
    import jax
    import jax.numpy as jnp

    if jax.device_count() > 1:
        # Ids sharded over devices: the callback's error on one device leaves the others in a collective,
        # and XLA aborts the process (its rendezvous timeout); the kernel names the clipped id instead.
        return indices

    limit = np.iinfo(target).max

    def refuse(ids):   # (any shape: under vmap it gets the whole batch, the cond there a select)
        flat = np.asarray(ids).reshape(-1)
        if not np.any(flat > limit):
            return np.asarray(ids)
        position = int(np.argmax(flat > limit))
        raise ValueError(f"{layer_name}: indices[{position}] = {flat[position]} is out of range [0, {rows}) "
                         "(negative indices are padding)")

    def host_check(ids):
        return jax.pure_callback(refuse, jax.ShapeDtypeStruct(ids.shape, ids.dtype), ids,
                                 vmap_method="expand_dims")   # one call per batch ("sequential": per row)
    return jax.lax.cond(jnp.any(indices > limit), host_check, lambda ids: ids, indices)


def clip_unsigned_ids(layer_name, indices, target, rows):
    """Unsigned ids with those past `target`'s range clipped to its largest value (past the table:
    an out-of-range error, not padding). Under PyTorch keras.ops.minimum first cast uint64 ids to
    int64, so ids >= 2**63 wrapped negative and were read as padding, without an error: there the
    bits are read as int64 and an eager call with such an id fails naming the caller's value."""
    limit = np.iinfo(target).max
    if keras.backend.backend() != "torch" or keras.backend.standardize_dtype(indices.dtype) != "uint64":
        return keras.ops.minimum(indices, limit)
    import torch

    signed = indices.view(torch.int64)
    past = signed < 0  # the uint64 values >= 2**63
    if not torch.compiler.is_compiling() and bool(past.any()):
        position = int(torch.nonzero(past.reshape(-1))[0])
        value = int(signed.reshape(-1)[position]) + 2**64
        raise ValueError(f"{layer_name}: indices[{position}] = {value} is out of range [0, {rows}) "
                         "(negative indices are padding)")
    return torch.where(past, limit, signed)


# The largest id a 16-bit float holds with every integer below it: 2 ** (significand bits).
_LARGEST_EXACT_HALF_FLOAT_ID = {"bfloat16": 2**8, "float16": 2**11}


def refuse_rounded_half_float_ids(layer_name, dtype, rows):
    """ValueError for float16 / bfloat16 ids into a table with rows they cannot all hold exactly:
    such ids were rounded before the layer saw them (257 -> 256 in bfloat16), usually by an
    enclosing layer or subclassed Model that autocasts float inputs under a mixed policy."""
    limit = _LARGEST_EXACT_HALF_FLOAT_ID.get(keras.backend.standardize_dtype(dtype))
    if limit is not None and rows - 1 > limit:
        raise ValueError(
            f"{layer_name}: indices arrived as {keras.backend.standardize_dtype(dtype)}, which holds integers "
            f"exactly only up to {limit}, but the table has {rows} rows: larger ids were rounded (257 -> 256 "
            "in bfloat16) before this layer. Under a mixed precision policy an enclosing layer or subclassed "
            "Model casts float inputs to its compute dtype: pass the ids as integers (int32/int64 arrays, "
            "keras.Input(dtype='int32')).")


TF_TRAINING_OPTIONS = ("sparse_gradient", "fused_optimizer")


def from_config_keeping_tf_training_options(from_config, config):
    """`from_config(config)`; under JAX / PyTorch a config saved under TF may ask for the TF-only
    training options: the layer is made without them (inference and dense-gradient training are the
    same) and keeps their values, so that its config saves them again."""
    if is_tensorflow_backend():
        return from_config(config)
    kept = {name: bool(config.get(name, False)) for name in TF_TRAINING_OPTIONS}
    layer = from_config(dict(config, **dict.fromkeys(TF_TRAINING_OPTIONS, False)))
    for name, value in kept.items():
        setattr(layer, name, value)
    return layer


def is_tensorflow_backend():
    return keras.backend.backend() == "tensorflow"


def _ops_module():
    # Imported lazily so that building a layer config never loads TF ops.
    from pkm_serve import ops

    return ops


def resolve_lookup(implementation, fallback, layer_name):
    """Returns embedding_bag(params, indices, weights, combiner) to use.

    implementation="fused" needs the op library; when it does not load, the
    composite (gather * w -> reduce) is used only if fallback="composite".
    implementation="composite" always uses the composite (stock TF ops only,
    e.g. for runtimes without the custom op).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{layer_name}: implementation must be one of {IMPLEMENTATIONS}, "
            f"got {implementation!r}"
        )
    if fallback not in FALLBACKS:
        raise ValueError(
            f"{layer_name}: fallback must be None or 'composite', got {fallback!r}"
        )
    if not is_tensorflow_backend():
        return _resolve_native_lookup(implementation, fallback, layer_name)
    ops = _ops_module()
    if implementation == "composite":
        return ops.embedding_bag_composite
    try:
        ops.load_library()
    except Exception as err:  # any load failure means the fused op is unusable
        if fallback == "composite":
            warnings.warn(
                f"{layer_name}: the fused op library did not load ({err}); using the "
                "composite gather-multiply-reduce implementation (slower, "
                "materialises a [..., K, D] buffer).",
                RuntimeWarning,
                stacklevel=3,
            )
            return ops.embedding_bag_composite
        raise OpLibraryUnavailableError(
            f"{layer_name}: the fused PkmEmbeddingBag op library could not be loaded "
            f"({err}). Build it with `make build` (it produces "
            "pkm_serve/lib/_pkm_ops.so), or pass fallback='composite' to run the "
            "slower pure-TensorFlow composite instead."
        ) from err
    return ops.embedding_bag


def _resolve_native_lookup(implementation, fallback, layer_name):
    """resolve_lookup under JAX / PyTorch: the backend's kernels (pkm_serve.backends)."""
    from pkm_serve import backends

    def composite(params, indices, weights, combiner, sparse_gradient=False):
        return backends.embedding_bag_composite(params, indices, weights, combiner)

    def fused(params, indices, weights, combiner, sparse_gradient=False):
        return backends.embedding_bag(params, indices, weights, combiner)

    if implementation == "composite":
        return composite
    backend = keras.backend.backend()
    try:
        device = backends.kernel_device()
    except ImportError as err:  # the backend's module or library does not import
        device, reason = None, err
    else:
        reason = None if device else backends.backend_module().unavailable_reason()
    if device is not None:
        return fused
    if fallback == "composite":
        warnings.warn(
            f"{layer_name}: no fused kernel for the Keras {backend} backend's device ({reason}); using "
            "the composite gather-multiply-reduce implementation (slower, materialises a [..., K, D] "
            "buffer).", RuntimeWarning, stacklevel=4)
        return composite
    raise OpLibraryUnavailableError(
        f"{layer_name}: no fused kernel for the Keras {backend} backend's device ({reason}). Build the "
        "native libraries (`make build`; `make gpu` for CUDA), or pass fallback='composite' to run "
        "the slower keras.ops composite instead.")


def lookup_supports_jit(lookup):
    """A layer's `supports_jit` for the lookup `resolve_lookup` chose.

    True when XLA compilation on this machine keeps the lookup's memory and
    speed: the composite (stock ops), or the fused op where the op library
    has an XLA custom-call target for the device Keras compiles for (a
    non-CPU device when TF sees one, as Keras' jit_compile="auto" assumes).
    Otherwise False, so "auto" runs the fused op outside XLA; an explicit
    jit_compile=True still works, through the composite (ops.embedding_bag
    warns once).
    """
    if not is_tensorflow_backend():
        return True  # jax.jit traces the FFI calls; torch.compile the op's fake kernel
    ops = _ops_module()
    if lookup is ops.embedding_bag_composite:
        return True
    import tensorflow as tf

    from pkm_serve import _xla

    accelerators = {d.device_type for d in tf.config.list_physical_devices() if d.device_type != "CPU"}
    wanted = accelerators or {"CPU"}
    return wanted <= _xla.xla_device_types()
