"""A synthetic task that needs memory: recall the value stored under a key.

`num_pairs` random keys (unit vectors in R^key_dim) each map to a random value
class in [0, num_values). Nothing about a key predicts its value, so a model
can only answer by storing the pairs. The PKM model stores them in its
n_keys^2 memory slots; the baseline replaces the memory by a feed-forward
block of the same width (what a PKM layer replaces in the paper). Both see
the same batches for the same number of steps.

Used by examples/train_pkm_recall.py and by the project demo:

    from pkm_serve.layers.recall_task import run_recall_comparison
    report = run_recall_comparison(steps=600)
"""
import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from pkm_serve.layers.product_key_memory import ProductKeyMemory


@dataclasses.dataclass
class RecallTask:
    keys: np.ndarray  # [num_pairs, key_dim] float32
    values: np.ndarray  # [num_pairs] int32
    num_values: int


@dataclasses.dataclass
class RecallConfig:
    num_pairs: int = 32768
    key_dim: int = 32
    num_values: int = 256
    d_model: int = 64
    n_keys: int = 128  # 16384 memory slots
    heads: int = 4
    knn: int = 16
    k_dim: int = 64
    batch_size: int = 256
    steps: int = 1500
    learning_rate: float = 3e-3
    seed: int = 0


def make_recall_task(num_pairs, key_dim, num_values, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((num_pairs, key_dim)).astype(np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    values = rng.integers(0, num_values, size=num_pairs).astype(np.int32)
    return RecallTask(keys=keys, values=values, num_values=num_values)


def build_pkm_model(config, implementation="fused", fallback=None):
    """key -> Dense(d_model) -> ProductKeyMemory(v_dim=d_model) -> softmax over values."""
    keys = keras.Input((config.key_dim,), name="key")
    hidden = keras.layers.Dense(config.d_model, name="embed_key")(keys)
    memory = ProductKeyMemory(
        v_dim=config.d_model,
        k_dim=config.k_dim,
        n_keys=config.n_keys,
        heads=config.heads,
        knn=config.knn,
        implementation=implementation,
        fallback=fallback,
        name="pkm",
    )(hidden)
    logits = keras.layers.Dense(config.num_values, name="logits")(hidden + memory)
    return keras.Model(keys, logits, name="pkm_recall")


def build_feedforward_model(config, hidden_units=None):
    """The same model with the memory replaced by Dense(hidden_units, relu) -> Dense(d_model).

    hidden_units defaults to 4 * d_model (the transformer FFN a PKM layer replaces)."""
    hidden_units = hidden_units or 4 * config.d_model
    keys = keras.Input((config.key_dim,), name="key")
    hidden = keras.layers.Dense(config.d_model, name="embed_key")(keys)
    ffn = keras.layers.Dense(hidden_units, activation="relu", name="ffn_in")(hidden)
    ffn = keras.layers.Dense(config.d_model, name="ffn_out")(ffn)
    logits = keras.layers.Dense(config.num_values, name="logits")(hidden + ffn)
    return keras.Model(keys, logits, name=f"ffn{hidden_units}_recall")


def parameter_matched_hidden_units(config):
    """Hidden width of a feed-forward block with as many parameters as the PKM layer."""
    memory = ProductKeyMemory(
        v_dim=config.d_model, k_dim=config.k_dim, n_keys=config.n_keys,
        heads=config.heads, knn=config.knn, implementation="composite",
    )
    memory.build((None, config.d_model))
    d = config.d_model
    # Dense(d -> H) + Dense(H -> d): H * (2d + 1) + d parameters.
    return max(1, round((memory.count_params() - d) / (2 * d + 1)))


def train_recall(model, task, config, log_every=100, log=print):
    """Adam on shuffled batches of the stored pairs; returns losses and accuracy.

    Loss and accuracy are measured over all stored pairs (the task is to
    recall them) before training and after the last step."""
    tf.random.set_seed(config.seed)
    optimizer = keras.optimizers.Adam(config.learning_rate)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(keys, values):
        with tf.GradientTape() as tape:
            loss = loss_fn(values, model(keys, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def evaluate():
        logits = model.predict(task.keys, batch_size=2048, verbose=0)
        loss = float(loss_fn(task.values, logits))
        accuracy = float(np.mean(np.argmax(logits, axis=1) == task.values))
        return loss, accuracy

    start_loss, start_accuracy = evaluate()
    rng = np.random.default_rng(config.seed + 1)
    num_pairs = task.keys.shape[0]
    order = rng.permutation(num_pairs)
    cursor = 0
    step_losses = []
    began = time.perf_counter()
    for step in range(1, config.steps + 1):
        if cursor + config.batch_size > num_pairs:
            order = rng.permutation(num_pairs)
            cursor = 0
        batch = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        loss = float(train_step(task.keys[batch], task.values[batch]))
        step_losses.append(loss)
        if log and (step % log_every == 0 or step == config.steps):
            log(f"  [{model.name}] step {step:5d}  batch loss {loss:.4f}")
    train_seconds = time.perf_counter() - began
    end_loss, end_accuracy = evaluate()
    return {
        "model": model.name,
        "params": int(model.count_params()),
        "steps": config.steps,
        "batch_size": config.batch_size,
        "start_loss": start_loss,
        "start_accuracy": start_accuracy,
        "end_loss": end_loss,
        "end_accuracy": end_accuracy,
        "train_seconds": train_seconds,
        "step_losses": step_losses,
    }


def run_recall_comparison(config=None, implementation="fused", fallback=None, baselines=(None,), log=print):
    """Trains the PKM model and feed-forward baselines on one task; returns their results.

    baselines lists the hidden widths of the feed-forward models (None = 4 * d_model)."""
    config = config or RecallConfig()
    task = make_recall_task(config.num_pairs, config.key_dim, config.num_values, config.seed)
    results = []
    keras.utils.set_random_seed(config.seed)
    results.append(train_recall(build_pkm_model(config, implementation, fallback), task, config, log=log))
    for hidden_units in baselines:
        keras.utils.set_random_seed(config.seed)
        model = build_feedforward_model(config, hidden_units)
        results.append(train_recall(model, task, config, log=log))
    return {"config": dataclasses.asdict(config), "results": results}
