"""Checks of round 35's review under JAX, run inside one process with KERAS_BACKEND set;
test_backends_review35.py runs them. Each check raises AssertionError with a message on failure and
prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.review35_checks jit_then_jax2tf /tmp/out
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def check_jit_then_jax2tf(directory):
    """A jitted product-key search called once (a test call), then converted with jax2tf into a
    SavedModel: TF runs it with the slots JAX gave. The search chose lax.top_k or a sort when traced,
    and jax.jit's cache handed the export the trace of the first call: lax.top_k, which TF 2.21's
    XlaCallModule failed to deserialise ('vhlo.composite_v2'). Executed, the search keeps lax.top_k."""
    import jax
    import tensorflow as tf
    from jax.experimental import jax2tf

    from pkm_serve.backends.product_keys import product_key_search

    rng = np.random.default_rng(7)
    query, keys = rng.normal(size=(3, 2, 2, 4)).astype("float32"), rng.normal(size=(2, 2, 16, 4)).astype("float32")
    search = jax.jit(lambda q, k: product_key_search(q, k, 3)[0])
    want = np.asarray(search(query, keys))
    assert "chlo.top_k" in search.lower(query, keys).as_text(), "the executed search no longer uses lax.top_k"
    module = tf.Module()
    module.search = tf.function(jax2tf.convert(search), autograph=False, input_signature=[
        tf.TensorSpec(query.shape, tf.float32), tf.TensorSpec(keys.shape, tf.float32)])
    tf.saved_model.save(module, directory)
    got = tf.saved_model.load(directory).search(tf.constant(query), tf.constant(keys)).numpy()
    np.testing.assert_array_equal(got, want)
    print(json.dumps({"jit_then_jax2tf": "ok"}))


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        if name == "jit_then_jax2tf":
            CHECKS[name](args.pop(0))
        else:
            CHECKS[name]()
