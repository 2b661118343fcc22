"""An unsorted_segment_max (or segment_mean / segment_max) site left composite was reported with combiner 'sum'
(the Site default) wherever it was skipped before the combiner was recorded on the reported site: weighted or
masked flattened rows, say."""
import numpy as np
import tensorflow as tf

from round34_forms import D, IDS, K, TABLE, WEIGHTS, random_ids, run_both, save_and_export


def test_skipped_unsorted_segment_max_is_reported_as_a_max(tmp_path):
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.math.unsorted_segment_max(
        tf.reshape(tf.gather(m.t, ids) * w[..., None], [-1, D]), tf.repeat(tf.range(tf.shape(ids)[0]), K),
        tf.shape(ids)[0]))
    [site] = result.sites
    assert (site.status, site.combiner) == ("skipped", "max"), (site.status, site.combiner, site.reason)
    ids = random_ids()
    w = np.random.default_rng(5).uniform(-1, 2, ids.shape).astype(np.float32)
    want, got = run_both(tmp_path, result, ids, w)
    np.testing.assert_allclose(got, (TABLE.astype(np.float64)[ids] * w[..., None]).max(1), rtol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_skipped_segment_mean_of_weighted_flattened_rows_is_reported_as_a_mean(tmp_path):
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.math.segment_mean(
        tf.reshape(tf.gather(m.t, ids), [-1, D]) * tf.reshape(w, [-1, 1]), tf.repeat(tf.range(tf.shape(ids)[0]), K)))
    [site] = result.sites
    assert (site.status, site.combiner) == ("skipped", "mean"), (site.status, site.combiner, site.reason)
    ids = random_ids()
    w = np.random.default_rng(6).uniform(-1, 2, ids.shape).astype(np.float32)
    want, got = run_both(tmp_path, result, ids, w)
    np.testing.assert_allclose(got, (TABLE.astype(np.float64)[ids] * w[..., None]).mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)
