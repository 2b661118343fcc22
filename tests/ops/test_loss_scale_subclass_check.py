"""A LossScaleOptimizer subclass of the user's with its own check_finite keeps it around LazyAdam /
RowwiseAdagrad: their build gives a wrapper the row-sparse check in place of Keras' check only
(it replaced the subclass' check too, silently)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import _loss_scale_check  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402


class _SkipsEveryStep(keras.optimizers.LossScaleOptimizer):
    def check_finite(self, grads):
        return tf.constant(False)


@pytest.mark.parametrize("make", [LazyAdam, RowwiseAdagrad], ids=["lazy_adam", "rowwise_adagrad"])
def test_a_subclass_check_finite_is_kept(make):
    table = keras.Variable(np.ones((5, 2), np.float32), name="table")
    wrapper = _SkipsEveryStep(make(0.1), initial_scale=4.0)
    wrapper.apply([tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([5, 2]))], [table])
    np.testing.assert_array_equal(table.numpy(), 1.0)  # the subclass skipped the step
    assert float(wrapper.dynamic_scale.numpy()) == 2.0


def test_keras_wrapper_still_gets_the_row_sparse_check():
    table = keras.Variable(np.ones((5, 2), np.float32), name="table")
    wrapper = keras.optimizers.LossScaleOptimizer(LazyAdam(0.1))
    wrapper.build([table])
    assert wrapper.check_finite is _loss_scale_check.all_finite
