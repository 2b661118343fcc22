"""Bag forms a round-36 hunt found not fused (each a form users write): every fused one computes what the
original does (numpy float64 and the original SavedModel as references); one left composite is reported
with its reason and the exported model still computes the original's outputs."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, RNG, TABLE, WEIGHTS, np_bags, random_ids, run_both, save_and_export


def _weights(ids):
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    w[1, 1:3] = 0.0  # multiply_no_nan's zeros
    return w


MULTIPLY_NO_NAN = {
    "sum": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1), 1),
    "mean": (lambda m, ids, w: tf.reduce_mean(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1),
             1 / K),
    "after_a_mask": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(
        tf.gather(m.t, ids) * tf.cast(ids > 0, tf.float32)[..., None], w[..., None]), 1), None),
}


@pytest.mark.parametrize("form", sorted(MULTIPLY_NO_NAN))
def test_multiply_no_nan_of_rows_by_weights_is_a_weighted_bag(tmp_path, form):
    """tf.math.multiply_no_nan(rows, w[..., None]) before the reduction stopped the walk to the gather
    (MulNoNan was no multiply): the site was left composite."""
    body, scale = MULTIPLY_NO_NAN[form]
    result = save_and_export(tmp_path, [IDS, WEIGHTS], body)
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = random_ids()
    w = _weights(ids)
    want, got = run_both(tmp_path, result, ids, w)
    expected = np_bags(ids, w * (ids > 0)) if scale is None else np_bags(ids, w) * scale
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_multiply_no_nan_of_weights_by_rows_is_reported(tmp_path):
    """multiply_no_nan(w, rows) is 0 wherever a row entry is 0, an inf weight included: not the op's w * row."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        tf.math.multiply_no_nan(w[..., None], tf.gather(m.t, ids)), 1))
    [site] = result.sites
    assert site.status == "skipped" and "multiply_no_nan(w, rows)" in site.reason
    ids = random_ids()
    w = _weights(ids)
    want, got = run_both(tmp_path, result, ids, w)
    np.testing.assert_allclose(got, np_bags(ids, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)
