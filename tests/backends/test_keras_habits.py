"""Keras habits around EmbeddingBag / ProductKeyMemory on the TensorFlow, JAX and PyTorch backends,
JAX and PyTorch each in its own process, TensorFlow in this one where its Keras runs TF
(keras_habit_checks.py holds the checks). A backend that is not installed is skipped."""

import os

import pytest

from tests.backends.check_processes import finish, installed, start

BACKENDS = ["tensorflow", "jax", "torch"]
CHECKS = ["table_dtype", "half_float_ids", "mask", "batch_axis", "tied_table", "empty_bags", "unrepresentable_ids",
          "one_slot_memory"]


def _keras_runs_tf_here():
    import keras

    return keras.backend.backend() == "tensorflow" and os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow"


def _run_here(checks):
    """{check: "ok"} for the checks run in this process (no process to import TF, Keras and pkm_serve
    again); the dtype policies they set are put back, passed or not."""
    import keras

    from tests.backends import keras_habit_checks

    policy = keras.config.dtype_policy()
    try:
        for name in checks:
            keras_habit_checks.CHECKS[name]()
    finally:
        keras.config.set_dtype_policy(policy)
    return dict.fromkeys(checks, "ok")


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_habits(backend):
    """table_dtype: under mixed_bfloat16 / mixed_float16 a direct call reads the float32 table (it read a
    16-bit copy: 0.02 off, and off the same layer in a model). half_float_ids: float ids that a
    subclassed Model rounded to 16 bits (257 -> 256) are a clear error (they read other rows). mask: a
    Keras mask over the leading dims passes on to a following pooling (it was dropped). batch_axis:
    keras.Input(shape=()) ids are a clear error (the whole batch was one bag). tied_table: a layer tying
    its weights to the table reads it in its compute dtype, as keras.layers.Embedding's. empty_bags: ids
    [B, 0], a [0, D] table and ragged bags without values give zeros and a zero gradient (the composite's
    max and its gather from an empty table raised under JAX and PyTorch). unrepresentable_ids: NaN,
    +inf or past-int64 float ids (TF: uint64 ids past int64 too) are an error (they were padding, or
    NaN read row 0 under JAX). one_slot_memory: a knn=1 ProductKeyMemory reads its best slot without Keras'
    size-1 softmax warning (JAX, PyTorch)."""
    if not installed(backend):
        pytest.skip(f"{backend} is not installed (requirements-backends.lock)")
    if backend == "tensorflow" and _keras_runs_tf_here():
        got = _run_here(CHECKS)
    else:
        got = finish(start(backend, CHECKS, module="keras_habit_checks"), f"{backend} {CHECKS}")
    assert got == dict.fromkeys(CHECKS, "ok")
