"""Weighted positions taken as ids[:, k:k+1] and concatenated: past the width of the ids (or of the
weights) a position is empty, not refused, so the original sums the positions both have. The fused
span had no width check: ids of width 1 repeated position 0 weighted by v[0..K-1], narrower ids
failed where the original answers, w [B, 1] broadcast over every position. Now reported, left as
written; the unweighted concatenations stay fused (test_export_forms_round34.py)."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import run_as_a_server
from round34_forms import IDS, K, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, random_ids, save_and_export


def _rows_kept(m, ids, k):
    return tf.gather(m.t, ids[:, k:k + 1])


WEIGHTED_CONCATENATIONS = {  # (specs, body, mean)
    "gathered_times_position_weight": ([IDS], lambda m, ids: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * m.v[k] for k in range(K)], 1), 1), False),
    "sliced_rows_times_position_weight_mean": ([IDS], lambda m, ids: (lambda rows: tf.reduce_mean(tf.concat(
        [rows[:, k:k + 1] * m.v[k] for k in range(K)], 1), 1))(tf.gather(m.t, ids)), True),
    "weights_unit_axis_added": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * w[:, k:k + 1, None] for k in range(K)], 1), 1), False),
    "weights_expanded": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * tf.expand_dims(w[:, k:k + 1], -1) for k in range(K)], 1), 1), False),
}


def _expected(ids, weights, mean):
    """The original's answer in float64: the positions both ids and weights have, each weighted."""
    taken = min(K, ids.shape[1], weights.shape[-1])
    w = np.broadcast_to(weights[..., :taken], (ids.shape[0], taken)).astype(np.float64)
    total = np.einsum("bk,bkd->bd", w, TABLE.astype(np.float64)[ids[:, :taken]])
    return total / taken if mean else total


@pytest.mark.parametrize("form", sorted(WEIGHTED_CONCATENATIONS))
def test_weighted_concatenated_positions_are_reported_and_answer_as_the_original(tmp_path, form):
    specs, body, mean = WEIGHTED_CONCATENATIONS[form]
    result = save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert site.status == "skipped" and "ids[..., k:k+1]" in site.reason, (site.status, site.reason)
    feeds = [(random_ids(k=width), None) for width in (K, 3, 1)] if len(specs) == 1 else \
        [(random_ids(), RNG.uniform(0.5, 2, (4, width)).astype(np.float32)) for width in (K, 3, 1)]
    for ids, w in feeds:
        feed = {"args_0": ids} if w is None else {"args_0": ids, "args_1": w}
        expected = _expected(ids, POSITION_WEIGHTS if w is None else w, mean)
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-5)
