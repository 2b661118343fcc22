"""tf.math.multiply_no_nan(rows, w) is 0 wherever w is 0, an inf or NaN table entry included; the fused op's
w * row is NaN there. The fused site makes ids of zero weight padding, so every combiner the site can take
(a sum, a mean dividing by K, a ragged mean dividing by the weights' sum, segment sums) gives the original's
bag; multipliers or divisors after it that could turn the composite's 0 into NaN keep the site composite.
References: the original SavedModel and numpy float64 (a zero-weight entry adds exactly 0). The cases without
a .tflite are signatures of one SavedModel, exported once for the module (case_signatures.py)."""
import numpy as np
import pytest
import tensorflow as tf

from case_signatures import exported_bodies
from round34_forms import IDS, K, POSITION_WEIGHTS, TABLE, WEIGHTS, save_and_export

NON_FINITE = TABLE.copy()
NON_FINITE[3] = np.inf
NON_FINITE[4, 1] = np.nan
NON_FINITE[5, 0] = -np.inf
IDS_AT = np.array([[3, 4, 5, 6, 7], [1, 2, 3, 4, 8], [3, 3, 3, 3, 3], [9, 4, 10, 5, 12]])
W_AT = np.ones(IDS_AT.shape, np.float32)
W_AT[0, :3], W_AT[1, 2:4], W_AT[2], W_AT[3, [1, 3]] = 0.0, 0.0, 0.0, 0.0  # every non-finite row at weight 0
W_AT[0, 3:] = [0.5, 2.0]
W_AT[3, 0] = -1.5


def _no_nan_bags(ids, w):
    """sum_k multiply_no_nan(table[ids[b, k]], w[b, k]) in float64."""
    rows = NON_FINITE.astype(np.float64)[ids]
    zero = (w == 0)[..., None]
    return np.where(zero, 0.0, rows * np.where(zero, 1.0, w[..., None].astype(np.float64))).sum(1)  # no 0 * inf


def _flat_rows(m, ids):
    return tf.reshape(tf.gather(m.t, ids), [-1, 4])


def _segments(ids):
    return tf.repeat(tf.range(tf.shape(ids)[0]), K)


DENSE = {  # body, the float64 bag of (ids, w)
    "sum": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1),
            _no_nan_bags),
    "mean": (lambda m, ids, w: tf.reduce_mean(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1),
             lambda ids, w: _no_nan_bags(ids, w) / K),
    "scaled_after": (lambda m, ids, w: tf.reduce_sum(
        tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]) * 0.5, 1), lambda ids, w: _no_nan_bags(ids, w) / 2),
    "divided_by_k": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]) /
                                                     tf.cast(tf.shape(ids)[-1], tf.float32), 1),
                     lambda ids, w: _no_nan_bags(ids, w) / K),
    "masked_after": (lambda m, ids, w: tf.reduce_sum(tf.where(
        (ids != 9)[..., None], tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 0.0), 1),
        lambda ids, w: _no_nan_bags(ids, w * (ids != 9))),
    "segment_sum": (lambda m, ids, w: tf.math.segment_sum(tf.math.multiply_no_nan(
        _flat_rows(m, ids), tf.reshape(w, [-1, 1])), _segments(ids)), _no_nan_bags),
    "unsorted_segment_sum": (lambda m, ids, w: tf.math.unsorted_segment_sum(tf.math.multiply_no_nan(
        _flat_rows(m, ids), tf.reshape(w, [-1, 1])), _segments(ids), tf.shape(ids)[0]), _no_nan_bags),
    "zero_scalar_weight": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(
        tf.gather(m.t, ids), m.v[0] * 0.0), 1) + tf.reduce_sum(w, 1, keepdims=True) * 0.0,
        lambda ids, w: np.zeros((len(ids), 4))),
}


@pytest.mark.parametrize("form", sorted(DENSE))
def test_zero_weights_of_multiply_no_nan_hide_non_finite_rows_in_the_fused_bag(cases, form):
    """Before: NaN in every bag holding an inf/NaN row at weight 0 (the zero scalar weight failed the export's
    own verification), where the original gives the finite bag."""
    _, reference = DENSE[form]
    case = cases(f"dense_{form}")
    assert [s.status for s in case.sites] == ["fused"], [s.reason for s in case.sites]
    want, got = case.run_both(IDS_AT, W_AT)
    expected = reference(IDS_AT, W_AT)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_ragged_multiply_no_nan_zero_weights_hide_non_finite_rows(cases, combiner):
    """A ragged mean is fused as the op's mean (the weights' sum divides): a padded zero weight adds nothing."""
    case = cases(f"ragged_{combiner}")
    assert [s.status for s in case.sites] == ["fused"], [s.reason for s in case.sites]
    rt, rw = tf.RaggedTensor.from_tensor(IDS_AT), tf.RaggedTensor.from_tensor(W_AT)
    inputs = {"args_0": rt.values, "args_0_1": rt.row_splits, "args_1": rw.values, "args_1_1": rw.row_splits}
    expected = _no_nan_bags(IDS_AT, W_AT) / (1 if combiner == "sum" else K)
    for model in (case.original, case.fused):
        out = model(**inputs)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_multiply_no_nan_zero_weights_in_the_tflite(tmp_path):
    from pkm_serve import tflite
    lite, sample = str(tmp_path / "m.tflite"), str(tmp_path / "sample.npz")
    np.savez(sample, args_0=IDS_AT, args_1=W_AT)  # random ids would meet the inf rows at nonzero weights
    result = save_and_export(tmp_path, [IDS, WEIGHTS], DENSE["mean"][0], table=NON_FINITE, tflite=lite,
                             sample_inputs=sample)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    runner = tflite.make_interpreter(lite).get_signature_runner("serving_default")
    got = runner(args_0=IDS_AT, args_1=W_AT)["out"]
    np.testing.assert_allclose(got, _no_nan_bags(IDS_AT, W_AT) / K, rtol=1e-5, atol=1e-6)


STAYS = {  # a step after multiply_no_nan that makes the composite's 0 NaN: (body, words of the reason)
    "times_a_fed_weight": (lambda m, ids, w: tf.reduce_sum(
        tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]) * w[..., None], 1), "may be inf or NaN"),
}


@pytest.mark.parametrize("form", sorted(STAYS))
def test_multiply_no_nan_sites_that_padding_would_change_stay_composite(cases, form):
    """multiply_no_nan(rows, w) * w: the composite's 0 * inf is NaN, padding would leave it out. Before: fused,
    NaN where the original is finite. (Per position, now fused with the padding: test_export_no_nan_positions.)"""
    _, words = STAYS[form]
    case = cases(f"stays_{form}")
    [site] = case.sites
    assert site.status == "skipped" and words in site.reason, site.reason
    want, got = case.run_both(IDS_AT, W_AT)
    np.testing.assert_array_equal(got, want)
    w = W_AT.astype(np.float64)
    expected = _no_nan_bags(IDS_AT, W_AT * W_AT) if form == "times_a_fed_weight" else _no_nan_bags(IDS_AT, w)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position", [-1, 2])
def test_running_sum_of_multiply_no_nan_rows(cases, position):
    """cumsum(multiply_no_nan(rows, w), 1)[:, -1] is the bag (fused, zero weights padding); [:, 2] reads a span of
    positions, whose ids are sliced where the padding's mask was not: the fused model failed to load."""
    case = cases(f"running_sum_at_{position}".replace("-", "minus_"))
    [site] = case.sites
    assert site.status == ("fused" if position == -1 else "skipped"), site.reason
    want, got = case.run_both(IDS_AT, W_AT)
    stop = K if position == -1 else position + 1
    expected = _no_nan_bags(IDS_AT[:, :stop], W_AT[:, :stop])
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def _running_sum_at(position):
    return lambda m, ids, w: tf.cumsum(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), axis=1)[:, position]


RAGGED = [tf.RaggedTensorSpec([None, None], tf.int64), tf.RaggedTensorSpec([None, None], tf.float32)]
# The module's SavedModel (table NON_FINITE): {signature: (specs, body(module, *inputs))}, exported once.
CASES = {
    **{f"dense_{form}": ([IDS, WEIGHTS], body) for form, (body, _) in DENSE.items()},
    **{f"ragged_{combiner}": (RAGGED, lambda m, rt, rw, reduce=reduce: reduce(
        tf.math.multiply_no_nan(tf.gather(m.t, rt), rw[..., None]), 1))
       for combiner, reduce in (("sum", tf.reduce_sum), ("mean", tf.reduce_mean))},
    **{f"stays_{form}": ([IDS, WEIGHTS], body) for form, (body, _) in STAYS.items()},
    **{f"running_sum_at_{position}".replace("-", "minus_"): ([IDS, WEIGHTS], _running_sum_at(position))
       for position in (-1, 2)},
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return exported_bodies(tmp_path_factory.mktemp("no_nan_zero_weights") / "forms", {"t": NON_FINITE, "v": POSITION_WEIGHTS}, CASES)
