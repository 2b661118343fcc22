"""Keras habits around the layers, checked inside one process with KERAS_BACKEND set (tensorflow,
jax or torch); test_keras_habits.py runs them under each backend. Each check raises
AssertionError with a message on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.keras_habit_checks table_dtype half_float_ids
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.reference import embedding_bag as reference_bag  # noqa: E402

N, D, K = 5000, 8, 16


def _bags(rng, rows=N, batch=6):
    ids = rng.integers(0, rows, size=(batch, K))
    ids[:, 0] = [257, 259, 2049, 4097, 2051, rows - 1][:batch]  # ids bfloat16 / float16 would round
    ids = np.minimum(ids, rows - 1)
    return ids.astype("int32"), rng.uniform(0.3, 1.7, size=(batch, K)).astype("float32")


def _numpy(x):
    import keras

    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")).astype(np.float64)


def _half_ulp(x, dtype):
    """Half the spacing of `dtype` (bfloat16 / float16) numbers around each value of x."""
    bits, min_exponent = {"bfloat16": (7, -126), "float16": (10, -14)}[dtype]  # stored significand bits
    return 0.5 * 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0**min_exponent))) - bits)


def check_table_dtype():
    """Under mixed_bfloat16 / mixed_float16 a direct call reads the float32 table, as the layer inside a
    model does: both give the float32 result rounded once to the compute dtype (the direct call
    read a bfloat16 copy of the whole table and rounded the weights: 2-3 ulps off, and off the model's)."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(3)
    table = rng.normal(size=(N, D)).astype("float32")
    for policy in ("mixed_bfloat16", "mixed_float16"):
        keras.config.set_dtype_policy(policy)
        ids, weights = _bags(rng)
        layer = EmbeddingBag(N, D)
        inputs = [keras.Input((K,), dtype="int32"), keras.Input((K,))]
        model = keras.Model(inputs, layer(inputs[0], weights=inputs[1]))
        layer.set_weights([table])
        direct, in_model = _numpy(layer(ids, weights=weights)), _numpy(model([ids, weights]))
        want = reference_bag(table, ids, weights)
        slack = 1e-6 * np.abs(want)  # float32 accumulation
        worst = np.max(np.abs(direct - want) - (_half_ulp(want, policy[6:]) + slack))
        assert worst <= 0, f"{policy}: a direct call is {worst:.3g} past half an ulp of the float64 reference"
        np.testing.assert_array_equal(direct, in_model, err_msg=f"{policy}: direct call vs the model")
    keras.config.set_dtype_policy("float32")
    print(json.dumps({"table_dtype": "ok"}))


class _Wrapped:
    """A subclassed Model around an EmbeddingBag (built lazily: Keras needs the backend imported)."""

    @staticmethod
    def make(rows):
        import keras

        from pkm_serve.layers import EmbeddingBag

        class BagModel(keras.Model):
            def __init__(self):
                super().__init__()
                self.bag = EmbeddingBag(rows, D)

            def call(self, ids):
                return self.bag(ids)

        return BagModel()


def check_half_float_ids():
    """Float ids reach the layer uncast (called directly, or through a float32 keras.Input), so they
    read the rows int ids read. A subclassed Model under a mixed policy casts float ids to its 16-bit
    compute dtype before the layer (as it would for keras.layers.Embedding): ids the 16-bit type cannot
    hold exactly for the table's size are a clear error (they read rounded rows: 257 -> 256), and a
    table small enough for them keeps working."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(4)
    table = rng.normal(size=(N, D)).astype("float32")
    for policy, exact_rows in (("mixed_bfloat16", 256), ("mixed_float16", 2048)):
        keras.config.set_dtype_policy(policy)
        ids, _ = _bags(rng)
        want = reference_bag(table, ids)
        tolerance = 4 * _half_ulp(want, policy[6:]) + 1e-6
        layer = EmbeddingBag(N, D)
        layer.build()
        layer.set_weights([table])
        float_ids = keras.Input((K,), dtype="float32")
        model = keras.Model(float_ids, layer(float_ids))
        for how, out in (("direct", layer(ids.astype("float32"))), ("functional", model(ids.astype("float32")))):
            assert np.all(np.abs(_numpy(out) - want) <= tolerance), f"{policy}: float ids, {how} call"
        wrapped = _Wrapped.make(N)
        wrapped(ids)  # int ids: not autocast, correct rows
        wrapped.bag.set_weights([table])
        assert np.all(np.abs(_numpy(wrapped(ids)) - want) <= tolerance), f"{policy}: int ids in a subclassed Model"
        try:
            got = _numpy(wrapped(ids.astype("float32")))
        except ValueError as err:
            assert "rounded" in str(err) and policy[6:] in str(err) and "integers" in str(err), err
        else:
            raise AssertionError(f"{policy}: float ids rounded to {policy[6:]} gave no error; rows off by "
                                 f"{np.max(np.abs(got - want)):.3g}")
        small = _Wrapped.make(exact_rows + 1)  # ids 0..exact_rows: every one held exactly
        small_ids = ids % (exact_rows + 1)
        small_ids[0, 0] = exact_rows
        small(small_ids)
        small.bag.set_weights([table[:exact_rows + 1]])
        np.testing.assert_allclose(_numpy(small(small_ids.astype("float32"))), _numpy(small(small_ids)),
                                   rtol=0, atol=0, err_msg=f"{policy}: a {exact_rows + 1}-row table, float ids")
    keras.config.set_dtype_policy("float32")
    print(json.dumps({"half_float_ids": "ok"}))


def check_mask():
    """A Keras mask over the leading dims of [batch, time, K] ids (keras.layers.Masking over padded
    time steps) passes on, so a following GlobalAveragePooling1D averages the real steps only (the
    mask was dropped: the padded steps, read as row 0 after Masking, were averaged in); a mask over
    the bag axis is a clear error (the ids it masks would be summed)."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(5)
    rows, steps = 30, 4
    table = rng.normal(size=(rows, D)).astype("float32")
    ids = rng.integers(0, rows, size=(3, steps, K)).astype("int32")
    ids[0, 2:], ids[1, 1:], ids[2, 1, 1] = -1, -1, -1  # padded steps; a padding id in a real step
    for weighted in (False, True):
        weights = rng.uniform(0.5, 1.5, size=ids.shape).astype("float32")
        inputs = [keras.Input((steps, K), dtype="int32"), keras.Input((steps, K))]
        bag = EmbeddingBag(rows, D)
        masked = keras.layers.Masking(mask_value=-1)(inputs[0])
        bags = bag(masked, weights=inputs[1]) if weighted else bag(masked)
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(bags))
        bag.set_weights([table])
        got = _numpy(model([ids, weights]))
        per_step = reference_bag(table, ids, weights if weighted else None)
        real = (ids >= 0).any(axis=-1)
        want = np.stack([per_step[b][real[b]].mean(axis=0) for b in range(len(ids))])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"weighted={weighted}")

    class BagAxisMask(keras.layers.Layer):
        def compute_mask(self, inputs, mask=None):
            return keras.ops.greater_equal(inputs, 0)

        def call(self, inputs):
            return inputs

    try:
        bags = EmbeddingBag(rows, D)(BagAxisMask()(keras.Input((steps, K), dtype="int32")))
    except ValueError as err:
        assert "mask" in str(err) and "negative" in str(err), err
    else:
        raise AssertionError(f"a mask over the bag axis was taken (output mask {getattr(bags, '_keras_mask', None)})")
    print(json.dumps({"mask": "ok"}))


def check_batch_axis():
    """keras.Input(shape=()) ids (one id per example, as keras.layers.Embedding takes them) have no bag
    axis: the bag was the whole batch, so the model gave one [D] output for all examples and fit
    trained it against every target by broadcasting; now a clear error. keras.Input((1,)) works."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(6)
    table = rng.normal(size=(20, D)).astype("float32")
    ids = rng.integers(0, 20, size=(5,)).astype("int32")
    try:
        scalar_ids = keras.Input((), dtype="int32")
        model = keras.Model(scalar_ids, EmbeddingBag(20, D)(scalar_ids))
    except ValueError as err:
        assert "batch axis" in str(err) and "keras.Input((1,))" in str(err), err
    else:
        raise AssertionError(f"ids without a bag axis built a model with output shape {model.output.shape}")
    bag = EmbeddingBag(20, D)
    one_id = keras.Input((1,), dtype="int32")
    model = keras.Model(one_id, bag(one_id))
    bag.set_weights([table])
    np.testing.assert_allclose(_numpy(model(ids[:, None])), table[ids], rtol=1e-6, atol=1e-6)
    print(json.dumps({"batch_axis": "ok"}))


def check_tied_table():
    """Under mixed_float16 a layer that ties its weights to the table (reads bag.embeddings in its
    call, e.g. output scores against the item table) reads it in its compute dtype, as it reads a
    keras.layers.Embedding's (the reference): float16, so that a matmul with its float16 inputs
    runs (with autocast=False on the variable it read float32: tf.matmul failed, keras.ops gave
    float32 scores)."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    class Tied(keras.layers.Layer):
        def __init__(self, source, **kwargs):
            super().__init__(**kwargs)
            self.source = source

        def call(self, x):
            return x, self.source.embeddings.value

    table = np.random.default_rng(7).normal(size=(20, D)).astype("float32")
    keras.config.set_dtype_policy("mixed_float16")
    bag, reference = EmbeddingBag(20, D), keras.layers.Embedding(20, D)
    ids = np.array([[1, 2], [3, 4]], "int32")
    hidden = bag(ids)
    reference(ids)
    bag.set_weights([table])
    reference.set_weights([table])
    (_, got), (_, want) = Tied(bag)(hidden), Tied(reference)(hidden)
    dtypes = [keras.backend.standardize_dtype(t.dtype) for t in (got, want)]
    assert dtypes == ["float16", "float16"], f"tied read as {dtypes[0]}, keras.layers.Embedding's as {dtypes[1]}"
    np.testing.assert_array_equal(_numpy(got), _numpy(want))
    keras.config.set_dtype_policy("float32")
    print(json.dumps({"tied_table": "ok"}))


def check_empty_bags():
    """Every bag empty: ids [B, 0] into an EmbeddingBag (fused and composite, every combiner), and under
    JAX / PyTorch the keras.ops composite on a [0, D] table of padding ids and on ragged bags with no
    values, give zeros [B, D] as the kernels do, with a zero gradient: the composite's max raised
    ("zero-size array to reduction operation max", "Cannot compute the max of an empty tensor"), and its
    gather from a [0, D] table raised too."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    for implementation in ("fused", "composite"):
        for combiner in ("sum", "mean", "sqrtn", "max"):
            bag = EmbeddingBag(7, 3, combiner=combiner, implementation=implementation)
            got = _numpy(bag(np.zeros((4, 0), "int32")))
            assert got.shape == (4, 3) and not got.any(), f"{implementation} {combiner}: {got}"
    if keras.backend.backend() == "tensorflow":
        print(json.dumps({"empty_bags": "ok"}))
        return
    from pkm_serve.backends import embedding_bag_composite

    tables = {"no rows": np.zeros((0, 3), "float32"), "rows": np.ones((5, 3), "float32")}
    cases = [("no rows", -np.ones((2, 4), "int32"), None, (2, 3)),
             ("rows", np.zeros((0,), "int32"), np.array([0, 0, 0], "int32"), (2, 3)),
             ("rows", np.zeros((0,), "int32"), np.array([0], "int32"), (0, 3))]
    for table_name, ids, splits, shape in cases:
        for combiner in ("sum", "mean", "sqrtn", "max"):
            got, grad = _composite_with_gradient(embedding_bag_composite, tables[table_name], ids, splits, combiner)
            assert got.shape == shape and not got.any(), f"{table_name} {splits} {combiner}: {got}"
            assert grad.shape == tables[table_name].shape and not grad.any(), f"{table_name} {combiner}: {grad}"
    print(json.dumps({"empty_bags": "ok"}))


def _composite_with_gradient(composite, table, ids, splits, combiner):
    """(the composite's output, d sum(output) / d table) as numpy, under JAX or PyTorch."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        out, pullback = jax.vjp(lambda t: composite(t, ids, None, combiner, splits), table)
        return np.asarray(out), np.asarray(pullback(jax.numpy.ones_like(out))[0])
    import torch

    t = torch.tensor(table, requires_grad=True)
    out = composite(t, torch.tensor(ids), None, combiner, None if splits is None else torch.tensor(splits))
    out.sum().backward()
    return out.detach().numpy(), t.grad.numpy()


def check_unrepresentable_ids():
    """Float ids that are NaN, +inf or past int64 (and, on TF, uint64 ids past int64) are an error, in a
    direct call, in a model and traced, as any id past the table is: cast to an integer they became its
    smallest value, padding without an error (TF, PyTorch), or NaN became 0 and read row 0 (JAX). A finite
    float id still reads its row."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(7)
    table = rng.normal(size=(20, D)).astype("float32")
    bag = EmbeddingBag(20, D)
    float_ids = keras.Input((2,), dtype="float32")
    model = keras.Model(float_ids, bag(float_ids))
    bag.set_weights([table])
    bad = [np.array([[value, 3.0]], "float32") for value in (np.nan, np.inf, 2.0**64)]
    if keras.backend.backend() == "tensorflow":   # (Keras' PyTorch and JAX arrays refuse numpy uint64 ids)
        bad.append(np.array([[2**63 + 5, 3]], "uint64"))
    calls = (("the layer", bag), ("a model", model), ("a traced call", _traced(bag)))
    for ids in bad:
        for name, call in calls:
            try:
                got = _numpy(call(ids))
            except Exception as err:   # (TF's InvalidArgumentError, JAX's runtime error, a ValueError)
                assert "out of range" in str(err) or "past int32" in str(err), err
            else:
                raise AssertionError(f"{name} read ids {ids.tolist()} as {got.tolist()}, without an error")
    np.testing.assert_allclose(_numpy(model(np.array([[4.0, -1.0]], "float32"))), table[[4]], rtol=1e-6)
    print(json.dumps({"unrepresentable_ids": "ok"}))


def _traced(layer):
    """layer's call as a traced graph: tf.function on TF (Grappler rewrites ~(x < c) as x >= c, false for
    NaN), jax.jit on JAX; PyTorch's eager call (torch.compile's first compile takes seconds)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(layer)
    if keras.backend.backend() == "jax":
        import jax

        stateless = jax.jit(lambda values, ids: layer.stateless_call(values, [], ids)[0])
        return lambda ids: stateless([v.value for v in layer.trainable_variables], ids)
    return layer


def check_one_slot_memory():
    """A ProductKeyMemory of knn=1 reads its best slot with weight 1, without Keras' warning about a
    softmax over an axis of size 1 ("Did you mean to use a sigmoid instead?"), which JAX and PyTorch
    printed at every call."""
    import warnings

    import keras

    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(8)
    layer = ProductKeyMemory(v_dim=D, k_dim=4, n_keys=5, heads=2, knn=1, query_batchnorm=False)
    x = np.random.default_rng(8).normal(size=(3, 6)).astype("float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _numpy(layer(x))
    assert not [w for w in caught if "softmax" in str(w.message)], [str(w.message) for w in caught]
    query = _numpy(layer.query_proj(x)).reshape(3, 2, 2, 2)   # [rows, heads, halves, k_dim / 2]
    keys, values = _numpy(layer.keys), _numpy(layer.memory.embeddings)
    scores = np.einsum("rhsd,hsnd->rhsn", query, keys)
    slots = scores[:, :, 0].argmax(-1) * 5 + scores[:, :, 1].argmax(-1)   # [rows, heads]
    np.testing.assert_allclose(got, values[slots].sum(axis=1), rtol=1e-5, atol=1e-6)
    print(json.dumps({"one_slot_memory": "ok"}))


CHECKS = {"table_dtype": check_table_dtype, "half_float_ids": check_half_float_ids, "mask": check_mask,
          "batch_axis": check_batch_axis, "tied_table": check_tied_table, "empty_bags": check_empty_bags,
          "unrepresentable_ids": check_unrepresentable_ids, "one_slot_memory": check_one_slot_memory}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    for name in sys.argv[1:]:
        CHECKS[name]()
