"""A float16 table's max bags (ragged reduce_max, unsorted_segment_max) and safe_embedding_lookup_sparse with
default_id give an empty bag its value by a SelectV2 after the fused op; in float16 that is no TFLite builtin, so
`--tflite` failed ("the .tflite would need custom ops ['SelectV2']"). The select is now made in float32
(exact both ways); the .tflite matches the SavedModel and numpy."""
import numpy as np
import tensorflow as tf

from pkm_serve import tflite
from round34_forms import D, N, TABLE, save_and_export

HALF = TABLE.astype(np.float16)
LOWEST = np.finfo(np.float16).min


def _export_and_run(tmp_path, specs, body, feed):
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, **feed)
    lite = str(tmp_path / "m.tflite")
    result = save_and_export(tmp_path, specs, body, table=HALF, tflite=lite, sample_inputs=sample)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    want = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**feed)["out"].numpy()
    got = tflite.make_interpreter(lite).get_signature_runner("serving_default")(**feed)["out"]
    return want, got


def test_ragged_max_of_a_float16_table_converts_to_tflite(tmp_path):
    rt = tf.ragged.constant([[1, 2], [], [3, 4, 5]], tf.int64)
    want, got = _export_and_run(tmp_path, [tf.RaggedTensorSpec([None, None], tf.int64)],
                                lambda m, r: tf.reduce_max(tf.gather(m.t, r), 1),
                                {"args_0": rt.values.numpy(), "args_0_1": rt.row_splits.numpy()})
    expected = np.stack([HALF[[1, 2]].max(0), np.full(D, LOWEST, np.float16), HALF[[3, 4, 5]].max(0)])
    np.testing.assert_array_equal(want, expected)
    np.testing.assert_array_equal(got, expected)


def test_unsorted_segment_max_of_a_float16_table_converts_to_tflite(tmp_path):
    ids = np.array([1, 7, 3, 9, 4, 20], np.int64)
    seg = np.array([2, 0, 2, -1, 0, 4], np.int32)
    want, got = _export_and_run(
        tmp_path, [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)],
        lambda m, i, s, n: tf.math.unsorted_segment_max(tf.gather(m.t, i), s, n),
        {"args_0": ids, "args_1": seg, "args_2": np.int32(5)})
    expected = np.full((5, D), LOWEST, np.float16)
    for i, s in zip(ids, seg):
        if s >= 0:
            expected[s] = np.maximum(expected[s], HALF[i])
    np.testing.assert_array_equal(want, expected)
    np.testing.assert_array_equal(got, expected)


def test_safe_lookup_with_default_id_of_a_float16_table_converts_to_tflite(tmp_path):
    spec = tf.SparseTensorSpec([None, None], tf.int64)
    sp = tf.sparse.SparseTensor([[0, 0], [0, 1], [2, 0]], np.array([3, 5, N - 1], np.int64), [3, 4])
    feed = {"args_0": sp.indices.numpy(), "args_0_1": sp.values.numpy(), "args_0_2": sp.dense_shape.numpy()}
    want, got = _export_and_run(tmp_path, [spec], lambda m, s: tf.nn.safe_embedding_lookup_sparse(
        m.t, s, default_id=7, combiner="sum"), feed)
    expected = np.stack([HALF[3].astype(np.float32) + HALF[5], HALF[7], HALF[N - 1]])  # row 1 empty: table[7]
    np.testing.assert_allclose(want.astype(np.float32), expected, rtol=1e-3)
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=1e-3)
