"""A bag written one position at a time with tf.math.multiply_no_nan: tf.add_n([multiply_no_nan(tf.gather(t,
ids[:, k]), w[:, k:k+1]) for k]). It was reported though multiply_no_nan of the rows of every position is
fused: the ids whose weight is 0 are padding (the composite's entry is 0 there even for an inf table entry,
where w * row would be NaN). Now fused alike; a sum mixing such terms with plain products stays reported.
One export of one model (a table row holding inf) holding the three sites."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, RNG, TABLE, WEIGHTS, save_and_export

INF_ROW = 7
INF_TABLE = TABLE.copy()
INF_TABLE[INF_ROW, 1] = np.inf


def _term(m, ids, w, k):
    return tf.math.multiply_no_nan(tf.gather(m.t, ids[:, k]), w[:, k:k + 1])


FORMS = {  # name: (body, positions summed, reported)
    "every_position": (lambda m, ids, w: tf.add_n([_term(m, ids, w, k) for k in range(K)]), range(K), False),
    "positions_1_to_3": (lambda m, ids, w: _term(m, ids, w, 1) + _term(m, ids, w, 2) + _term(m, ids, w, 3),
                         range(1, 4), False),
    "mixed_with_a_plain_product": (lambda m, ids, w: tf.add_n(
        [_term(m, ids, w, 0), tf.gather(m.t, ids[:, 1]) * w[:, 1:2]]), range(2), True),
}


def _no_nan_bag(ids, w, positions):
    """sum over the positions of multiply_no_nan(row, w) in float64: 0 where w is 0, whatever the row."""
    rows = INF_TABLE.astype(np.float64)[ids[:, positions]]
    weights = w[:, positions, None].astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(weights == 0, 0.0, rows * weights).sum(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("no_nan_positions")
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.concat(
        [body(m, ids, w) for body, _, _ in FORMS.values()], 1), table=INF_TABLE)
    ids = RNG.integers(0, N, (4, K))
    ids[ids == INF_ROW] = 0
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    ids[0, 2], w[0, 2] = INF_ROW, 0.0  # inf * 0: the composite's multiply_no_nan gives 0
    ids[1, 0], w[1, 0] = INF_ROW, 0.0
    w[2, 3] = 0.0
    inputs = {"args_0": ids, "args_1": w}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    return result, original, fused, ids, w


def test_multiply_no_nan_positions_are_fused_and_mixed_ones_reported(exported):
    result = exported[0]
    assert [(s.status, s.pattern) for s in result.sites] == [
        ("skipped" if reported else "fused", "per-position-sum") for _, _, reported in FORMS.values()], \
        [s.reason for s in result.sites]
    assert "some plain or scaled products" in result.sites[2].reason


@pytest.mark.parametrize("form", list(FORMS))
def test_multiply_no_nan_positions_compute_the_original(exported, form):
    _, original, fused, ids, w = exported
    width = TABLE.shape[1]
    start = list(FORMS).index(form) * width
    _, positions, reported = FORMS[form]
    got, want = fused[:, start:start + width], original[:, start:start + width]
    if not reported:
        np.testing.assert_allclose(got, _no_nan_bag(ids, w, list(positions)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(want).all()
