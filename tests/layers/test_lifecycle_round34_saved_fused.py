"""A SavedModel of a `fused_optimizer=True` table is differentiated after loading (fine-tuning a
loaded model): its saved gradient is the row-sparse one (README). Before, the loaded gradient
failed inside TF with `TypeError: Binding inputs to tf.function failed`: the lookup's custom
gradient took the table's resource handle, where TF's loader feeds float zeros."""
import keras
import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.layers import EmbeddingBag
from pkm_serve.optimizers import LazyAdam

ROWS, DIM = 30, 4


def _bags():
    rng = np.random.default_rng(5)
    return rng.integers(-1, ROWS, (8, 3)).astype(np.int64), rng.uniform(0.5, 2.0, (8, 3)).astype(np.float32)


class _BagModule(tf.Module):
    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(0)
        self.bag = EmbeddingBag(ROWS, DIM, combiner="mean", fused_optimizer=True)
        self.bag.build()
        self.table = self.bag.embeddings.value  # tracked itself: the loaded object exposes it

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int64), tf.TensorSpec([None, 3], tf.float32)])
    def __call__(self, ids, weights):
        return self.bag(ids, weights)


def _train_one_fused_step(module):
    optimizer = LazyAdam(0.05)
    optimizer.build([module.bag.embeddings])  # claims the table: the step's backward applies the update
    ids, weights = _bags()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(module(ids, weights) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, [module.bag.embeddings]), [module.bag.embeddings]))


def _reference_gradient(table_values, ids, weights):
    table = tf.constant(table_values)
    with tf.GradientTape() as tape:
        tape.watch(table)
        loss = tf.reduce_sum(ops.embedding_bag_composite(table, ids, weights, combiner="mean") ** 2)
    return tf.convert_to_tensor(tape.gradient(loss, table)).numpy()


def test_a_loaded_tf_module_of_a_fused_table_gives_the_row_sparse_gradient(tmp_path):
    module = _BagModule()
    _train_one_fused_step(module)
    tf.saved_model.save(module, str(tmp_path / "module"))
    loaded = tf.saved_model.load(str(tmp_path / "module"))
    ids, weights = _bags()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loaded(ids, weights) ** 2)
    gradient = tape.gradient(loss, loaded.table)
    assert isinstance(gradient, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(gradient).numpy(),
                               _reference_gradient(loaded.table.numpy(), ids, weights), rtol=1e-5, atol=1e-6)


def test_an_exported_fused_model_fine_tunes_after_loading(tmp_path):
    keras.utils.set_random_seed(0)
    ids_in, weights_in = keras.Input((3,), dtype="int64"), keras.Input((3,))
    bag = EmbeddingBag(ROWS, DIM, combiner="mean", fused_optimizer=True, name="bag")
    model = keras.Model([ids_in, weights_in], keras.layers.Dense(1, name="head")(bag(ids_in, weights_in)))
    model.compile(LazyAdam(0.05), "mse")
    ids, weights = _bags()
    model.fit([ids, weights], np.ones((8, 1), np.float32), verbose=0)
    model.export(str(tmp_path / "exported"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "exported"))
    (table,) = [v for v in loaded.variables if v.shape == (ROWS, DIM)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loaded.serve([ids, weights]))
    gradient = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    # d(sum(bag @ kernel)) / d table: each bag's mean gradient times the head's kernel column.
    reference_table = tf.constant(table.numpy())
    with tf.GradientTape() as tape:
        tape.watch(reference_table)
        out = ops.embedding_bag_composite(reference_table, ids, weights, combiner="mean")
        reference_loss = tf.reduce_sum(out @ model.get_layer("head").kernel.numpy())
    np.testing.assert_allclose(gradient, tf.convert_to_tensor(tape.gradient(reference_loss, reference_table)).numpy(),
                               rtol=1e-5, atol=1e-6)
