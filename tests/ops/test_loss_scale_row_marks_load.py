"""A LossScaleOptimizer (mixed_float16's) around LazyAdam / RowwiseAdagrad with gradient
accumulation loads its own store saved before the row marks existed: Keras' wrapper saves its
variables and its inner optimizer's together, and skipped them all on the count mismatch (with
a warning), so the loss scale and its step counter came back as at construction."""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402

N, D = 6, 2


def _wrapped(make, table):
    wrapper = keras.optimizers.LossScaleOptimizer(make(0.1, gradient_accumulation_steps=2), initial_scale=8.0,
                                                  dynamic_growth_steps=1)
    wrapper.build([table])
    return wrapper


@pytest.mark.parametrize("make", [LazyAdam, RowwiseAdagrad], ids=["lazy_adam", "rowwise_adagrad"])
def test_wrapper_store_saved_before_the_row_marks_loads(make):
    table = keras.Variable(np.ones((N, D), np.float32), name="table")
    saved = _wrapped(make, table)
    for rows in ([1, 3], [2], [4]):  # a window and a half; the scale doubled each finite step
        grad = tf.IndexedSlices(tf.ones((len(rows), D)), tf.constant(rows), tf.constant([N, D]))
        saved.apply([grad], [table])
    store = {}
    saved.save_own_variables(store)
    marks = {i for i, v in enumerate(saved.variables) if v.path.endswith("_accumulated_rows")}
    assert marks
    old_store = {str(i): store[key] for i, key in enumerate(k for k in store if int(k) not in marks)}
    loaded = _wrapped(make, keras.Variable(np.zeros((N, D), np.float32), name="table"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.load_own_variables(old_store)
    for want, got in zip(saved.variables, loaded.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)
