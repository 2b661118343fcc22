"""Trains the same model with MirroredStrategy on 1 and on 2 logical CPU
replicas (same global batch, same initial weights) and saves the final
weights: run as a script, because the logical devices must be configured
before TensorFlow initialises (the test suite's process has already done so).

    python mirrored_train.py OUT.npz embedding_bag-dense-sgd pkm-sparse-lazy_adam ...
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from pkm_serve.layers import EmbeddingBag, ProductKeyMemory  # noqa: E402
from pkm_serve.optimizers import LazyAdam  # noqa: E402

GLOBAL_BATCH, STEPS = 32, 6


def build(kind, sparse):
    if kind == "embedding_bag":
        inp = keras.Input((5,), dtype="int64")
        x = EmbeddingBag(300, 16, combiner="mean", sparse_gradient=sparse, name="bag")(inp)
    else:
        inp = keras.Input((24,))
        # BatchNorm off: per-replica batch statistics would differ by design.
        x = ProductKeyMemory(v_dim=16, k_dim=8, n_keys=16, heads=2, knn=4, query_batchnorm=False,
                             sparse_gradient=sparse, name="pkm")(inp)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(x))


def data(kind, rng):
    if kind == "embedding_bag":
        x = rng.integers(-1, 300, size=(GLOBAL_BATCH * STEPS, 5))
    else:
        x = rng.standard_normal((GLOBAL_BATCH * STEPS, 24)).astype(np.float32)
    return x, rng.standard_normal((GLOBAL_BATCH * STEPS, 4)).astype(np.float32)


def train(kind, sparse, optimizer, devices, init, x, y):
    # Reduction through one device: several strategies in one process would
    # otherwise reuse the same collective instance keys.
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = build(kind, sparse)
        model.set_weights(init)
        opt = LazyAdam(0.01) if optimizer == "lazy_adam" else keras.optimizers.SGD(0.5)
        model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights(), tables_read_copy(model)


def tables_read_copy(model):
    """Per replica of each layer's table: whether a dense read copies it (copy-on-read mode)."""
    from tests.ops.test_copy_on_read import _reads_copy

    flags = []
    for variable in model.trainable_variables:
        if variable.path.endswith("embeddings"):
            table = variable.value
            flags += [_reads_copy(v) for v in getattr(table, "values", (table,))]
    return np.array(flags)


def main(out_path, keys):
    """Trains each case named "kind-dense|sparse-optimizer" in `keys` on 1 and 2 replicas."""
    # Fixed initial weights: the run is then bitwise repeatable here, so a
    # failure reproduces instead of depending on one random draw.
    keras.utils.set_random_seed(7)
    results = {}
    if not keys:
        raise SystemExit("name the cases to train: MODEL-GRADIENT-OPTIMIZER ...")
    for key in keys:
        kind, gradient, optimizer = key.split("-")
        if kind not in ("embedding_bag", "pkm") or gradient not in ("dense", "sparse") \
                or optimizer not in ("sgd", "lazy_adam"):
            raise SystemExit(f"unknown case {key!r}: embedding_bag|pkm-dense|sparse-sgd|lazy_adam")
        sparse = gradient == "sparse"
        rng = np.random.default_rng(7)
        init = build(kind, sparse).get_weights()
        x, y = data(kind, rng)
        one, one_copies = train(kind, sparse, optimizer, ["/cpu:0"], init, x, y)
        two, two_copies = train(kind, sparse, optimizer, ["/cpu:0", "/cpu:1"], init, x, y)
        results[f"{key}/reads_copy/one"] = one_copies
        results[f"{key}/reads_copy/two"] = two_copies
        for i, (a, b, w0) in enumerate(zip(one, two, init)):
            results[f"{key}/one/{i}"] = a
            results[f"{key}/two/{i}"] = b
            results[f"{key}/init/{i}"] = w0
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
