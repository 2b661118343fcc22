"""Checks of the layers under JAX / PyTorch found in round 34, run inside one process with
KERAS_BACKEND set; test_backends_round34.py runs them. Each check raises AssertionError with a
message on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.round34_checks jax_export /tmp/out
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


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


CHECKS = {"jax_export": check_jax_export}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        if name == "jax_export":
            CHECKS[name](args.pop(0))
        else:
            CHECKS[name]()
