"""Round-34 bag forms (test_export_forms_round34.py has the rest): positional weights as a matmul,
tf.tensordot of per-field rows, reductions over the bag axis and the axes before it: fused and computing
what the original does, or reported and left as written."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import (D, FIELD_IDS, FIELDS, IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, np_bags,
                           random_ids, run_both, save_and_export)


MATMUL_POSITION_WEIGHTS = {
    "unit_axes_by_slice": lambda m, rows: tf.matmul(m.v[None, None, :], rows),
    "one_unit_axis": lambda m, rows: tf.matmul(m.v[None, :], rows),
    "expand_dims_twice": lambda m, rows: tf.matmul(tf.expand_dims(tf.expand_dims(m.v, 0), 0), rows),
    "reshaped_constant": lambda m, rows: tf.matmul(tf.reshape(tf.constant(POSITION_WEIGHTS), [1, 1, K]), rows),
    "squeezed": lambda m, rows: tf.squeeze(tf.matmul(m.v[None, None, :], rows), 1),
}


@pytest.mark.parametrize("form", sorted(MATMUL_POSITION_WEIGHTS))
def test_matmul_of_positional_weights_by_the_rows_is_a_weighted_bag(tmp_path, form):
    """tf.matmul(v[None, None, :], rows) weighs position k of every bag by v[k]: it was reported
    ('not w[..., None, :] @ rows'); fused with v broadcast to the ids, its unit axis kept."""
    result = save_and_export(tmp_path, [IDS], lambda m, ids: MATMUL_POSITION_WEIGHTS[form](m, tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "matmul", True), site.reason
    for batch in (1, 4):
        ids = random_ids(batch)
        want, got = run_both(tmp_path, result, ids)
        expected = np_bags(ids, POSITION_WEIGHTS)
        expected = expected if form == "squeezed" else expected[:, None]
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_matmul_of_weights_broadcast_to_a_batch_of_their_own_is_a_broadcast_bag(tmp_path):
    """broadcast_to(v, [tf.shape(x)[0], 1, K]) @ rows: weights [B', 1, K] of any making (here of another
    input's batch) weigh bag b's position k by their [b, 0, k], the batch axes broadcast as the matmul
    broadcasts them. It was reported; now fused, the ids broadcast against the weights read as [B', K]:
    ids of one bag give B' copies, as the original, and batches that do not broadcast are refused by both."""
    other = tf.TensorSpec([None], tf.float32)
    result = save_and_export(tmp_path, [IDS, other], lambda m, ids, x: tf.matmul(
        tf.broadcast_to(m.v[None, None, :], [tf.shape(x)[0], 1, K]), tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.weighted) == ("fused", True), site.reason
    for batch, copies in ((1, 3), (4, 4)):
        ids, x = random_ids(batch), np.zeros([copies], np.float32)
        want, got = run_both(tmp_path, result, ids, x)
        expected = np.broadcast_to(np_bags(ids, POSITION_WEIGHTS)[:, None], (copies, 1, D))
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for model in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf.saved_model.load(str(model)).signatures["serving_default"](
                args_0=random_ids(4), args_1=np.zeros([3], np.float32))


FIELD_TENSORDOTS = {
    "rows_first": lambda m, rows: tf.tensordot(rows, m.v, axes=[[2], [0]]),
    "weights_first": lambda m, rows: tf.tensordot(m.v, rows, axes=[[0], [2]]),
    "negative_axis": lambda m, rows: tf.tensordot(rows, tf.constant(POSITION_WEIGHTS), axes=[[-2], [0]]),
}


@pytest.mark.parametrize("form", sorted(FIELD_TENSORDOTS))
def test_tensordot_of_per_field_rows_over_the_bag_axis_is_a_bag_per_field(tmp_path, form):
    """tf.tensordot(rows [B, F, K, D], v [K], axes=[[2], [0]]) is each field's bag weighted by v (as
    einsum('bfkd,k->bfd') is, which was fused): it was reported ('not tensordot(rows [B, K, D], ...')."""
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: FIELD_TENSORDOTS[form](m, tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "tensordot", True), site.reason
    ids = RNG.integers(0, N, (4, FIELDS, K))
    want, got = run_both(tmp_path, result, ids)
    expected = np_bags(ids.reshape(-1, K), POSITION_WEIGHTS).reshape(4, FIELDS, D)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_tensordot_of_per_request_weights_by_the_rows_is_reported(tmp_path):
    """tf.tensordot(w [B, K], rows [B, K, D], axes=[[1], [1]]) is [B, B, D] (each request's weights
    against every request's rows): no bag, reported and left as written."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.tensordot(
        w, tf.gather(m.t, ids), axes=[[1], [1]]))
    [site] = result.sites
    assert site.status == "skipped" and "tf.tensordot of gathered rows" in site.reason, site.reason
    ids, w = random_ids(3), RNG.uniform(0.5, 2, (3, K)).astype(np.float32)
    want, got = run_both(tmp_path, result, ids, w)
    assert want.shape == (3, 3, D)
    np.testing.assert_array_equal(got, want)


def test_matmul_of_per_field_weights_given_a_leading_unit_axis_keeps_their_alignment(tmp_path):
    """expand_dims(S [F, 1, K], 0) @ rows [B, F, K, D] weighs field f by S[f]; with B == F static, S
    broadcast to the ids as they align from the right would weigh request b by S[b] instead. Such weights
    were reported; now read as [1, F, K] (the matmul's operand less axis -2, of the ids' rank), which
    aligns field f with S[f] as the matmul does, and fused."""
    per_field = RNG.uniform(0.5, 2, (FIELDS, 1, K)).astype(np.float32)
    result = save_and_export(tmp_path, [tf.TensorSpec([FIELDS, FIELDS, K], tf.int64)], lambda m, ids: tf.matmul(
        tf.expand_dims(tf.constant(per_field), 0), tf.gather(m.t, ids)))
    ids = RNG.integers(0, N, (FIELDS, FIELDS, K))
    expected = np.einsum("fk,bfkd->bfd", per_field[:, 0].astype(np.float64), TABLE.astype(np.float64)[ids])
    want, got = run_both(tmp_path, result, ids)
    np.testing.assert_allclose(want[:, :, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, :, 0], expected, rtol=1e-5, atol=1e-6)
    assert [s.status for s in result.sites] == ["fused"]


FLAT_BAGS = {  # (specs, body, combiner of numpy, weighted)
    "sum_over_fields_and_positions": ([FIELD_IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), [1, 2]),
                                      "sum", False),
    "mean_negative_axes": ([FIELD_IDS], lambda m, ids: tf.reduce_mean(tf.gather(m.t, ids), [-3, -2]), "mean", False),
    "max_axes_unordered": ([FIELD_IDS], lambda m, ids: tf.reduce_max(tf.gather(m.t, ids), [2, 1]), "max", False),
    "weighted_mean": ([FIELD_IDS, tf.TensorSpec([None, FIELDS, K], tf.float32)], lambda m, ids, w: tf.reduce_mean(
        tf.gather(m.t, ids) * w[..., None], [1, 2]), "mean", True),
    "einsum": ([FIELD_IDS], lambda m, ids: tf.einsum("bfkd->bd", tf.gather(m.t, ids)), "sum", False),
    "einsum_weighted": ([FIELD_IDS, tf.TensorSpec([None, FIELDS, K], tf.float32)], lambda m, ids, w: tf.einsum(
        "bfk,bfkd->bd", w, tf.gather(m.t, ids)), "sum", True),
}


def _flat_reference(ids, weights, combiner):
    flat = ids.reshape(ids.shape[0], -1)
    rows = TABLE.astype(np.float64)[flat]
    if combiner == "max":
        return rows.max(1)
    w = np.ones(flat.shape) if weights is None else weights.reshape(flat.shape).astype(np.float64)
    total = np.einsum("bk,bkd->bd", w, rows)
    return total / flat.shape[1] if combiner == "mean" else total


@pytest.mark.parametrize("form", sorted(FLAT_BAGS))
def test_reduction_over_the_bag_axis_and_the_axes_before_it_is_one_bag_of_those_ids(tmp_path, form):
    """reduce_sum(rows [B, F, K, D], axis=[1, 2]) (einsum('bfkd->bd')) pools each request's F * K rows: it was
    reported ('not over exactly one constant axis'; einsum: 'not a weighted sum over the bag axis'). Fused on
    the ids reshaped to [B, F * K] at run time: ids fed wider in either axis give the composite's bag, ids of
    another rank are refused (the composite reduces other axes)."""
    from export_models import run_as_a_server
    specs, body, combiner, weighted = FLAT_BAGS[form]
    result = save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert (site.status, site.pattern, site.computes) == (
        "fused", "einsum" if "einsum" in form else "gather-reduce", combiner), site.reason
    for shape in ((4, FIELDS, K), (2, FIELDS + 1, K + 2)):
        feed = {"args_0": RNG.integers(0, N, shape)}
        if weighted:
            feed["args_1"] = RNG.uniform(0.5, 2, shape).astype(np.float32)
        expected = _flat_reference(feed["args_0"], feed.get("args_1"), combiner)
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-6)
    other_rank = {key: value[..., None] for key, value in feed.items()}
    with pytest.raises(tf.errors.InvalidArgumentError, match="rank"):
        run_as_a_server(result.dst, "serving_default", other_rank)


@pytest.mark.parametrize("axes, keepdims, reason", [([1, 3], False, "nor over the bag axis (-2) and the axes"),
                                                    ([1, 2], True, "keepdims=True over several bag axes")])
def test_reductions_over_other_axes_or_keeping_them_are_reported(tmp_path, axes, keepdims, reason):
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(
        tf.gather(m.t, ids), axes, keepdims=keepdims))
    [site] = result.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    ids = RNG.integers(0, N, (2, FIELDS, K))
    want, got = run_both(tmp_path, result, ids)
    np.testing.assert_array_equal(got, want)


def test_unfusable_rows_reduced_over_several_bag_axes_are_reported(tmp_path):
    """reduce_sum(exp(rows), [1, 2]) is reported as reduce_sum(exp(rows), 1) is (it was silent)."""
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(tf.exp(tf.gather(m.t, ids)), [1, 2]))
    [site] = result.sites
    assert site.status == "skipped" and "Exp between the gather and the reduction" in site.reason, site.reason


def test_the_report_names_a_bag_of_several_id_axes(tmp_path):
    from pkm_serve.export.exporter import format_report
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), [1, 2]))
    [line] = [text for text in format_report(result).splitlines() if text.lstrip().startswith("fused")]
    assert "(a bag of the ids' last 2 axes)" in line, line


def test_matmul_of_unit_axes_weights_constants_by_the_rows_is_a_weighted_bag(tmp_path):
    """A [1, 1, K] (or [1, K]) constant @ rows weighs every bag's position k alike: it was reported; fused
    with the weights read as [K] and broadcast to the ids."""
    def body(m, ids):
        rows = lambda: tf.gather(m.t, ids)  # noqa: E731 (a gather per site)
        return tf.matmul(tf.constant(POSITION_WEIGHTS.reshape(1, 1, K)), rows()) + \
            tf.matmul(tf.constant(POSITION_WEIGHTS[None] * 2), rows())
    result = save_and_export(tmp_path, [IDS], body)
    assert [(s.status, s.pattern, s.weighted) for s in result.sites] == [("fused", "matmul", True)] * 2, \
        [s.reason for s in result.sites]
    ids = random_ids()
    want, got = run_both(tmp_path, result, ids)
    expected = 3 * np_bags(ids, POSITION_WEIGHTS)[:, None]
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
