"""Trains an EmbeddingBag (sparse_gradient=True) on 1 and on 2 logical CPU
replicas through a global batch that touches no row of the table (every bag
padding), after one that touched row 0, with each optimizer; saves the final
tables. Run as a script: logical devices must be set before TF initialises.

    python untouched_table_train.py OUT.npz fit-lazy_adam ragged-adam overflow-sgd ...

Two paths: "fit" (the lookup reads the variable in its kernel: the
PkmResourceEmbeddingBag gradient) and "ragged" (a custom loop on ragged bags:
the tf.custom_gradient path). Each replica's half of a batch touches its own
rows (0..24 and 25..49): stock optimizers' nonlinear steps on repeated rows
(README, "Repeated rows") then play no part, so all of them must match.
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

from pkm_serve.layers import EmbeddingBag  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

BATCH = 8
OPTIMIZERS = {"lazy_adam": lambda: LazyAdam(0.05), "rowwise_adagrad": lambda: RowwiseAdagrad(0.1),
              "sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.05),
              # Clipping makes the optimizer sum repeated rows before Keras clips. The clips bind (the
              # table gradient's norm is 1.2 .. 1.3 in the steps that touch rows, at the initial
              # weights): Keras clipped each replica's gradient before the all-reduce, and 2 replicas
              # trained otherwise than 1.
              "lazy_adam_clipnorm": lambda: LazyAdam(0.05, clipnorm=0.05),
              "lazy_adam_global_clipnorm": lambda: LazyAdam(0.05, global_clipnorm=0.05),
              # Keras' EMA overwrite (step 2 here) failed fit under any MirroredStrategy (a merge_call in a tf.cond).
              "lazy_adam_ema": lambda: LazyAdam(0.05, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)}


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 25, (3 * BATCH, 4))
    for start in range(BATCH // 2, 3 * BATCH, BATCH):
        x[start:start + BATCH // 2] += 25  # the second replica's half
    x[:BATCH // 2, 0] = 0  # step 1 touches row 0 (gives it moments)
    x[BATCH:2 * BATCH] = -1  # step 2: no replica touches a row
    return x, rng.standard_normal((3 * BATCH, 1)).astype(np.float32)


def build():
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int64")
    bag = EmbeddingBag(50, 8, sparse_gradient=True, name="bag")
    return keras.Model(ids, keras.layers.Dense(1, name="head")(bag(ids))), bag


def train_fit(strategy, make_optimizer, x, y):
    with strategy.scope():
        model, bag = build()
        model.compile(make_optimizer(), "mse")
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    return bag.embeddings.numpy()


def train_ragged(strategy, make_optimizer, x, y):
    with strategy.scope():
        model, bag = build()
        head = model.get_layer("head")
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))

    def replica_step(ids, target):
        with tf.GradientTape() as tape:
            out = head(bag(tf.RaggedTensor.from_tensor(ids, padding=-1)))
            loss = tf.reduce_sum(tf.square(out - target)) / BATCH
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def step(ids, target):
        strategy.run(replica_step, args=(ids, target))

    for ids, target in dataset:
        step(ids, target)
    return bag.embeddings.numpy()


def train_overflow(strategy, make_optimizer, x, y):
    """`fit` under mixed_float16 (a LossScaleOptimizer), the last step's targets overflowing the loss
    scale on the second replica's half alone: that step must be skipped on every replica, as on one."""
    y = y.copy()
    y[2 * BATCH + BATCH // 2:] = 3e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return train_fit(strategy, make_optimizer, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def main(out_path, keys):
    """Trains each case named "fit|ragged|overflow-optimizer" in `keys` on 1 and 2 replicas."""
    x, y = data()
    results = {}
    if not keys:
        raise SystemExit("name the cases to train: fit|ragged|overflow-OPTIMIZER ...")
    for key in keys:
        path, name = key.split("-")
        train = {"fit": train_fit, "ragged": train_ragged, "overflow": train_overflow}[path]  # KeyError: unknown
        make_optimizer = OPTIMIZERS[name]
        for which, devices in (("one", ["/cpu:0"]), ("two", ["/cpu:0", "/cpu:1"])):
            # Reduction through one device: several strategies in one process would
            # otherwise reuse the same collective instance keys.
            strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice())
            results[f"{key}/{which}"] = train(strategy, make_optimizer, x, y)
        if name.endswith("_ema"):  # also without a strategy: 1 and 2 replicas alike could skip the overwrite
            results[f"{key}/no_strategy"] = train(tf.distribute.get_strategy(), make_optimizer, x, y)
        results[f"{key}/init"] = build()[1].embeddings.numpy()
    np.savez(out_path, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
