"""Gathered rows transposed to [B, D, K] (Keras Permute((2, 1))) and then weighted before the reduction over K:
reduce_sum(tf.transpose(rows, [0, 2, 1]) * w[:, None, :], -1) is the bag of the rows weighted by w. It was
reported ("a multiplier or mask applied after the transpose is not fused"); a weight per position ([..., 1, K],
either operand first, per request or shared) or a scalar is now fused; a multiplier per feature, or rows
weighted before and after the transpose, stay reported. One export of one model holding every site."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, save_and_export

D = TABLE.shape[1]
FEATURE_SCALES = np.arange(1, D + 1, dtype=np.float32)


def _t(m, ids):
    return tf.transpose(tf.gather(m.t, ids), [0, 2, 1])


FORMS = {  # name: (body of (module, ids, w), numpy float64 of (rows [B, K, D], w), fused)
    "weighted_sum": (lambda m, i, w: tf.reduce_sum(_t(m, i) * w[:, None, :], -1),
                     lambda rows, w: np.einsum("bk,bkd->bd", w, rows), True),
    "weighted_mean": (lambda m, i, w: tf.reduce_mean(_t(m, i) * w[:, None, :], 2),
                      lambda rows, w: np.einsum("bk,bkd->bd", w, rows) / K, True),
    "weights_first": (lambda m, i, w: tf.reduce_sum(tf.expand_dims(w, 1) * _t(m, i), -1),
                      lambda rows, w: np.einsum("bk,bkd->bd", w, rows), True),
    "scalar": (lambda m, i, w: tf.reduce_sum(_t(m, i) * 2.5, -1), lambda rows, w: rows.sum(1) * 2.5, True),
    "shared_positional": (lambda m, i, w: tf.reduce_sum(_t(m, i) * m.v[None, None, :], -1),
                          lambda rows, w: np.einsum("k,bkd->bd", POSITION_WEIGHTS.astype(np.float64), rows), True),
    "per_feature": (lambda m, i, w: tf.reduce_sum(_t(m, i) * FEATURE_SCALES[None, :, None], -1),
                    lambda rows, w: rows.sum(1) * FEATURE_SCALES, False),
    "before_and_after": (lambda m, i, w: tf.reduce_sum(tf.transpose(tf.gather(m.t, i) * w[..., None], [0, 2, 1])
                                                       * w[:, None, :], -1),
                         lambda rows, w: np.einsum("bk,bkd->bd", w * w, rows), False),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("transposed_weighted")
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, i, w: tf.concat(
        [body(m, i, w) for body, _, _ in FORMS.values()], 1))
    ids = RNG.integers(0, N, (4, K))
    w = RNG.uniform(-2, 2, ids.shape).astype(np.float32)
    inputs = {"args_0": ids, "args_1": w}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    return result, original, fused, TABLE.astype(np.float64)[ids], w.astype(np.float64)


def test_rows_weighted_after_the_transpose_are_fused_per_position_only(exported):
    result = exported[0]
    assert [s.status == "fused" for s in result.sites] == [fused for _, _, fused in FORMS.values()], \
        [s.reason for s in result.sites]
    assert all(s.weighted for s in result.sites if s.status == "fused")
    assert "per feature" in result.sites[-2].reason and "before and after" in result.sites[-1].reason


@pytest.mark.parametrize("form", list(FORMS))
def test_rows_weighted_after_the_transpose_compute_the_bag(exported, form):
    _, original, fused, rows, w = exported
    start = list(FORMS).index(form) * D
    expected = FORMS[form][1](rows, w)
    np.testing.assert_allclose(original[:, start:start + D], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[:, start:start + D], expected, rtol=1e-5, atol=1e-5)
