"""A SavedModel with a training signature (a tf.function stepping a LazyAdam / RowwiseAdagrad with
gradient_accumulation_steps, as on-device training exports one) saves, loads and trains. The
function captures the accumulation's step records (pkm_serve/_row_accumulation.py), which no
object tracked: tf.saved_model.save refused it ("references an 'untracked' resource"). A
tf.train.Checkpoint still leaves them out."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402
from tests.row_optimizer_reference import apply_rows  # noqa: E402

N, D, LR, STEPS = 8, 3, 0.1, 2
MICRO_STEPS = ([1, 2, 2], [2, 5])  # one window; row 2 listed three times


def _module(optimizer_cls):
    init = np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32)
    module = tf.Module()
    module.table = keras.Variable(init, name="table")
    module.optimizer = optimizer_cls(LR, gradient_accumulation_steps=STEPS)
    module.optimizer.build([module.table])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def train(rows):
        values = tf.ones((tf.size(rows), D)) * tf.cast(rows[:, None] + 1, tf.float32)
        module.optimizer.apply_gradients([(tf.IndexedSlices(values, rows, tf.constant([N, D])), module.table)])
        return {"iterations": tf.identity(module.optimizer.iterations)}

    module.train = train
    return module, init


def _reference(kind, init):
    grad = np.zeros((N, D))
    for rows in MICRO_STEPS:
        np.add.at(grad, rows, (np.array(rows, np.float64)[:, None] + 1) * np.ones(D))
    rows = np.flatnonzero(np.any(grad != 0, axis=1))
    state = (np.zeros((N, D)), np.zeros((N, D))) if kind == "adam" else (np.full(N, 0.1),)  # initial_accumulator_value
    table, _ = apply_rows(kind, init, grad[rows] / STEPS, rows, state, LR)
    return table


@pytest.mark.parametrize("optimizer_cls, kind", [(LazyAdam, "adam"), (RowwiseAdagrad, "rowwise_adagrad")])
def test_a_training_signature_saves_loads_and_takes_the_windows_step(tmp_path, optimizer_cls, kind):
    module, init = _module(optimizer_cls)
    tf.saved_model.save(module, str(tmp_path / "sm"), signatures={"train": module.train})
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    for rows in MICRO_STEPS:
        loaded.signatures["train"](rows=tf.constant(rows, tf.int64))
    np.testing.assert_allclose(loaded.table.numpy(), _reference(kind, init), rtol=1e-5, atol=1e-6)


def test_the_step_records_stay_out_of_a_checkpoint(tmp_path):
    module, _ = _module(LazyAdam)
    module.train(tf.constant([1], tf.int64))
    path = tf.train.Checkpoint(optimizer=module.optimizer).save(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert len([n for n in names if n.startswith("optimizer/_variables/")]) == len(module.optimizer.variables) - 2
    assert not [n for n in names if "pkm" in n or "step_records" in n]
