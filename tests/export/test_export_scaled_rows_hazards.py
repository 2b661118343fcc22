"""Rows scaled by several factors (scales.py) where folding the factors into one weight would change the
numbers: a float16 table's folded weight (1 / d, w * m) past 65504 where the composite's steps stay
finite, and masked rows divided afterwards (0 / 0 is NaN in the composite, where the op's padding
leaves the masked entry out). Both fused models gave other outputs than the original; now reported
and left as written, or fused where the fold cannot change them."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, RNG, TABLE, WEIGHTS, np_bags, run_both, save_and_export

HALF_WEIGHTS = tf.TensorSpec([None, K], tf.float16)
SMALL_TABLE = (TABLE * 1e-3).astype(np.float16)  # small rows: rows * w stays finite for large w


def _ids(batch=4):
    # Its own generator: the shared RNG's state depends on which tests this worker ran before.
    ids = np.random.default_rng(34).integers(0, N, (batch, K))
    ids[0, :2] = 7  # a repeated id
    return ids


def _halves(value, batch=4):
    return np.full((batch, K), value, np.float16)


HALF_FOLDS = {
    # 1 / d is past float16's range for d < 1.5e-5; rows / d is not for rows ~ 1e-3
    "divided_by_small_weights": ([IDS, HALF_WEIGHTS], lambda m, ids, d: tf.reduce_sum(
        tf.gather(m.t, ids) / d[..., None], 1), lambda batch: (_halves(1e-5, batch),)),
    # 300 * 300 is past 65504; rows * 300 * 300 is not
    "two_large_multipliers": ([IDS, HALF_WEIGHTS, HALF_WEIGHTS], lambda m, ids, a, b: tf.reduce_sum(
        tf.gather(m.t, ids) * a[..., None] * b[..., None], 1), lambda batch: (_halves(300, batch), _halves(300, batch))),
}


@pytest.mark.parametrize("form", sorted(HALF_FOLDS))
def test_float16_table_factors_whose_product_may_overflow_keep_the_original_numbers(tmp_path, form):
    specs, body, feed = HALF_FOLDS[form]
    result = save_and_export(tmp_path, specs, body, table=SMALL_TABLE)
    [site] = result.sites
    assert site.status == "skipped" and "float16" in site.reason, site.reason
    ids, fed = _ids(), feed(4)
    weight = np.prod([f.astype(np.float64) for f in fed], axis=0)
    weight = 1 / weight if "divided" in form else weight
    expected = np.einsum("bk,bkd->bd", weight, SMALL_TABLE.astype(np.float64)[ids])
    want, got = run_both(tmp_path, result, ids, *fed)
    for out in (want, got):
        assert np.all(np.isfinite(out.astype(np.float64)))
        # float16 terms of both signs: the error is relative to the terms' scale, not to each bag's sum
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-2,
                                   atol=2e-2 * np.abs(expected).max())


def test_float16_table_factors_no_larger_than_one_weight_are_fused(tmp_path):
    """-(rows * w) / 4 * 0.5: the folded weight is no larger than w, which float16 holds."""
    result = save_and_export(tmp_path, [IDS, HALF_WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        -(tf.gather(m.t, ids) * w[..., None]) / 4.0 * 0.5, 1), table=SMALL_TABLE)
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids, w = _ids(), _halves(60000)
    expected = np.einsum("bk,bkd->bd", -w.astype(np.float64) / 8, SMALL_TABLE.astype(np.float64)[ids])
    for out in run_both(tmp_path, result, ids, w):
        # float16 terms of both signs: the error is relative to the terms' scale, not to each bag's sum
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-2,
                                   atol=2e-2 * np.abs(expected).max())


MASK = tf.TensorSpec([None, K], tf.bool)


def test_masked_rows_divided_by_zero_are_nan_as_in_the_original(tmp_path):
    """tf.where(mask, rows, 0) / d[..., None] with d == 0 at a masked entry: the composite's 0 / 0 makes the
    bag NaN; the fused bag left the masked entry out and was finite. Now reported."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, MASK], lambda m, ids, d, mask: tf.reduce_sum(
        tf.where(mask[..., None], tf.gather(m.t, ids), 0.0) / d[..., None], 1))
    [site] = result.sites
    assert site.status == "skipped" and "divided" in site.reason, site.reason
    ids = _ids()
    d = RNG.uniform(0.5, 2, (4, K)).astype(np.float32)
    d[1, 3] = 0.0
    mask = d != 0
    expected = np_bags(ids, np.where(mask, 1 / np.where(mask, d, 1).astype(np.float64), 0))
    expected[1] = np.nan
    for out in run_both(tmp_path, result, ids, d, mask):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_masked_rows_divided_by_a_nonzero_constant_or_masked_after_division_are_fused(tmp_path):
    """tf.where(mask, rows / d, 0) / 2: the select drops the masked quotient, and 2 is never 0."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, MASK], lambda m, ids, d, mask: tf.reduce_sum(
        tf.where(mask[..., None], tf.gather(m.t, ids) / d[..., None], 0.0) / 2.0, 1))
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids()
    d = RNG.uniform(0.5, 2, (4, K)).astype(np.float32)
    d[1, 3] = 0.0
    mask = d != 0
    expected = np_bags(ids, np.where(mask, 0.5 / np.where(mask, d, 1).astype(np.float64), 0))
    for out in run_both(tmp_path, result, ids, d, mask):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_factors_of_rows_before_a_regrouping_reshape_are_reported_not_a_failed_export(tmp_path):
    """reduce_sum(reshape(-(rows / d[..., None]), [-1, 2, 3, D]), 2) of [B, 6] ids: d is [B, 6], the ids' shape
    before the reshape, not the regrouped [B, 2, 3] the op reads. The factor was checked against the ids as
    fed, and the export failed ("the fused SavedModel does not load"); now the site is reported."""
    d = RNG.uniform(0.5, 2, (4, 6)).astype(np.float32)
    ids = RNG.integers(0, N, (4, 6))
    result = save_and_export(tmp_path, [tf.TensorSpec([None, 6], tf.int64), tf.TensorSpec([None, 6], tf.float32)],
                             lambda m, ids, d: tf.reduce_sum(tf.reshape(
                                 -(tf.gather(m.t, ids) / d[..., None]), [-1, 2, 3, TABLE.shape[1]]), 2))
    [site] = result.sites
    assert site.status == "skipped" and "not per-index" in site.reason, site.reason
    expected = -np_bags(ids.reshape(-1, 3), 1 / d.reshape(-1, 3).astype(np.float64)).reshape(4, 2, -1)
    for out in run_both(tmp_path, result, ids, d):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
