"""tf.math.divide_no_nan on the way from the gather to the bag reduction: reduce_sum(divide_no_nan(rows,
d[..., None]), 1) is 0 wherever d is 0, an inf row included. It was reported ("DivNoNan between the gather
and the reduction"); now fused as rows / d with the ids whose d is 0 padding (as multiply_no_nan's zero
weights are). A divide_no_nan of the bag (a mean with empty bags 0) stays outside the site; a product after
the divide_no_nan that may be inf, and divide_no_nan(d, rows), stay composite. A divisor per bag (d[:, :1, None],
a masked mean divided by the kept rows' count [B, 1]) was reported as "not per-index"; it is fused, broadcast to
the ids. A sum of positions each divided (divide_no_nan(rows[:, k], d[:, k:k+1])) and ragged rows divided by a
ragged d were not listed at all; they are reported. One export of one model (a table row holding inf) holding
every site; outputs against numpy float64 and the original."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import IDS, K, N, RNG, TABLE, WEIGHTS, save_and_export

INF_ROW = 7
INF_TABLE = TABLE.copy()
INF_TABLE[INF_ROW, 2] = np.inf
D = TABLE.shape[1]


def _rows(m, ids):
    return tf.gather(m.t, ids)


FORMS = {  # name: (body of (module, ids, w, d), fused)
    "per_index_divisor": (lambda m, i, w, d: tf.reduce_sum(tf.math.divide_no_nan(_rows(m, i), d[..., None]), 1),
                          True),
    "constant_divisor_mean": (lambda m, i, w, d: tf.reduce_mean(tf.math.divide_no_nan(_rows(m, i), 4.0), 1), True),
    "weighted_mean_of_the_bag": (lambda m, i, w, d: tf.math.divide_no_nan(
        tf.reduce_sum(_rows(m, i) * d[..., None], 1), tf.reduce_sum(d, 1, keepdims=True)), True),
    "then_times_a_fed_weight": (lambda m, i, w, d: tf.reduce_sum(
        tf.math.divide_no_nan(_rows(m, i), d[..., None]) * w[..., None], 1), False),
    "divisor_over_rows": (lambda m, i, w, d: tf.reduce_sum(tf.math.divide_no_nan(d[..., None], _rows(m, i)), 1),
                          False),
    # one divisor per bag ([B, 1]: reported as "not per-index" before round 38)
    "per_bag_divisor": (lambda m, i, w, d: tf.reduce_sum(tf.math.divide_no_nan(_rows(m, i), d[:, :1, None]), 1),
                        True),
    "masked_mean_by_bag_count": (lambda m, i, w, d: tf.reduce_sum(tf.math.divide_no_nan(
        tf.where((w > 1)[..., None], _rows(m, i), 0.0), _kept(w)[:, :, None]), 1), True),
    # neither fused nor listed before round 38; now reported
    "per_position": (lambda m, i, w, d: tf.add_n([tf.math.divide_no_nan(tf.gather(m.t, i[:, k]), d[:, k:k + 1])
                                                  for k in range(K)]), False),
    "ragged": (lambda m, i, w, d: tf.reduce_sum(tf.math.divide_no_nan(
        tf.gather(m.t, tf.ragged.boolean_mask(i, i > 0)), tf.ragged.boolean_mask(d, i > 0)[..., None]), 1), False),
}


def _kept(w):
    return tf.reduce_sum(tf.cast(w > 1, tf.float32), 1, keepdims=True)


def _references(ids, w, d):
    rows = INF_TABLE.astype(np.float64)[ids]
    d3, w3 = d[..., None].astype(np.float64), w[..., None].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        no_nan = np.where(d3 == 0, 0.0, rows / d3)
        over_rows = np.where(rows == 0, 0.0, d3 / rows)
        counts = d3.sum(1)
        weighted = (rows * d3).sum(1)
    first = d[:, :1, None].astype(np.float64)
    kept = (w > 1)[..., None]
    count = kept.sum(1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_bag = np.where(first == 0, 0.0, rows / first).sum(1)
        masked_mean = np.where(count == 0, 0.0, np.where(kept, rows, 0.0) / np.where(count == 0, 1, count)).sum(1)
    return {"per_position": no_nan.sum(1), "ragged": np.where((ids > 0)[..., None], no_nan, 0.0).sum(1),
            "per_bag_divisor": per_bag, "masked_mean_by_bag_count": masked_mean, "per_index_divisor": no_nan.sum(1), "constant_divisor_mean": (rows / 4).mean(1),
            "weighted_mean_of_the_bag": np.where(counts == 0, 0.0, weighted / np.where(counts == 0, 1, counts)),
            "then_times_a_fed_weight": (no_nan * w3).sum(1), "divisor_over_rows": over_rows.sum(1)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("divide_no_nan")
    result = save_and_export(tmp_path, [IDS, WEIGHTS, WEIGHTS], lambda m, i, w, d: tf.concat(
        [body(m, i, w, d) for body, _ in FORMS.values()], 1), table=INF_TABLE)
    ids = RNG.integers(0, N, (4, K))
    ids[ids == INF_ROW] = 0
    w, d = (RNG.uniform(0.5, 2, ids.shape).astype(np.float32) for _ in range(2))
    ids[0, 1], d[0, 1] = INF_ROW, 0.0  # inf / 0: divide_no_nan gives 0
    d[1, 3] = 0.0
    d[2] = 0.0  # an empty bag of the weighted mean: 0
    w[3] = 0.5  # no row kept: the masked mean's count 0
    ids[2] = [1, 2, 3, 4, 5]
    inputs = {"args_0": ids, "args_1": w, "args_2": d}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    return result, original, fused, _references(ids, w, d)


def test_divide_no_nan_of_rows_is_fused_with_zero_divisors_as_padding(exported):
    result = exported[0]
    statuses = [s.status == "fused" for s in result.sites if s.status == "fused" or "DivNoNan" in s.reason or
                "divide_no_nan" in s.reason]
    assert statuses == [fused for _, fused in FORMS.values()], [s.reason for s in result.sites]


@pytest.mark.parametrize("form", list(FORMS))
def test_divide_no_nan_sites_compute_the_original(exported, form):
    _, original, fused, references = exported
    start = list(FORMS).index(form) * D
    want, got = original[:, start:start + D], fused[:, start:start + D]
    np.testing.assert_allclose(want, references[form], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, references[form], rtol=1e-5, atol=1e-6)
