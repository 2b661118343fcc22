"""Checks of the layers under JAX / PyTorch found in round 34, run inside one process with
KERAS_BACKEND set; test_backends_rounds.py runs them (run_checks.py). Each check raises AssertionError with a
message on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.round34_checks jax_export /tmp/out
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# PKM_TEST_DEVICE=cuda (the GPU machine's run): PyTorch tensors made here go to the device, and an
# id past the table reads as padding there (README "Limits": a kernel cannot raise from the device).
DEVICE = os.environ.get("PKM_TEST_DEVICE", "cpu")


def _composite_pkm_model():
    """A PKM over [batch, time, d_model] and a max bag, on the keras.ops composite (the README's way
    to export under JAX: our fused custom calls carry no serialisation guarantee)."""
    import keras

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(5)
    x, ids = keras.Input((None, 16)), keras.Input((4,), dtype="int32")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3, implementation="composite")(x)
    z = EmbeddingBag(30, 8, combiner="max", implementation="composite")(ids)
    pooled = keras.layers.GlobalAveragePooling1D()(y)
    return keras.Model([x, ids], keras.layers.Add()([pooled, z]))


def check_jax_export(directory):
    """model.export() under JAX (jax2tf, a polymorphic batch) writes a SavedModel that TF runs with
    the model's outputs: lax.top_k serialised as a CHLO composite that TF's XlaCallModule refused
    ("unregistered operation 'vhlo.composite_v2'") at the first call."""
    import keras

    model = _composite_pkm_model()
    rng = np.random.default_rng(11)
    inputs = [rng.normal(size=(6, 3, 16)).astype("float32"), rng.integers(-1, 30, size=(6, 4)).astype("int32")]
    want = keras.ops.convert_to_numpy(model(inputs))
    model.export(directory, format="tf_saved_model", verbose=False)
    import tensorflow as tf

    loaded = tf.saved_model.load(directory)
    served = loaded.serve([tf.constant(a) for a in inputs]).numpy()
    np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-6, err_msg="exported SavedModel vs the model")
    print(json.dumps({"jax_export": "ok"}))


def check_listed_inputs():
    """layer([ids, weights]), as Keras' multi-input layers take their inputs, is a ValueError naming
    layer(indices, weights), in a functional model and eagerly (it failed deep in Keras: "Cannot
    convert '8' to a shape", "'list' object has no attribute 'shape'")."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 8, combiner="mean")
    ids, weights = np.array([[1, 2, -1]], "int32"), np.array([[0.5, 2.0, 1.0]], "float32")
    symbolic = (keras.Input((3,), dtype="int32"), keras.Input((3,)))
    for listed in ([*symbolic], symbolic, [ids, weights], [keras.ops.convert_to_tensor(a) for a in (ids, weights)]):
        try:
            bag(listed)
        except ValueError as err:
            assert "layer(indices, weights)" in str(err), str(err)
        else:
            raise AssertionError(f"a {type(listed).__name__} of ids and weights was taken")
    got = keras.ops.convert_to_numpy(bag(ids, weights))[0]
    table = keras.ops.convert_to_numpy(bag.embeddings).astype(np.float64)
    np.testing.assert_allclose(got, (0.5 * table[1] + 2.0 * table[2]) / 2.5, rtol=1e-5)
    print(json.dumps({"listed_inputs": "ok"}))


def check_unsigned_ids():
    """uint32 ids in a model read the rows int32 ids read, and one past the table (4294967295) is the
    out-of-range error (under JAX it was cast to int32 -1: padding, no error)."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    ids = keras.Input((3,), dtype="uint32")
    model = keras.Model(ids, EmbeddingBag(10, 4, combiner="mean")(ids))
    good = np.array([[1, 9, 9], [0, 3, 5]], "uint32")
    np.testing.assert_array_equal(model.predict(good, verbose=0), model.predict(good.astype("int32"), verbose=0))
    past = np.array([[1, 2, 4294967295]], "uint32")
    if DEVICE == "cuda":  # padding there: the mean of rows 1 and 2 (it wrapped to -1, also padding)
        table = keras.ops.convert_to_numpy(model.layers[-1].embeddings).astype(np.float64)
        np.testing.assert_allclose(model.predict(past, verbose=0)[0], (table[1] + table[2]) / 2, rtol=1e-5)
        print(json.dumps({"unsigned_ids": "ok"}))
        return
    try:
        got = model.predict(past, verbose=0)
    except Exception as err:  # noqa: BLE001 - each backend's runtime error type
        assert "out of range" in str(err), str(err)
    else:
        raise AssertionError(f"uint32 id 4294967295 into a 10-row table gave {got.tolist()}")
    print(json.dumps({"unsigned_ids": "ok"}))


def check_tf_composite_ids():
    """A tf.RaggedTensor / tf.SparseTensor of ids under JAX or PyTorch is a ValueError naming the -1
    padding (Keras said "should be passed as a keyword argument"), and that padding gives each bag's
    sum of rows."""
    import keras
    import tensorflow as tf

    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(10, 4)
    ragged = tf.ragged.constant([[1, 2, 7], [3]])
    for ids, named in ((ragged, "to_tensor(default_value=-1)"), (ragged.to_sparse(), "to_dense(ids, -1)")):
        try:
            bag(ids)
        except ValueError as err:
            assert named in str(err), str(err)
        else:
            raise AssertionError(f"a {type(ids).__name__} of ids was taken")
    got = keras.ops.convert_to_numpy(bag(ragged.to_tensor(default_value=-1).numpy()))
    table = keras.ops.convert_to_numpy(bag.embeddings).astype(np.float64)
    np.testing.assert_allclose(got, [table[[1, 2, 7]].sum(0), table[3]], rtol=1e-5, atol=1e-7)
    print(json.dumps({"tf_composite_ids": "ok"}))


def _first_winner_gradient(table, ids, grad):
    """float64 d(sum(max_bag * grad))/d(table): each (bag, dim)'s grad to the first valid position
    holding the maximum (torch's mode="max", the kernels' contract)."""
    d_table = np.zeros(table.shape)
    for bag, row_ids in enumerate(ids):
        valid = [i for i in row_ids if i >= 0]
        for dim in range(table.shape[1]):
            if valid:
                values = [table[i, dim] for i in valid]
                d_table[valid[int(np.argmax(values))], dim] += grad[bag, dim]
    return d_table


def _max_gradient(lookup, table, ids, grad):
    import keras

    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        loss = lambda t: jnp.sum(lookup(t, jnp.asarray(ids), None, "max") * grad)  # noqa: E731
        return np.asarray(jax.grad(loss)(jnp.asarray(table)))
    import torch

    t = torch.tensor(table, requires_grad=True, device=DEVICE)
    (lookup(t, torch.tensor(ids, device=DEVICE), None, "max") * torch.tensor(grad, device=DEVICE)).sum().backward()
    return t.grad.cpu().numpy()


def check_max_ties():
    """The keras.ops composite's max gives each (bag, dim)'s gradient to the first row holding the
    maximum, as the fused kernel and torch do (it split it evenly over tied rows: a zero-initialised
    table trained differently under implementation="composite" or fallback="composite")."""
    from pkm_serve.backends import embedding_bag, embedding_bag_composite

    rng = np.random.default_rng(3)
    table = rng.integers(-2, 3, size=(12, 5)).astype("float32")  # small integers: many ties
    table[7] = 0.0
    ids = rng.integers(-1, 12, size=(9, 6)).astype("int32")
    ids[0] = [-1, 7, 4, 7, -1, 4]  # repeated ids, padding first
    ids[1] = -1  # an empty bag
    grad = rng.normal(size=(9, 5)).astype("float32")
    want = _first_winner_gradient(table, ids, grad)
    for lookup in (embedding_bag_composite, embedding_bag):
        np.testing.assert_allclose(_max_gradient(lookup, table, ids, grad), want, rtol=1e-6, atol=1e-6,
                                   err_msg=f"{lookup.__module__}.{lookup.__name__}")
    print(json.dumps({"max_ties": "ok"}))


def check_torch_export():
    """torch.export with a dynamic batch of a model holding a ProductKeyMemory and a composite max bag:
    the program runs other batch sizes with the model's outputs (Keras' take_along_axis fixed the
    batch size: "Constraints violated (b)! ... specialized it to be a constant")."""
    import keras
    import torch

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(5)
    x, ids = keras.Input((16,)), keras.Input((4,), dtype="int32")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3)(x)
    z = EmbeddingBag(30, 8, combiner="max", implementation="composite")(ids)
    model = keras.Model([x, ids], keras.layers.Add()([y, z]))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, features, bags):
            return self.model([features, bags])

    rng = np.random.default_rng(1)

    def batch(size):
        return (torch.tensor(rng.normal(size=(size, 16)).astype("float32"), device=DEVICE),
                torch.tensor(rng.integers(-1, 30, size=(size, 4)).astype("int32"), device=DEVICE))

    rows = torch.export.Dim("rows")
    program = torch.export.export(Wrapped(), batch(6), dynamic_shapes={"features": {0: rows}, "bags": {0: rows}})
    for size in (6, 9, 2):
        inputs = batch(size)
        np.testing.assert_allclose(program.module()(*inputs).detach().cpu().numpy(),
                                   model(list(inputs)).detach().cpu().numpy(), rtol=1e-6, atol=1e-7)
    print(json.dumps({"torch_export": "ok"}))


CHECKS = {"jax_export": check_jax_export, "max_ties": check_max_ties, "torch_export": check_torch_export, "tf_composite_ids": check_tf_composite_ids,
          "listed_inputs": check_listed_inputs, "unsigned_ids": check_unsigned_ids}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        if name == "jax_export":
            CHECKS[name](args.pop(0))
        else:
            CHECKS[name]()
