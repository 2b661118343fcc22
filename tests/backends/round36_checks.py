"""Checks of the layers under JAX / PyTorch / TensorFlow found in round 36, run inside one process with
KERAS_BACKEND set; test_backends_rounds.py runs them (run_checks.py). Each check raises AssertionError with a message
on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=torch python -m tests.backends.round36_checks python_list_ids
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.reference import bag_list, embedding_bag as reference_bag, ragged_embedding_bag  # noqa: E402


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


def check_torch_ragged_export():
    """torch.export of ragged bags (values [V], row_splits [B+1]) with both sizes dynamic, as README says:
    under torch.fx.experimental._config.patch(backed_size_oblivious=True) the program runs 0, 1 and more
    bags with the float64 reference's values (without it torch guards B+1 != 2 on any [B, D] tensor, its
    own torch.diff(row_splits) too, and suggests Dim(min=3): one bag failed)."""
    import torch

    from pkm_serve.backends import embedding_bag

    rng = np.random.default_rng(36)
    table = rng.normal(size=(20, 4)).astype("float32")
    weights_of = {}

    class Ragged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.tensor(table))

        def forward(self, values, row_splits, weights):
            return embedding_bag(self.table, values, weights, combiner="mean", row_splits=row_splits)

    def bags(splits):
        values = rng.integers(-1, 20, size=splits[-1])
        weights_of[tuple(splits)] = rng.uniform(0.5, 1.5, size=splits[-1]).astype("float32")
        return (torch.tensor(values), torch.tensor(splits, dtype=torch.int64),
                torch.tensor(weights_of[tuple(splits)]))

    values, bags_plus_one = torch.export.Dim("values"), torch.export.Dim("bags_plus_one")
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        program = torch.export.export(Ragged(), bags([0, 2, 5]), dynamic_shapes={
            "values": {0: values}, "row_splits": {0: bags_plus_one}, "weights": {0: values}})
    for splits in ([0, 1], [0, 3], [0, 0], [0], [0, 2, 2, 6], [0, 1, 2, 3, 4]):
        inputs = bags(splits)
        got = program.module()(*inputs).detach().numpy()
        want = ragged_embedding_bag(table, inputs[0].numpy(), splits, weights_of[tuple(splits)], "mean")
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"row_splits {splits}")
    print(json.dumps({"torch_ragged_export": "ok"}))


def check_jax_sparse_ids():
    """A model on keras.Input(sparse=True) ids and weights under JAX (BCOO batches): the entries present
    form each bag, an id 0 present included, as TF reads a tf.SparseTensor; model(x), predict and
    jax.jit match the float64 reference (the layer failed with "int() argument must be ... not 'BCOO'"),
    and weights at other positions are a ValueError."""
    import jax
    import keras
    from jax.experimental import sparse

    from pkm_serve.layers import EmbeddingBag

    ids, weights = keras.Input((4,), sparse=True, dtype="int32"), keras.Input((4,), sparse=True)
    bag = EmbeddingBag(10, 3, combiner="mean")
    model = keras.Model([ids, weights], bag(ids, weights))
    positions = np.array([[0, 0], [0, 1], [0, 2], [2, 0], [2, 1]])   # row 1 empty
    values = np.array([1, 0, 2, 0, 3], "int32")
    scales = np.random.default_rng(36).uniform(0.5, 1.5, size=5).astype("float32")
    sparse_ids = sparse.BCOO((values, positions), shape=(3, 4))
    sparse_weights = sparse.BCOO((scales, positions), shape=(3, 4))
    table = keras.ops.convert_to_numpy(bag.embeddings)
    want = bag_list(table, [[1, 0, 2], [], [0, 3]], [scales[:3], [], scales[3:]], "mean")
    got = {"model": model([sparse_ids, sparse_weights]),
           "predict": model.predict([sparse_ids, sparse_weights], verbose=0),
           "jit": jax.jit(lambda i, w: bag(i, w))(sparse_ids, sparse_weights)}
    for how, out in got.items():
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-7, err_msg=how)
    unweighted = bag_list(table, [[1, 0, 2], [], [0, 3]], None, "mean")
    np.testing.assert_allclose(np.asarray(bag(sparse_ids)), unweighted, rtol=1e-6, atol=1e-7)
    for unsigned in ("uint8", "uint32"):   # absent positions padded with -1 became the dtype's largest id
        unsigned_ids = sparse.BCOO((values.astype(unsigned), positions), shape=(3, 4))
        for how, lookup in {"eager": bag, "jit": jax.jit(lambda i: bag(i))}.items():
            np.testing.assert_allclose(np.asarray(lookup(unsigned_ids)), unweighted, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{unsigned} {how}")
    try:
        bag(sparse_ids, sparse.BCOO((scales[:4], positions[:4]), shape=(3, 4)))
    except ValueError as err:
        assert "each position" in str(err), str(err)
    else:
        raise AssertionError("sparse weights missing an entry were taken")
    print(json.dumps({"jax_sparse_ids": "ok"}))


def _refused(call, words):
    """Whether call() fails with an error naming `words` (under jax.jit the host callback's ValueError
    arrives inside JAX's runtime error, on a GPU when the result is read: dispatch is asynchronous)."""
    try:
        np.asarray(call())
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


CHECKS = {"python_list_ids": check_python_list_ids, "torch_ragged_export": check_torch_ragged_export,
          "jax_sparse_ids": check_jax_sparse_ids, "jax_sparse_bad_entries": check_jax_sparse_bad_entries}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args, i = sys.argv[1:], 0
    while i < len(args):
        name = args[i]
        takes_path = CHECKS[name].__code__.co_argcount == 1
        CHECKS[name](*([args[i + 1]] if takes_path else []))
        i += 2 if takes_path else 1
