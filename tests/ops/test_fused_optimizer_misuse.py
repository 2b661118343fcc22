"""fused_optimizer=True where the backward's in-place update cannot honour what the user asked for:
a tape outside a tf.cond / tf.map_fn that calls the layer (TF failed with an internal "Taking gradient
of a while loop which creates a resource"), and a gradient clipped (tf.clip_by_global_norm) after the
backward had applied the unclipped update (silently wrong numbers before). Each is a clear ValueError
now; a tape inside the loop (fit's steps_per_execution) still trains like the unfused sparse path."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.layers import EmbeddingBag  # noqa: E402
from pkm_serve.optimizers import LazyAdam  # noqa: E402

IDS = tf.constant([[1, 2], [3, -1]], tf.int64)


def fused_bag():
    keras.utils.set_random_seed(0)
    bag = EmbeddingBag(50, 4, fused_optimizer=True, name="bag")
    bag(IDS)
    optimizer = LazyAdam(0.01)
    optimizer.build(bag.trainable_variables)
    return bag, optimizer


def one_step(bag, optimizer, forward, transform=lambda grads: grads):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(forward(bag) ** 2)
    grads = transform(tape.gradient(loss, bag.trainable_variables))
    optimizer.apply_gradients(zip(grads, bag.trainable_variables))


CONTROL_FLOW = {
    "tf.cond": lambda bag: tf.cond(tf.constant(True), lambda: bag(IDS), lambda: tf.zeros([2, 4])),
    "tf.map_fn": lambda bag: tf.map_fn(lambda row: bag(row[None])[0], IDS, fn_output_signature=tf.float32),
}


@pytest.mark.parametrize("flow", sorted(CONTROL_FLOW))
def test_tape_outside_control_flow_around_the_layer_is_refused_clearly(flow):
    bag, optimizer = fused_bag()
    before = bag.embeddings.numpy()
    with pytest.raises(ValueError, match=r"inside a tf.cond .* differentiated by a tape outside"):
        tf.function(lambda: one_step(bag, optimizer, CONTROL_FLOW[flow]))()
    np.testing.assert_array_equal(bag.embeddings.numpy(), before)  # no update was applied


def test_layer_inside_tf_cond_without_a_tape_looks_up_as_outside():
    bag, _ = fused_bag()
    inside = tf.function(lambda: CONTROL_FLOW["tf.cond"](bag))()
    table = bag.embeddings.numpy().astype(np.float64)
    np.testing.assert_allclose(inside.numpy(), [table[1] + table[2], table[3]], rtol=1e-6)


def fit_table(fused, steps_per_execution):
    keras.utils.set_random_seed(0)
    ids = keras.Input((4,), dtype="int64")
    bag = EmbeddingBag(60, 8, fused_optimizer=fused, sparse_gradient=not fused, name="bag")
    model = keras.Model(ids, keras.layers.Dense(1)(bag(ids)))
    model.compile(LazyAdam(0.01), "mse", steps_per_execution=steps_per_execution)
    rng = np.random.default_rng(0)
    model.fit(rng.integers(-1, 60, (32, 4)), rng.standard_normal((32, 1)), batch_size=8, verbose=0,
              shuffle=False)
    return bag.embeddings.numpy()


def test_fit_with_steps_per_execution_still_trains_like_the_sparse_path():
    # fit runs several steps in a tf.while_loop whose body holds the tape: the fused update runs there.
    np.testing.assert_allclose(fit_table(True, 2), fit_table(False, 1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_clip_by_global_norm_of_a_fused_table_gradient_is_refused(compiled):
    bag, optimizer = fused_bag()

    def clip(grads):
        return tf.clip_by_global_norm(grads, 1e-3)[0]

    step = lambda: one_step(bag, optimizer, lambda layer: layer(IDS), clip)  # noqa: E731
    with pytest.raises(ValueError, match="changed .*clip_by_global_norm.* unchanged update"):
        (tf.function(step) if compiled else step)()


def test_unclipped_fused_steps_still_apply_after_a_refused_clip():
    bag, optimizer = fused_bag()
    with pytest.raises(ValueError, match="clip_by_global_norm"):
        one_step(bag, optimizer, lambda layer: layer(IDS), lambda g: tf.clip_by_global_norm(g, 1.0)[0])
    before = bag.embeddings.numpy()
    one_step(bag, optimizer, lambda layer: layer(IDS))
    moved = np.any(bag.embeddings.numpy() != before, axis=1)
    np.testing.assert_array_equal(np.flatnonzero(moved), [1, 2, 3])
