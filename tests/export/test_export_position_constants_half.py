"""A sum of positions rows[:, k] * w[:, k:k+1] * c of a float16 table folds w * c into the op's one float16
weight, which passes 65504 (inf) where each step of the composite stays finite (w = 300, c = 300, rows ~1e-3):
the fused model gave inf/NaN. As for the dense form (scales.py), such a site is now reported; a constant
of magnitude <= 1 is still fused."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import K, TABLE, run_both, save_and_export

SMALL_ROWS = (TABLE * 1e-3).astype(np.float16)
IDS = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
SPECS = [tf.TensorSpec([None, K], tf.int64), tf.TensorSpec([None, K], tf.float16)]


def _positions(c):
    return lambda m, ids, w: tf.cast(tf.add_n([tf.gather(m.t, ids[:, k]) * w[:, k:k + 1] * tf.constant(c, tf.float16)
                                               for k in range(K)]), tf.float32)


def _reference(w, c):
    return np.einsum("bk,bkd->bd", w.astype(np.float64) * c, SMALL_ROWS.astype(np.float64)[IDS])


@pytest.mark.parametrize("c, status", [(300.0, "skipped"), (0.5, "fused")])
def test_float16_positions_scaled_by_a_weight_and_a_constant(tmp_path, c, status):
    w = np.full(IDS.shape, 300.0, np.float16)
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=IDS, args_1=w)  # verification on inputs where w * c passes 65504
    result = save_and_export(tmp_path, SPECS, _positions(c), table=SMALL_ROWS, sample_inputs=sample)
    [site] = result.sites
    assert site.status == status, site.reason
    if status == "skipped":
        assert "65504" in site.reason, site.reason
    want, got = run_both(tmp_path, result, IDS, w)
    expected = _reference(w, c)
    atol = 1e-2 * np.abs(expected).max()  # float16 rounding of each term, near-cancelling sums
    np.testing.assert_allclose(want, expected, rtol=1e-2, atol=atol)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=atol)
