"""Checks of the layers under JAX / PyTorch (and TF where named) found in round 35, run inside one
process with KERAS_BACKEND set; test_backends_rounds.py runs them (run_checks.py). Each check raises AssertionError
with a message on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.round35_checks fixed_batch_export /tmp/out
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def check_fixed_batch_export(directory):
    """model.export() under JAX with a fixed-batch input_signature writes a SavedModel that TF runs
    with the model's outputs: the product-key search exported lax.top_k there (only a None batch
    sorted), whose CHLO composite TF 2.21's XlaCallModule failed to deserialise at the first call."""
    import keras
    import tensorflow as tf

    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(5)
    x = keras.Input((3, 16))
    model = keras.Model(x, ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3,
                                            implementation="composite")(x))
    features = np.random.default_rng(1).normal(size=(6, 3, 16)).astype("float32")
    want = keras.ops.convert_to_numpy(model(features))
    model.export(directory, format="tf_saved_model", verbose=False,
                 input_signature=[tf.TensorSpec((6, 3, 16), tf.float32)])
    loaded = tf.saved_model.load(directory)   # (kept: its functions need its variables)
    served = loaded.serve(tf.constant(features)).numpy()
    np.testing.assert_allclose(served, want, rtol=1e-5, atol=1e-6, err_msg="exported SavedModel vs the model")
    print(json.dumps({"fixed_batch_export": "ok"}))


def check_eager_jax2tf():
    """jax2tf.convert of the product-key search called eagerly (no tf.function), then the same converted
    function in a tf.function: both run in TF with JAX's slots. Eagerly jax2tf serialised lax.top_k,
    which TF's XlaCallModule failed to deserialise, and its trace stayed cached for the tf.function."""
    import keras
    import tensorflow as tf
    from jax.experimental import jax2tf

    from pkm_serve.backends.product_keys import product_key_search

    rng = np.random.default_rng(7)
    query, keys = rng.normal(size=(3, 2, 2, 4)).astype("float32"), rng.normal(size=(2, 2, 16, 4)).astype("float32")
    want = keras.ops.convert_to_numpy(product_key_search(query, keys, 3)[0])
    converted = jax2tf.convert(lambda q, k: product_key_search(q, k, 3)[0])
    for how, run in (("eager", converted), ("tf.function", tf.function(converted, autograph=False))):
        got = run(tf.constant(query), tf.constant(keys)).numpy()
        np.testing.assert_array_equal(got, want, err_msg=how)
    print(json.dumps({"eager_jax2tf": "ok"}))


def _signed_zero_inputs():
    """(query [2, 1, 2, 1], sub_keys [1, 2, 6, 1], knn): one-element halves, so each sub-key score is
    one product: 0.0 * +k is 0.0 and 0.0 * -k is -0.0, all tied."""
    query = np.zeros((2, 1, 2, 1), "float32")
    query[1, 0, 1] = 1.0   # row 1: its second half ranks by the keys themselves
    keys = np.array([1, -1, 1, -1, 2, -2], "float32").reshape(1, 1, 6, 1).repeat(2, axis=1)
    return query, keys, 2


def _lowest_slots(query, keys, knn):
    """float64 reference: each half's top knn, ties to the lowest index (-0.0 == 0.0), then the best
    knn pair sums, ties to the lowest slot; sorted slots per row."""
    n_keys, out = keys.shape[2], []
    for row in np.asarray(query, np.float64):
        s1, s2 = keys[0, 0] @ row[0, 0], keys[0, 1] @ row[0, 1]
        top1, top2 = np.argsort(-s1, kind="stable")[:knn], np.argsort(-s2, kind="stable")[:knn]
        pairs = sorted((-(s1[i] + s2[j]), i * n_keys + j) for i in top1 for j in top2)[:knn]
        out.append(sorted(int(slot) for _, slot in pairs))
    return out


def check_signed_zero_ties():
    """Scores tied at +0.0 / -0.0 pick the lowest slots eagerly, under jax.jit and in a jax.export of a
    symbolic batch (model.export's path), as the float64 reference and TF's kernel: JAX's eager top_k
    ranked 0.0 above -0.0 (slots 0, 2), while the exported sort tied them (slots 0, 1)."""
    import keras

    from pkm_serve.backends.product_keys import product_key_search

    query, keys, knn = _signed_zero_inputs()
    want = _lowest_slots(query, keys, knn)
    q, k = keras.ops.convert_to_tensor(query), keras.ops.convert_to_tensor(keys)
    got = {"eager": product_key_search(q, k, knn)[0]}
    if keras.backend.backend() == "jax":
        import jax
        from jax import export

        search = jax.jit(lambda a, b: product_key_search(a, b, knn)[0])
        got["jit"] = search(q, k)
        batch = export.symbolic_shape("b")[0]
        exported = export.export(search)(jax.ShapeDtypeStruct((batch, 1, 2, 1), "float32"),
                                         jax.ShapeDtypeStruct(keys.shape, "float32"))
        got["exported"] = exported.call(q, k)
    for how, slots in got.items():
        slots = np.sort(keras.ops.convert_to_numpy(slots), axis=-1).tolist()
        assert slots == want, f"{how}: slots {slots}, the lowest tied slots are {want}"
    print(json.dumps({"signed_zero_ties": "ok"}))


def check_listed_ids():
    """layer([ids, ids]) (two id tensors in a list) is a ValueError saying what the layer takes and to
    stack the ids (it spoke of weights the caller never meant); [ids, weights] still names
    layer(indices, weights)."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 8)
    row = np.array([1, 2, 3])
    cases = {"ids": ([row, row], [keras.Input((3,), dtype="int32"), keras.Input((3,), dtype="int32")],
                     (keras.ops.convert_to_tensor(row), keras.ops.convert_to_tensor(row))),
             "weights": ([row, row.astype("float32")], [keras.Input((3,), dtype="int32"), keras.Input((3,))])}
    for meant, listed in cases.items():
        for inputs in listed:
            try:
                bag(inputs)
            except ValueError as err:
                message = str(err)
            else:
                raise AssertionError(f"a {type(inputs).__name__} of {meant} was taken")
            assert "takes layer(indices) or layer(indices, weights)" in message, message
            named = "stack them into one tensor" if meant == "ids" else "pass per-index weights as the second"
            assert named in message and ("weights as the second" in message) == (meant == "weights"), message
    print(json.dumps({"listed_ids": "ok"}))


def check_unsigned_message():
    """A uint32 id past int32 into a model's EmbeddingBag fails naming the caller's value (under JAX
    without jax_enable_x64 the id was clipped to 2147483647, and the error named that); uint32 ids in
    range read the rows int32 ids read, in a model and jitted."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    def model():
        ids = keras.Input((3,), dtype="uint32")
        return keras.Model(ids, EmbeddingBag(10, 4, combiner="mean")(ids))

    good = np.array([[1, 9, 9], [0, 3, 5]], "uint32")
    first = model()
    np.testing.assert_array_equal(first.predict(good, verbose=0), first.predict(good.astype("int32"), verbose=0))
    if keras.backend.backend() == "jax":
        import jax

        bag = first.layers[-1]
        jitted = jax.jit(lambda ids: bag(ids))(keras.ops.convert_to_tensor(good))
        np.testing.assert_array_equal(np.asarray(jitted), first.predict(good.astype("int32"), verbose=0))
        mapped = jax.vmap(lambda ids: bag(ids))(keras.ops.convert_to_tensor(good[:, None]))   # (a select)
        np.testing.assert_array_equal(np.asarray(mapped)[:, 0], np.asarray(jitted))
    for past in (4294967295, 2147483648):
        try:
            got = model().predict(np.array([[1, 2, past]], "uint32"), verbose=0)
        except Exception as err:  # noqa: BLE001 - each backend's runtime error type
            message = str(err)
        else:
            raise AssertionError(f"uint32 id {past} into a 10-row table gave {got.tolist()}")
        assert f"indices[2] = {past} is out of range [0, 10)" in message, message
    print(json.dumps({"unsigned_message": "ok"}))


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        if name == "fixed_batch_export":
            CHECKS[name](args.pop(0))
        else:
            CHECKS[name]()
