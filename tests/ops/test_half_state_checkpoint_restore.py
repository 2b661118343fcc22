"""A tf.train.Checkpoint holding a half-precision variable's optimizer state in the variable's dtype
(Keras' Adam, an earlier pkm_serve) restores into LazyAdam / RowwiseAdagrad, whose state of such a
variable is float32 now: the values cast, built before the read or restored on build. Before,
RestoreV2 refused it ("expected dtype float does not equal original dtype bfloat16") and the whole
read failed, the table included. A float32 checkpoint of that state keeps its float32 values."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import optimizers  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D = 10, 4


def _trained(optimizer, dtype, steps=3):
    """A [N, D] `dtype` table stepped by `optimizer` with row-sparse gradients."""
    rng = np.random.default_rng(5)
    table = keras.Variable(rng.uniform(-1, 1, (N, D)), dtype=dtype, name="table")
    optimizer.build([table])
    for _ in range(steps):
        rows = tf.constant(rng.integers(0, N, 4))
        values = tf.constant(rng.uniform(-1, 1, (4, D)), dtype)
        optimizer.apply([tf.IndexedSlices(values, rows, tf.constant([N, D]))], [table])
    return table


def _restored(optimizer, dtype, path, build_first):
    table = keras.Variable(np.zeros((N, D)), dtype=dtype, name="table")
    if build_first:
        optimizer.build([table])
    status = tf.train.Checkpoint(table=table, optimizer=optimizer).read(path)
    if not build_first:
        optimizer.build([table])  # the optimizer's variables restored as they are created
    status.assert_consumed()
    return table


def _as_float64(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64) for v in variables]


@pytest.mark.parametrize("build_first", [True, False], ids=["built", "restored_on_build"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lazy_adam_restores_keras_adams_half_moments(tmp_path, dtype, build_first):
    adam = keras.optimizers.Adam(0.05)  # Keras' Adam keeps the moments in the variable's dtype
    table = _trained(adam, dtype)
    path = tf.train.Checkpoint(table=table, optimizer=adam).write(str(tmp_path / "ckpt"))

    lazy = LazyAdam(0.05)
    restored = _restored(lazy, dtype, path, build_first)

    assert [v.dtype for v in lazy.variables[2:]] == ["float32"] * 2
    np.testing.assert_array_equal(_as_float64([restored])[0], _as_float64([table])[0])
    assert int(lazy.iterations.numpy()) == int(adam.iterations.numpy()) == 3
    for got, saved in zip(_as_float64(lazy.variables[2:]), _as_float64(adam.variables[2:]), strict=True):
        np.testing.assert_array_equal(got, saved)


@pytest.mark.parametrize("build_first", [True, False], ids=["built", "restored_on_build"])
def test_rowwise_adagrad_restores_an_earlier_half_accumulator(tmp_path, monkeypatch, build_first):
    with monkeypatch.context() as earlier:  # the earlier release: state in the variable's dtype
        earlier.setattr(optimizers, "_state_dtype", lambda v: keras.backend.standardize_dtype(v.dtype))
        old = RowwiseAdagrad(0.05)
        table = _trained(old, "float16")
    assert old.variables[2].dtype == "float16"
    path = tf.train.Checkpoint(table=table, optimizer=old).write(str(tmp_path / "ckpt"))

    new = RowwiseAdagrad(0.05)
    restored = _restored(new, "float16", path, build_first)

    assert new.variables[2].dtype == "float32"
    np.testing.assert_array_equal(_as_float64([restored])[0], _as_float64([table])[0])
    np.testing.assert_array_equal(_as_float64(new.variables[2:])[0], _as_float64(old.variables[2:])[0])


def test_float32_state_of_a_half_variable_checkpoints_in_float32(tmp_path):
    lazy = LazyAdam(0.05)
    table = _trained(lazy, "bfloat16")
    moments = _as_float64(lazy.variables[2:])
    assert any(not np.array_equal(m, m.astype(np.float32).astype("bfloat16").astype(np.float64))
               for m in (np.asarray(x, np.float32) for x in moments))  # bfloat16 would round them
    path = tf.train.Checkpoint(table=table, optimizer=lazy).write(str(tmp_path / "ckpt"))
    saved = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
    assert {saved[f"optimizer/_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"] for i in (2, 3)} == {tf.float32}

    again = LazyAdam(0.05)
    _restored(again, "bfloat16", path, build_first=True)
    for got, want in zip(_as_float64(again.variables[2:]), moments, strict=True):
        np.testing.assert_array_equal(got, want)
