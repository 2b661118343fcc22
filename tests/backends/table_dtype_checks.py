"""Run with KERAS_BACKEND set (tests/backends/test_table_dtypes.py): builds the layers with float64
tables in the ways a user asks for them and prints one JSON line: each way's outcome (the error
type and message, or the output dtype and its largest error against float64 numpy)."""

import json

import keras
import numpy as np

from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

RNG = np.random.default_rng(0)
IDS = RNG.integers(-1, 20, (4, 3))
WEIGHTS = RNG.uniform(0.5, 1.5, (4, 3))


def bag_error(layer):
    out = layer(IDS, WEIGHTS)
    table = keras.ops.convert_to_numpy(layer.embeddings).astype(np.float64)
    want = np.einsum("bk,bkd->bd", np.where(IDS >= 0, WEIGHTS, 0.0), table[np.maximum(IDS, 0)])
    return keras.backend.standardize_dtype(out.dtype), float(np.abs(keras.ops.convert_to_numpy(out) - want).max())


def under_policy(policy, make):
    keras.config.set_dtype_policy(policy)
    try:
        return make()
    finally:
        keras.config.set_dtype_policy("float32")


WAYS = {
    "EmbeddingBag(dtype=float64)": lambda: bag_error(EmbeddingBag(20, 4, dtype="float64")),
    "EmbeddingBag(dtype=float64, composite)": lambda: bag_error(
        EmbeddingBag(20, 4, dtype="float64", implementation="composite")),
    "EmbeddingBag under a float64 policy": lambda: under_policy("float64", lambda: bag_error(EmbeddingBag(20, 4))),
    "ProductKeyMemory under a float64 policy": lambda: under_policy(
        "float64", lambda: ProductKeyMemory(8, k_dim=8, n_keys=4, heads=2, knn=2)(RNG.standard_normal((2, 8))).dtype),
    "float32 EmbeddingBag, float64 weights": lambda: bag_error(EmbeddingBag(20, 4)),
}


def outcome(way):
    try:
        result = way()
    except Exception as err:  # the outcome itself is what the test compares across backends
        return [type(err).__name__, str(err)]
    if isinstance(result, tuple):
        return ["ok", result[0], result[1] < 1e-5]
    return ["ok", keras.backend.standardize_dtype(result)]


if __name__ == "__main__":
    print(json.dumps({"outcomes": {name: outcome(way) for name, way in WAYS.items()}}))
