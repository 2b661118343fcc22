"""An export whose fused model gives a number where the original gives NaN (or the reverse) failed its
verification with "fused differs from original by up to 0": the NaN-free largest difference. The message
now counts the elements NaN on one side alone. A one-hot matmul lookup (tf-models' OnDeviceEmbedding with
use_one_hot=True) of a table with an inf entry is such a model: the composite's 0 * inf makes that column
NaN in every row, the fused gather reads only the rows looked up (docs/export.md)."""
import warnings

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import ExportError
from pkm_serve.export.verify import VerificationError, compare_outputs
from round34_forms import D, K, N, TABLE, save_and_export


def test_nan_on_one_side_alone_is_counted_not_reported_as_a_zero_difference():
    want = {"o": np.array([[np.nan, 1.0], [2.0, np.nan]], np.float32)}
    with pytest.raises(VerificationError) as err:
        compare_outputs("s", want, {"o": np.array([[0.5, 1.0], [2.0, np.nan]], np.float32)})
    message = str(err.value)
    assert "1 of 4 elements are NaN in the original alone" in message, message
    assert "fused differs from original" in message  # tflite_export rewrites this phrase
    with pytest.raises(VerificationError) as err:
        compare_outputs("s", {"o": np.ones(3, np.float32)}, {"o": np.array([1.0, np.nan, 1.5], np.float32)})
    assert "1 of 3 elements are NaN in the fused model alone; elsewhere) by up to 0.5" in str(err.value)
    assert compare_outputs("s", want, {"o": want["o"].copy()})[0]["max_abs_err"] == 0.0


def test_one_hot_lookup_of_a_table_with_an_inf_names_the_nan_columns(tmp_path):
    table = TABLE.copy()
    table[3, 1] = np.inf
    with pytest.raises(ExportError) as err:
        save_and_export(tmp_path, [tf.TensorSpec([None, K], tf.int64)], lambda m, ids: tf.reduce_sum(tf.reshape(
            tf.matmul(tf.one_hot(tf.reshape(ids, [-1]), N), m.t), tf.concat([tf.shape(ids), [D]], 0)), 1),
            table=table)
    assert "elements are NaN in the original alone" in str(err.value), str(err.value)


def test_a_tflite_nan_mismatch_names_the_saved_model_and_the_tflite():
    from pkm_serve.export.tflite_export import _mismatch_message
    want = {"o": np.array([np.nan, 1.0], np.float32)}
    with pytest.raises(VerificationError) as err:
        compare_outputs("s", want, {"o": np.array([0.0, 1.0], np.float32)})
    message = _mismatch_message("s", err.value, {}, None, {}, want)
    assert "the .tflite differs from the SavedModel (1 of 2 elements are NaN in the SavedModel alone" in message, \
        message


def test_nan_everywhere_on_one_side_gives_no_nan_largest_difference():
    with pytest.raises(VerificationError) as err:
        compare_outputs("s", {"o": np.ones(2, np.float32)}, {"o": np.full(2, np.nan, np.float32)})
    assert "2 of 2 elements are NaN in the fused model alone; elsewhere) by up to 0 " in str(err.value), str(err.value)


def test_equal_infinities_compare_without_a_numpy_warning():
    """An output inf in both models (a weighted mean of weights summing to 0) printed numpy's
    "RuntimeWarning: invalid value encountered in subtract" among the export's progress lines."""
    want = {"o": np.array([np.inf, -np.inf, 1.0], np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compare_outputs("s", want, {"o": want["o"].copy()})[0]["max_abs_err"] == 0.0
