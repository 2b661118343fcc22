"""Checks of EmbeddingBag's BCOO ids under JAX found reviewing round 36, run inside one process with
KERAS_BACKEND=jax; test_backends_review36.py runs them. Each check raises AssertionError with a message
on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=jax python -m tests.backends.review36_checks jax_sparse_bad_entries
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.reference import bag_list  # noqa: E402


def _refused(call, words):
    """Whether call() fails with an error naming `words` (under jax.jit the host callback's ValueError
    arrives inside JAX's runtime error)."""
    try:
        call()
    except Exception as err:   # noqa: BLE001  (ValueError eagerly, JaxRuntimeError under jit)
        assert words in str(err), f"{type(err).__name__}: {err}"
        return True
    return False


def check_jax_sparse_bad_entries():
    """BCOO ids with two entries at one position (each a bag member for TF's tf.SparseTensor) summed
    into one other id, and weights at other positions than the ids' were read as weight 0 under jit
    (model.predict), both silently: now an error naming the position, eagerly, under jax.jit and in
    predict; well-formed batches still give the float64 reference there."""
    import jax
    import keras
    from jax.experimental import sparse

    from pkm_serve.layers import EmbeddingBag

    def sparse_model():   # one per failing predict: Keras' JAX predict leaves its variables unset after an error
        ids_in, weights_in = keras.Input((4,), sparse=True, dtype="int32"), keras.Input((4,), sparse=True)
        bag = EmbeddingBag(10, 3, combiner="sum")
        return keras.Model([ids_in, weights_in], bag(ids_in, weights_in)), bag

    model, bag = sparse_model()
    table = keras.ops.convert_to_numpy(bag.embeddings)
    jitted = jax.jit(lambda i, w: bag(i, w))
    positions = np.array([[0, 0], [0, 1], [1, 0]])
    ids = sparse.BCOO((np.array([1, 2, 3], "int32"), positions), shape=(2, 4))
    scales = np.array([0.5, 2.0, 1.5], "float32")
    want = bag_list(table, [[1, 2], [3]], [scales[:2], scales[2:]], "sum")
    weights = sparse.BCOO((scales, positions), shape=(2, 4))
    for how, out in {"jit": jitted(ids, weights), "predict": model.predict([ids, weights], verbose=0)}.items():
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-7, err_msg=how)
    repeated = sparse.BCOO((np.array([3, 4, 5], "int32"), np.array([[0, 0], [0, 0], [1, 1]])), shape=(2, 4))
    ones = sparse.BCOO((np.ones(3, "float32"), repeated.indices), shape=(2, 4))
    missing = sparse.BCOO((np.array([0.5, 2.0], "float32"), positions[:2]), shape=(2, 4))
    for how, call in {"eager": lambda: bag(repeated, ones), "jit": lambda: jitted(repeated, ones),
                      "predict": lambda: sparse_model()[0].predict([repeated, ones], verbose=0)}.items():
        assert _refused(call, "2 entries at position [0, 0]"), f"{how}: repeated positions were taken"
    for how, call in {"jit": lambda: jitted(ids, missing),
                      "predict": lambda: sparse_model()[0].predict([ids, missing], verbose=0)}.items():
        assert _refused(call, "position [1, 0]: 0 weights"), f"{how}: weights missing an entry were taken"
    print(json.dumps({"jax_sparse_bad_entries": "ok"}))


CHECKS = {"jax_sparse_bad_entries": check_jax_sparse_bad_entries}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    for name in sys.argv[1:]:
        CHECKS[name]()
