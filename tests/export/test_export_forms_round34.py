"""Bag forms a round-34 hunt found neither fused nor reported, reported though they are bags, or
labelled wrongly: each is fused and computes what the original does (numpy float64 and the
original SavedModel as references), or reported with its reason and left as written."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 30, 4, 5
RNG = np.random.default_rng(34)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
POSITION_WEIGHTS = RNG.uniform(0.5, 2, K).astype(np.float32)
IDS = tf.TensorSpec([None, K], tf.int64)
WEIGHTS = tf.TensorSpec([None, K], tf.float32)


def _save_and_export(tmp_path, specs, body, table=TABLE, **export_args):
    module = tf.Module()
    module.t = tf.Variable(table)
    module.v = tf.Variable(POSITION_WEIGHTS)
    f = tf.function(input_signature=specs)(lambda *args: {"out": body(module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, **export_args)


def _run_both(tmp_path, result, *args):
    inputs = {f"args_{i}": a for i, a in enumerate(args)}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    return original(**inputs)["out"].numpy(), fused(**inputs)["out"].numpy()


def _ids(batch=4, k=K):
    ids = RNG.integers(1, N, (batch, k))
    ids[0, 2:] = 0  # padding for the masked forms
    return ids


def _bags(ids, weights=None):
    """sum_k w[b, k] * table[ids[b, k]] in float64 (w: [B, K], [K] or None)."""
    w = np.ones(ids.shape) if weights is None else np.broadcast_to(weights, ids.shape)
    return np.einsum("bk,bkd->bd", w.astype(np.float64), TABLE.astype(np.float64)[ids])


def _mask(ids):
    return tf.cast(tf.not_equal(ids, 0), tf.float32)


MASK_TWICE = {
    "one_expression_twice": lambda rows, ids: tf.reduce_sum(rows * _mask(ids)[..., None], 1) /
    tf.reduce_sum(_mask(ids), 1, keepdims=True),
    "div_no_nan": lambda rows, ids: tf.math.divide_no_nan(tf.reduce_sum(rows * _mask(ids)[..., None], 1),
                                                          tf.reduce_sum(_mask(ids), 1)[:, None]),
    "where_mask": lambda rows, ids: tf.reduce_sum(tf.where((ids > 0)[..., None], rows, 0.0), 1) /
    tf.reduce_sum(tf.cast(ids > 0, tf.float32), 1, keepdims=True),
}


@pytest.mark.parametrize("form", sorted(MASK_TWICE))
def test_masked_mean_with_its_mask_computed_twice_is_labelled_a_masked_mean(tmp_path, form):
    """sum(rows * m) / sum(m) where m is computed once for the rows and again for the count was
    labelled 'sum' (the two masks were told apart by node, not by value)."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: MASK_TWICE[form](tf.gather(m.t, ids), ids))
    [site] = result.sites
    assert (site.status, site.computes) == ("fused", "masked mean"), site.reason
    ids = _ids()
    keep = (ids != 0).astype(np.float64)
    want, got = _run_both(tmp_path, result, ids)
    expected = _bags(ids, keep) / keep.sum(1, keepdims=True)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_masks_that_differ_are_not_a_masked_mean(tmp_path):
    """The count of another mask (ids > 1 against ids > 0) leaves the bag a sum divided by something."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: tf.reduce_sum(
        tf.gather(m.t, ids) * _mask(ids)[..., None], 1) / (1.0 + tf.reduce_sum(
            tf.cast(ids > 1, tf.float32), 1, keepdims=True)))
    [site] = result.sites
    assert (site.status, site.computes) == ("fused", "sum")


def test_half_masked_mean_with_its_mask_computed_twice_converts_to_tflite(tmp_path):
    """A float16 masked mean's count and division are moved to float32 for TFLite (which has no half
    SUM / DIV) only when the site is labelled a masked mean: with its mask computed twice it was
    not, and --tflite failed."""
    from pkm_serve import tflite

    def body(m, ids):
        half_mask = lambda: tf.cast(tf.not_equal(ids, 0), tf.float16)  # noqa: E731
        return tf.reduce_sum(tf.gather(m.t, ids) * half_mask()[..., None], 1) / \
            tf.reduce_sum(half_mask(), 1, keepdims=True)
    lite = str(tmp_path / "m.tflite")
    result = _save_and_export(tmp_path, [IDS], body, table=TABLE.astype(np.float16), tflite=lite)
    [site] = result.sites
    assert (site.status, site.computes) == ("fused", "masked mean")
    ids = _ids()
    keep = (ids != 0).astype(np.float64)
    expected = np.einsum("bk,bkd->bd", keep, TABLE.astype(np.float16).astype(np.float64)[ids]) / \
        keep.sum(1, keepdims=True)
    want, got = _run_both(tmp_path, result, ids)
    from_lite = tflite.run_tflite(lite, {"args_0": ids}, interpreter="litert")[0]
    for out in (want, got, from_lite):
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-2, atol=1e-2)


CUMSUM_ENDS = {  # (body, stop: the bag is ids[:, :stop])
    "declared_last": (lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, K - 1], K),
    "inner_position": (lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=-2)[:, 2], 3),
    "weighted": (lambda m, ids, w: tf.math.cumsum(tf.gather(m.t, ids) * w[..., None], axis=1)[:, K - 1], K),
}


@pytest.mark.parametrize("form", sorted(CUMSUM_ENDS))
def test_running_sum_read_at_a_position_from_the_start_is_the_bag_of_the_positions_up_to_it(tmp_path, form):
    """tf.math.cumsum(rows, axis=1)[:, j] sums ids[:, 0..j] at any width of the ids; it was reported
    ('an end counted off the declared length'). Fused as the bag of ids[:, :j+1]: wider ids (TF Serving
    does not check shapes) give the same bag, narrower ones are refused as the composite's slice
    refuses them, and an id out of range at a later position is refused as the composite's gather does."""
    from export_models import run_as_a_server
    body, stop = CUMSUM_ENDS[form]
    weighted = form == "weighted"
    result = _save_and_export(tmp_path, [IDS, WEIGHTS] if weighted else [IDS], body)
    [site] = result.sites
    assert (site.status, site.pattern, site.computes, site.weighted) == ("fused", "cumsum", "sum", weighted), \
        site.reason
    for width in (K, K + 2):
        feed = {"args_0": _ids(k=width)}
        if weighted:
            feed["args_1"] = RNG.uniform(0.5, 2, (4, width)).astype(np.float32)
        expected = _bags(feed["args_0"][:, :stop], feed["args_1"][:, :stop] if weighted else None)
        want = run_as_a_server(tmp_path / "m", "serving_default", feed)
        got = run_as_a_server(result.dst, "serving_default", feed)
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    narrow = {key: value[:, :stop - 1] for key, value in feed.items()}
    far = dict(feed, args_0=feed["args_0"].copy())
    far["args_0"][1, -1] = N
    for bad in (narrow, far):
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                run_as_a_server(model, "serving_default", bad)


@pytest.mark.parametrize("end", ["reverse_inner", "second_last", "exclusive", "inner_kept"])
def test_running_sums_of_other_spans_are_reported(tmp_path, end):
    """reverse=True at [:, 2] (ids[:, 2:], open-ended), [:, -2] (counted from the end) and exclusive
    running sums are no span of the fused op; [:, 1:2] is empty, not refused, for ids narrower than 2,
    which the fused op would not follow: reported and left as written."""
    body = {"inner_kept": lambda rows: tf.math.cumsum(rows, axis=1)[:, 1:2],
            "reverse_inner": lambda rows: tf.math.cumsum(rows, axis=1, reverse=True)[:, 2],
            "second_last": lambda rows: tf.math.cumsum(rows, axis=1)[:, -2],
            "exclusive": lambda rows: tf.math.cumsum(rows, axis=1, exclusive=True)[:, 3]}[end]
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: body(tf.gather(m.t, ids)))
    [site] = result.sites
    assert site.status == "skipped" and "running sum" in site.reason, site.reason
    ids = _ids()
    want, got = _run_both(tmp_path, result, ids)
    np.testing.assert_array_equal(got, want)


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
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: MATMUL_POSITION_WEIGHTS[form](m, tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "matmul", True), site.reason
    for batch in (1, 4):
        ids = _ids(batch)
        want, got = _run_both(tmp_path, result, ids)
        expected = _bags(ids, POSITION_WEIGHTS)
        expected = expected if form == "squeezed" else expected[:, None]
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_matmul_of_weights_broadcast_to_a_batch_of_their_own_is_reported(tmp_path):
    """broadcast_to(v, [tf.shape(x)[0], 1, K]) @ rows: the batch broadcast to is not provably the ids'
    (here that of another input, which makes the output that wide): reported and left as written."""
    other = tf.TensorSpec([None], tf.float32)
    result = _save_and_export(tmp_path, [IDS, other], lambda m, ids, x: tf.matmul(
        tf.broadcast_to(m.v[None, None, :], [tf.shape(x)[0], 1, K]), tf.gather(m.t, ids)))
    [site] = result.sites
    assert site.status == "skipped" and "v[None, None, :] @ rows" in site.reason, site.reason
    ids, x = _ids(1), np.zeros([3], np.float32)
    want, got = _run_both(tmp_path, result, ids, x)
    assert want.shape == (3, 1, D)
    np.testing.assert_array_equal(got, want)


FIELDS = 3
FIELD_IDS = tf.TensorSpec([None, FIELDS, K], tf.int64)
FIELD_TENSORDOTS = {
    "rows_first": lambda m, rows: tf.tensordot(rows, m.v, axes=[[2], [0]]),
    "weights_first": lambda m, rows: tf.tensordot(m.v, rows, axes=[[0], [2]]),
    "negative_axis": lambda m, rows: tf.tensordot(rows, tf.constant(POSITION_WEIGHTS), axes=[[-2], [0]]),
}


@pytest.mark.parametrize("form", sorted(FIELD_TENSORDOTS))
def test_tensordot_of_per_field_rows_over_the_bag_axis_is_a_bag_per_field(tmp_path, form):
    """tf.tensordot(rows [B, F, K, D], v [K], axes=[[2], [0]]) is each field's bag weighted by v (as
    einsum('bfkd,k->bfd') is, which was fused): it was reported ('not tensordot(rows [B, K, D], ...')."""
    result = _save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: FIELD_TENSORDOTS[form](m, tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "tensordot", True), site.reason
    ids = RNG.integers(0, N, (4, FIELDS, K))
    want, got = _run_both(tmp_path, result, ids)
    expected = _bags(ids.reshape(-1, K), POSITION_WEIGHTS).reshape(4, FIELDS, D)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_tensordot_of_per_request_weights_by_the_rows_is_reported(tmp_path):
    """tf.tensordot(w [B, K], rows [B, K, D], axes=[[1], [1]]) is [B, B, D] (each request's weights
    against every request's rows): no bag, reported and left as written."""
    result = _save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.tensordot(
        w, tf.gather(m.t, ids), axes=[[1], [1]]))
    [site] = result.sites
    assert site.status == "skipped" and "tf.tensordot of gathered rows" in site.reason, site.reason
    ids, w = _ids(3), RNG.uniform(0.5, 2, (3, K)).astype(np.float32)
    want, got = _run_both(tmp_path, result, ids, w)
    assert want.shape == (3, 3, D)
    np.testing.assert_array_equal(got, want)


GATHER_ND_POSITIONS = {  # (specs, body, first position, weighted)
    "add_n_index_axis_added": ([IDS], lambda m, ids: tf.add_n([tf.gather_nd(m.t, ids[:, k, None]) for k in range(K)]),
                               0, False),
    "add_n_index_axis_kept_weighted": ([IDS, WEIGHTS], lambda m, ids, w: tf.add_n(
        [tf.gather_nd(m.t, ids[:, k:k + 1]) * w[:, k, None] for k in range(K)]), 0, True),
    "python_sum_from_the_second": ([IDS], lambda m, ids: sum(tf.gather_nd(m.t, ids[:, k, None]) for k in range(1, K)),
                                   1, False),
    "stacked_mean": ([IDS], lambda m, ids: tf.reduce_mean(tf.stack(
        [tf.gather_nd(m.t, ids[:, k, None]) for k in range(K)], axis=1), axis=1), 0, False),
}


@pytest.mark.parametrize("form", sorted(GATHER_ND_POSITIONS))
def test_per_position_gather_nd_rows_are_a_bag(tmp_path, form):
    """tf.add_n([tf.gather_nd(t, ids[:, k, None]) for k]) gathers the rows tf.gather(t, ids[:, k]) does:
    it was neither fused nor reported. Fused as the bag of ids[:, first:K], wider ids read as written."""
    from export_models import run_as_a_server
    specs, body, first, weighted = GATHER_ND_POSITIONS[form]
    result = _save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "per-position-sum", weighted), site.reason
    for width in (K, K + 2):
        feed = {"args_0": _ids(k=width)}
        if weighted:
            feed["args_1"] = RNG.uniform(0.5, 2, (4, width)).astype(np.float32)
        expected = _bags(feed["args_0"][:, first:K], feed["args_1"][:, first:K] if weighted else None)
        expected = expected / K if form == "stacked_mean" else expected
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="positions, but the original model"):
        run_as_a_server(result.dst, "serving_default", {k: v[:, :K - 1] for k, v in feed.items()})


def test_gather_nd_of_the_same_position_twice_is_reported(tmp_path):
    """Position 1 added twice is no bag of a range of positions: reported and left as written."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: tf.add_n(
        [tf.gather_nd(m.t, ids[:, k, None]) for k in (0, 1, 1)]))
    [site] = result.sites
    assert site.status == "skipped" and "not each position of a range once" in site.reason, site.reason
    want, got = _run_both(tmp_path, result, _ids())
    np.testing.assert_array_equal(got, want)


def _rows_kept(m, ids, k):
    return tf.gather(m.t, ids[:, k:k + 1])


CONCATENATED_POSITIONS = {  # (specs, body, weighted, mean)
    "sum": ([IDS], lambda m, ids: tf.reduce_sum(tf.concat([_rows_kept(m, ids, k) for k in range(K)], 1), 1),
            False, False),
    "mean_axis_minus_two": ([IDS], lambda m, ids: tf.reduce_mean(tf.concat(
        [_rows_kept(m, ids, k) for k in range(K)], axis=-2), axis=-2), False, True),
    "sliced_rows": ([IDS], lambda m, ids: (lambda rows: tf.reduce_sum(tf.concat(
        [rows[:, k:k + 1] for k in range(K)], 1), 1))(tf.gather(m.t, ids)), False, False),
    "weighted_unit_axis_added": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * w[:, k:k + 1, None] for k in range(K)], 1), 1), True, False),
    "weighted_expanded": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * tf.expand_dims(w[:, k:k + 1], -1) for k in range(K)], 1), 1), True, False),
}


@pytest.mark.parametrize("form", sorted(CONCATENATED_POSITIONS))
def test_concatenated_per_position_rows_reduced_over_the_bag_axis_are_a_bag(tmp_path, form):
    """reduce_sum(tf.concat([tf.gather(t, ids[:, k:k+1]) for k], 1), 1) is the bag of the ids: it was
    reported ('ConcatV2 between the gather and the reduction'); fused as tf.stack's per-position bag."""
    specs, body, weighted, mean = CONCATENATED_POSITIONS[form]
    result = _save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted, site.computes) == (
        "fused", "per-position-sum", weighted, "mean" if mean else "sum"), site.reason
    ids = _ids()
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    want, got = _run_both(tmp_path, result, ids, w) if weighted else _run_both(tmp_path, result, ids)
    expected = _bags(ids, w if weighted else None) / (K if mean else 1)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


CONCATENATED_NOT_A_BAG = {
    "weights_broadcast_across_requests": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) * w[:, k:k + 1] for k in range(K)], 1), 1), "not per-index"),
    "blocks_of_positions": ([IDS], lambda m, ids: tf.reduce_sum(tf.concat(
        [tf.gather(m.t, ids[:, :2]), tf.gather(m.t, ids[:, 2:])], 1), 1), "ConcatV2"),
    "a_position_twice": ([IDS], lambda m, ids: tf.reduce_sum(tf.concat(
        [_rows_kept(m, ids, k) for k in (0, 1, 1)], 1), 1), "not each position of a range once"),
}


@pytest.mark.parametrize("form", sorted(CONCATENATED_NOT_A_BAG))
def test_concatenations_that_are_no_per_position_bag_are_reported(tmp_path, form):
    """w[:, k:k+1] [B, 1] times rows [B, 1, D] broadcasts to [B, B, D] (every request's weights on every
    request's rows); blocks of positions and a repeated position are no per-position bag either."""
    specs, body, reason = CONCATENATED_NOT_A_BAG[form]
    result = _save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    ids = _ids()
    args = (ids, RNG.uniform(0.5, 2, ids.shape).astype(np.float32)) if len(specs) == 2 else (ids,)
    want, got = _run_both(tmp_path, result, *args)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form", ["sum", "mean_axis_minus_two", "sliced_rows"])
def test_concatenated_positions_follow_ids_of_any_width_as_the_original(tmp_path, form):
    """ids[:, k:k+1] past the ids' width is empty, not refused: the composite concatenates (and counts)
    fewer rows, as the fused op's ids[:, 0:K] does; wider ids are read up to position K - 1 by both."""
    from export_models import run_as_a_server
    specs, body, _, mean = CONCATENATED_POSITIONS[form]
    result = _save_and_export(tmp_path, specs, body)
    for width in (2, K + 2):
        feed = {"args_0": _ids(k=width)}
        taken = feed["args_0"][:, :K]
        expected = _bags(taken) / (taken.shape[1] if mean else 1)
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-6)


SCALAR_POSITION_WEIGHTS = {
    "sliced_rows_times_variable_entry": lambda m, ids: (lambda rows: tf.add_n(
        [rows[:, k] * m.v[k] for k in range(K)]))(tf.gather(m.t, ids)),
    "gather_per_position_times_variable_entry": lambda m, ids: tf.add_n(
        [tf.gather(m.t, ids[:, k]) * m.v[k] for k in range(K)]),
    "constant_entry_first": lambda m, ids: (lambda v: tf.add_n(
        [v[k] * tf.gather(m.t, ids[:, k]) for k in range(1, K)]))(tf.constant(POSITION_WEIGHTS)),
    "unstacked_weights": lambda m, ids: tf.add_n(
        [tf.gather(m.t, i) * vk for i, vk in zip(tf.unstack(ids, axis=1), tf.unstack(m.v))]),
    "stacked_then_summed": lambda m, ids: tf.reduce_sum(tf.stack(
        [tf.gather(m.t, ids[:, k]) * m.v[k] for k in range(K)], 1), 1),
}


@pytest.mark.parametrize("form", sorted(SCALAR_POSITION_WEIGHTS))
def test_per_position_terms_weighted_by_an_entry_of_positional_weights_are_a_weighted_bag(tmp_path, form):
    """sum_k rows[:, k] * v[k] with v [K] weighs every bag's position k by v[k]: it was neither fused nor
    reported (rows sliced) or reported as 'not per index' (gathered per position). Fused with v[a:b]
    broadcast to ids[:, a:b]."""
    from export_models import run_as_a_server
    result = _save_and_export(tmp_path, [IDS], SCALAR_POSITION_WEIGHTS[form])
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "per-position-sum", True), site.reason
    first = 1 if form == "constant_entry_first" else 0
    widths = (K,) if form == "unstacked_weights" else (K, K + 2)  # tf.unstack(ids) refuses other widths
    for width in widths:
        ids = _ids(k=width)
        expected = _bags(ids[:, first:K], POSITION_WEIGHTS[first:])
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", {"args_0": ids}), expected,
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["entry_of_another_position", "one_constant_for_every_position",
                                  "entries_of_two_weight_vectors"])
def test_per_position_scalar_weights_that_are_no_positional_weights_are_reported(tmp_path, form):
    """v[k + 1] on position k, a weight that is the same constant for every term, and entries of two
    vectors are reported, as before, and left as written."""
    def body(m, ids):
        rows = [tf.gather(m.t, ids[:, k]) for k in range(K - 1)]
        factor = {"entry_of_another_position": lambda k: m.v[k + 1],
                  "one_constant_for_every_position": lambda k: tf.constant(0.5),
                  "entries_of_two_weight_vectors": lambda k: (m.v if k < 2 else 2.0 * m.v)[k]}[form]
        return tf.add_n([r * factor(k) for k, r in enumerate(rows)])
    result = _save_and_export(tmp_path, [IDS], body)
    [site] = result.sites
    assert site.status == "skipped" and "weight" in site.reason, site.reason
    want, got = _run_both(tmp_path, result, _ids())
    np.testing.assert_array_equal(got, want)


def test_gather_nd_of_positions_counted_from_the_end_is_reported(tmp_path):
    """ids[:, k, None] for k in -K..-1 are other positions of ids wider than declared: reported (as tf.gather's
    are), not left silently."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: tf.add_n(
        [tf.gather_nd(m.t, ids[:, k, None]) for k in range(-K, 0)]))
    [site] = result.sites
    assert site.status == "skipped" and "counted from the end" in site.reason, site.reason
    want, got = _run_both(tmp_path, result, _ids())
    np.testing.assert_array_equal(got, want)


BAG_SIZE_READ = {
    "cast_width": (lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), 1) / tf.cast(tf.shape(ids)[1], tf.float32),
                   "mean"),
    "last_axis_counted_from_the_end": (lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), 1) / tf.cast(
        tf.shape(ids, out_type=tf.int64)[-1], tf.float32), "mean"),
    "batch_size": (lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), 1) / tf.cast(tf.shape(ids)[0], tf.float32),
                   "sum"),
}


@pytest.mark.parametrize("form", sorted(BAG_SIZE_READ))
def test_bag_sum_divided_by_the_ids_width_read_off_their_shape_is_labelled_a_mean(tmp_path, form):
    """sum / tf.cast(tf.shape(ids)[1]) is the mean at any width of the ids: it was labelled 'sum' (only a
    constant K was read as the bag size); the batch size read off the same shape is no bag size."""
    from export_models import run_as_a_server
    body, label = BAG_SIZE_READ[form]
    result = _save_and_export(tmp_path, [IDS], body)
    [site] = result.sites
    assert (site.status, site.computes) == ("fused", label)
    for width in (K, K + 3):
        ids = _ids(k=width)
        expected = _bags(ids) / (width if form != "batch_size" else ids.shape[0])
        for model in (tmp_path / "m", result.dst):
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", {"args_0": ids}), expected,
                                       rtol=1e-5, atol=1e-6)


def test_matmul_of_per_field_weights_given_a_leading_unit_axis_keeps_their_alignment(tmp_path):
    """expand_dims(S [F, 1, K], 0) @ rows [B, F, K, D] weighs field f by S[f]; with B == F static, S
    broadcast to the ids as they align from the right would weigh request b by S[b] instead: such weights
    are reported (only [K] / [1, .., K] sources are taken through added unit axes)."""
    per_field = RNG.uniform(0.5, 2, (FIELDS, 1, K)).astype(np.float32)
    result = _save_and_export(tmp_path, [tf.TensorSpec([FIELDS, FIELDS, K], tf.int64)], lambda m, ids: tf.matmul(
        tf.expand_dims(tf.constant(per_field), 0), tf.gather(m.t, ids)))
    ids = RNG.integers(0, N, (FIELDS, FIELDS, K))
    expected = np.einsum("fk,bfkd->bfd", per_field[:, 0].astype(np.float64), TABLE.astype(np.float64)[ids])
    want, got = _run_both(tmp_path, result, ids)
    np.testing.assert_allclose(want[:, :, 0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, :, 0], expected, rtol=1e-5, atol=1e-6)
    assert [s.status for s in result.sites] == ["skipped"]


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
    reported ('not over exactly one constant axis'; einsum: 'not a weighted sum over the bag axis'). Fused on the ids reshaped to [B, F * K] at run time: ids fed wider in
    either axis give the composite's bag, ids of another rank are refused (the composite reduces other axes)."""
    from export_models import run_as_a_server
    specs, body, combiner, weighted = FLAT_BAGS[form]
    result = _save_and_export(tmp_path, specs, body)
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
    result = _save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(
        tf.gather(m.t, ids), axes, keepdims=keepdims))
    [site] = result.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    ids = RNG.integers(0, N, (2, FIELDS, K))
    want, got = _run_both(tmp_path, result, ids)
    np.testing.assert_array_equal(got, want)


def test_unfusable_rows_reduced_over_several_bag_axes_are_reported(tmp_path):
    """reduce_sum(exp(rows), [1, 2]) is reported as reduce_sum(exp(rows), 1) is (it was silent)."""
    result = _save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(tf.exp(tf.gather(m.t, ids)), [1, 2]))
    [site] = result.sites
    assert site.status == "skipped" and "Exp between the gather and the reduction" in site.reason, site.reason


def test_positions_sliced_off_separate_gathers_of_all_the_ids_are_reported_as_such(tmp_path):
    """tf.gather(t, ids)[:, k] * v[k] with the gather written in each term: reported naming the separate
    gathers (it named 'other ids or another table', which the terms do not gather)."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: tf.add_n(
        [tf.gather(m.t, ids)[:, k] * m.v[k] for k in range(K)]))
    [site] = result.sites
    assert site.status == "skipped" and "separate gathers" in site.reason, site.reason
    want, got = _run_both(tmp_path, result, _ids())
    np.testing.assert_array_equal(got, want)
