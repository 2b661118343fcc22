"""Checks of the layers under JAX / PyTorch / TensorFlow found in round 36, run inside one process with
KERAS_BACKEND set; test_backends_round36.py runs them. Each check raises AssertionError with a message
on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=torch python -m tests.backends.round36_checks python_list_ids
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.reference import bag_list, embedding_bag as reference_bag  # noqa: E402


def check_python_list_ids():
    """Ids as nested Python lists (as keras.layers.Embedding, Keras refuses them: its error says to pass
    them "as a keyword argument", and [] / [[]] failed with AttributeError "'list' object has no attribute
    'shape'") are a ValueError naming np.asarray; the array it names gives the float64 reference."""
    import keras

    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 4, combiner="mean")
    bag.build()
    table = keras.ops.convert_to_numpy(bag.embeddings)
    for listed in ([[1, 2], [3, 4]], [1, 2, 3], [], [[]], [[1, 2], [3]], ((1, 2), (3, -1))):
        try:
            bag(listed)
        except ValueError as err:
            assert "np.asarray" in str(err) and "Python" in str(err), str(err)
        else:
            raise AssertionError(f"Python ids {listed!r} were taken")
        try:
            keras.layers.Embedding(30, 4)(listed)
        except (ValueError, AttributeError):
            pass   # Keras' habit: its own layer refuses them too
        else:
            raise AssertionError(f"keras.layers.Embedding took {listed!r}: match it")
    for listed in ([[1, 2], [3, 4]], ((1, 2), (3, -1))):
        got = keras.ops.convert_to_numpy(bag(np.asarray(listed, "int32")))
        want = reference_bag(table, np.asarray(listed), combiner="mean")
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=repr(listed))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(bag(np.asarray([[]], "int32"))), np.zeros((1, 4)))
    padded = np.array([[1, 2], [3, -1]], "int32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bag(padded)),
                               bag_list(table, [[1, 2], [3]], combiner="mean"), rtol=1e-6)
    print(json.dumps({"python_list_ids": "ok"}))


CHECKS = {"python_list_ids": check_python_list_ids}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args, i = sys.argv[1:], 0
    while i < len(args):
        name = args[i]
        takes_path = CHECKS[name].__code__.co_argcount == 1
        CHECKS[name](*([args[i + 1]] if takes_path else []))
        i += 2 if takes_path else 1
