"""Rows multiplied, divided or negated more than once before a dense bag (scales.py): one weighted bag
`out[b] = sum_k w[b, k] * table[ids[b, k]]` whose weight is the product of the factors. Before, each was
reported ("Mul -> Mul between the gather and the reduction", "RealDiv ...", "Neg ...") and left
composite; now fused, computing what the original does (numpy float64 and the original SavedModel as
references, ids with repeats), and factors that do not broadcast as per-index weights are still reported."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import run_as_a_server
from round34_forms import IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, np_bags, run_both, save_and_export


def _ids(batch=6, k=K):
    ids = RNG.integers(0, N, (batch, k))
    ids[1 % batch] = ids[1 % batch, 0]  # one id repeated over a whole bag
    ids[2 % batch, :2] = 7
    return ids


def _weights(batch=6, k=K):
    return RNG.uniform(-2, 2, (batch, k)).astype(np.float32)


def _mask(batch=6, k=K):
    return (RNG.uniform(0, 1, (batch, k)) > 0.4).astype(np.float32)


# (signature, body, weights of the numpy reference from the fed arrays, divided by K afterwards)
SCALED = {
    "weights_times_mask": ([IDS, WEIGHTS, WEIGHTS],
                           lambda m, ids, w, mask: tf.reduce_sum(
                               tf.gather(m.t, ids) * w[..., None] * mask[..., None], 1),
                           lambda w, mask: w * mask, False),
    "mask_cast_times_weights": ([IDS, WEIGHTS, WEIGHTS],
                                lambda m, ids, w, mask: tf.reduce_sum(
                                    tf.gather(m.t, ids) * tf.cast(mask > 0, tf.float32)[..., None] * w[:, :, None], 1),
                                lambda w, mask: w * (mask > 0), False),
    "divided_by_k": ([IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids) / K, 1), lambda: 1.0 / K, False),
    "divided_by_read_k": ([IDS], lambda m, ids: tf.reduce_sum(
        tf.gather(m.t, ids) / tf.cast(tf.shape(ids)[-1], tf.float32), 1), lambda: None, False),
    "negated": ([IDS], lambda m, ids: tf.reduce_sum(-tf.gather(m.t, ids), 1), lambda: -1.0, False),
    "negated_mean": ([IDS], lambda m, ids: tf.reduce_mean(-tf.gather(m.t, ids), 1), lambda: -1.0, True),
    "halved_weighted_mean": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_mean(
        tf.gather(m.t, ids) * w[..., None] * 0.5, axis=-2), lambda w: 0.5 * w, True),
    "negated_weights_over_positional": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        -(tf.gather(m.t, ids) * w[..., None]) / m.v[:, None], 1), lambda w: -w / POSITION_WEIGHTS, False),
    "divided_by_weights": ([IDS, WEIGHTS], lambda m, ids, d: tf.reduce_sum(
        tf.gather(m.t, ids) / tf.expand_dims(d, -1), 1), lambda d: 1 / d.astype(np.float64), False),
    "three_multipliers": ([IDS, WEIGHTS, WEIGHTS], lambda m, ids, w, mask: tf.reduce_sum(
        mask[..., None] * (w[..., None] * (2.0 * tf.gather(m.t, ids))), 1), lambda w, mask: 2 * w * mask, False),
    # a second factor per bag ([B, 1], broadcast to the ids): reported as "not per-index" before round 38
    "factor_per_bag": ([IDS, WEIGHTS, WEIGHTS], lambda m, ids, w, mask: tf.reduce_sum(
        tf.gather(m.t, ids) * w[..., None] * mask[:, :1, None], 1), lambda w, mask: w * mask[:, :1], False),
}


@pytest.mark.parametrize("form", sorted(SCALED))
def test_rows_scaled_several_times_are_fused_as_one_weighted_bag(tmp_path, form):
    specs, body, reference_weights, mean = SCALED[form]
    result = save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert (site.status, site.weighted) == ("fused", True), site.reason
    ids = _ids()
    fed = [(_weights() if "divided_by_weights" not in form else RNG.uniform(0.5, 2, (6, K)).astype(np.float32)),
           _mask()][:len(specs) - 1]
    weights = reference_weights(*fed)
    weights = 1.0 / K if weights is None else weights
    expected = np_bags(ids, np.asarray(weights, np.float64)) / (K if mean else 1)
    want, got = run_both(tmp_path, result, ids, *fed)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_two_multipliers_broadcast_as_the_original_when_a_server_feeds_other_shapes(tmp_path):
    """A server feeds any shape: weights [B, 1] (one per bag) with a mask [B, K] multiply as the composite's
    rows * w * mask broadcast them; a mask of another width is refused by both."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, WEIGHTS], SCALED["weights_times_mask"][1])
    ids, mask = _ids(), _mask()
    per_bag = _weights(6, 1)
    feed = {"args_0": ids, "args_1": per_bag, "args_2": mask}
    expected = np_bags(ids, per_bag.astype(np.float64) * mask)
    for model in (tmp_path / "m", result.dst):
        np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(tf.errors.InvalidArgumentError):
            run_as_a_server(model, "serving_default", {**feed, "args_2": _mask(6, K + 2)})


NOT_BAGS_OF_ONE_WEIGHT = {
    # a second factor per feature ([D]): not a per-index weight
    "factor_per_feature": (lambda m, ids, w, mask: tf.reduce_sum(
        tf.gather(m.t, ids) * w[..., None] * tf.ones([4]) * mask[0, 0], 1), "not per-index"),
    "over_the_batch": (lambda m, ids, w, mask: tf.reduce_sum(-(tf.gather(m.t, ids) * w[..., None]), 0),
                       "not the bag axis"),
}


@pytest.mark.parametrize("form", sorted(NOT_BAGS_OF_ONE_WEIGHT))
def test_factors_that_are_no_per_index_weight_stay_reported(tmp_path, form):
    body, reason = NOT_BAGS_OF_ONE_WEIGHT[form]
    result = save_and_export(tmp_path, [IDS, WEIGHTS, WEIGHTS], body)
    [site] = result.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    ids, w, mask = _ids(), _weights(), _mask()
    want, got = run_both(tmp_path, result, ids, w, mask)
    np.testing.assert_array_equal(got, want)


def test_max_of_negated_rows_is_reported(tmp_path):
    """reduce_max(-rows) is -min(rows): the op's max of rows times a weight is not it."""
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.reduce_max(-tf.gather(m.t, ids), 1))
    [site] = result.sites
    assert site.status == "skipped" and "max of weighted rows" in site.reason


def test_factor_fed_at_run_time_in_a_lower_rank_is_reported(tmp_path):
    """A [K] factor from a signature input: a server may feed it as [1] or [K + 2], where the original
    multiplies by rules the broadcast to the ids does not follow (as for single weights)."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, tf.TensorSpec([K], tf.float32)],
                             lambda m, ids, w, v: tf.reduce_sum(tf.gather(m.t, ids) * w[..., None] * v[:, None], 1))
    [site] = result.sites
    assert site.status == "skipped" and "fed at run time" in site.reason, site.reason


def test_half_table_scaled_rows_convert_to_tflite(tmp_path):
    """The folded weight of a float16 table is built in float32 and cast (TFLite has no half DIV)."""
    from pkm_serve import tflite
    table = TABLE.astype(np.float16)
    lite = str(tmp_path / "m.tflite")
    result = save_and_export(tmp_path, [IDS, tf.TensorSpec([None, K], tf.float16)], lambda m, ids, w: tf.reduce_sum(
        -tf.gather(m.t, ids) * w[..., None] / 4.0, 1), table=table, tflite=lite)
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids, w = _ids(), _weights().astype(np.float16)
    expected = np.einsum("bk,bkd->bd", -w.astype(np.float64) / 4, table.astype(np.float64)[ids])
    want, got = run_both(tmp_path, result, ids, w)
    from_lite = tflite.run_tflite(lite, {"args_0": ids, "args_1": w}, interpreter="litert")[0]
    for out in (want, got, from_lite):
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2e-2, atol=2e-2)


def _zeros_like_other(m, ids, w):
    return tf.zeros_like(tf.gather(m.t, ids[:, ::-1]))


WHERE_FILLS = {
    "zeros_like_other_rows": _zeros_like_other,
    "zeros_of_shape_of_other": lambda m, ids, w: tf.zeros(tf.shape(tf.gather(m.t, ids[:, ::-1]))),
    "zeros_like_weights_expanded": lambda m, ids, w: tf.zeros_like(w[..., None]),
}


@pytest.mark.parametrize("form", sorted(WHERE_FILLS))
def test_where_filled_with_zeros_shaped_like_another_tensor_is_a_masked_bag(tmp_path, form):
    """tf.where(m, rows, tf.zeros_like(other)) was reported ("fills masked rows with something other than
    a constant 0"); the fill is zeros, so the bag is that of the mask as a 0/1 weight."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        tf.where((w > 0)[..., None], tf.gather(m.t, ids), WHERE_FILLS[form](m, ids, w)), 1))
    [site] = result.sites
    assert (site.status, site.masked) == ("fused", True), site.reason
    ids, w = _ids(), _weights()
    expected = np_bags(ids, (w > 0).astype(np.float64))
    want, got = run_both(tmp_path, result, ids, w)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_where_fill_of_a_larger_fed_shape_repeats_rows_as_the_original(tmp_path):
    """A fill shaped like another input: fed with more bags than the ids (a server feeds any shape), the
    composite's select repeats the one bag of ids; the fused bag broadcasts the ids likewise."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, WEIGHTS], lambda m, ids, w, other: tf.reduce_sum(
        tf.where((w > 0)[..., None], tf.gather(m.t, ids), tf.zeros_like(other[..., None])), 1))
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids, w, other = _ids(1), _weights(1), _weights(4)
    expected = np.repeat(np_bags(ids, (w > 0).astype(np.float64)), 4, axis=0)
    for model in (tmp_path / "m", result.dst):
        out = run_as_a_server(model, "serving_default", {"args_0": ids, "args_1": w, "args_2": other})
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(tf.errors.InvalidArgumentError):  # fills that do not broadcast are refused by both
            run_as_a_server(model, "serving_default", {"args_0": _ids(), "args_1": _weights(), "args_2": other})


def test_where_fill_that_may_broadcast_the_rows_width_is_reported(tmp_path):
    result = save_and_export(tmp_path, [IDS, WEIGHTS, tf.TensorSpec([None, K, None], tf.float32)],
                             lambda m, ids, w, other: tf.reduce_sum(
                                 tf.where((w > 0)[..., None], tf.gather(m.t, ids), tf.zeros_like(other)), 1))
    [site] = result.sites
    assert site.status == "skipped" and "last axis may broadcast the rows' width" in site.reason, site.reason
