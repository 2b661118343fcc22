"""tf.math.segment_mean / segment_max (keras.ops.segment_max(sorted=True)) of gathered rows flattened to
[B * K, D] by a reshape were reported ("Reshape between the gather and the segment_mean"); now fused as the
bags of the flattened ids (as segment_sum's were), checked against numpy float64 and the original."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import D, IDS, K, N, RNG, TABLE, WEIGHTS, run_both, save_and_export

SEGMENTS = tf.TensorSpec([None], tf.int32)
REDUCE = {"segment_mean": (tf.math.segment_mean, np.mean), "segment_max": (tf.math.segment_max, np.max)}


def _flat_rows(m, ids):
    return tf.reshape(tf.gather(m.t, ids), [-1, D])


def _reference(ids, seg, reduce):
    """reduce over the rows of each segment id 0..max(seg); a segment without rows is 0 (as both give)."""
    flat = ids.reshape(-1)
    out = np.zeros((seg.max() + 1, D))
    for s in range(seg.max() + 1):
        if np.any(seg == s):
            out[s] = reduce(TABLE.astype(np.float64)[flat[seg == s]], axis=0)
    return out


@pytest.mark.parametrize("form", sorted(REDUCE))
def test_sorted_segment_mean_and_max_of_flattened_rows_are_bags(tmp_path, form):
    segment_op, reduce = REDUCE[form]
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=RNG.integers(0, N, (2, K)), args_1=np.repeat([0, 1], K).astype(np.int32))
    result = save_and_export(tmp_path, [IDS, SEGMENTS], lambda m, ids, seg: segment_op(_flat_rows(m, ids), seg),
                             sample_inputs=sample)
    [site] = result.sites
    assert (site.status, site.combiner) == ("fused", form.split("_")[1]), site.reason
    ids = RNG.integers(0, N, (3, K))
    seg = np.repeat([0, 2, 3], K).astype(np.int32)  # segment 1 empty
    seg[K - 1] = 2  # bags of other lengths than K
    want, got = run_both(tmp_path, result, ids, seg)
    expected = _reference(ids, seg, reduce)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for model in (tmp_path / "m", result.dst):  # segment ids out of order: both refuse
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf.saved_model.load(str(model)).signatures["serving_default"](args_0=ids, args_1=seg[::-1].copy())


def test_segment_mean_of_masked_flattened_rows_is_reported(tmp_path):
    """A masked row counts in segment_mean's count (the op's padding would not): reported, left as written."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.math.segment_mean(
        tf.where(tf.reshape(w > 1, [-1, 1]), _flat_rows(m, ids), 0.0), tf.repeat(tf.range(tf.shape(ids)[0]), K)))
    [site] = result.sites
    assert site.status == "skipped" and "masked row counts" in site.reason, site.reason
    ids = RNG.integers(0, N, (3, K))
    w = RNG.uniform(0, 2, (3, K)).astype(np.float32)
    want, got = run_both(tmp_path, result, ids, w)
    expected = np.einsum("bk,bkd->bd", (w > 1).astype(np.float64), TABLE.astype(np.float64)[ids]) / K
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_segment_sum_of_flat_ids_scaled_by_several_factors_is_a_bag(tmp_path):
    """segment_sum(gather(t, reshape(ids, [-1])) * reshape(w, [-1, 1]) * 2.0, seg) found no site: the sparse
    matchers take one multiplier only, and the flattened-rows matcher took rows reshaped after the gather only."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.math.segment_sum(
        tf.gather(m.t, tf.reshape(ids, [-1])) * tf.reshape(w, [-1, 1]) * 2.0,
        tf.repeat(tf.range(tf.shape(ids)[0]), K)))
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = RNG.integers(0, N, (3, K))
    w = RNG.uniform(-1, 2, (3, K)).astype(np.float32)
    want, got = run_both(tmp_path, result, ids, w)
    expected = np.einsum("bk,bkd->bd", 2.0 * w.astype(np.float64), TABLE.astype(np.float64)[ids])
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
