"""Bag forms a round-34 hunt found neither fused nor reported, reported though they are bags, or
labelled wrongly (per-position sums, running sums, labels; test_export_forms_round34_axes.py: weights
as a matmul or tensordot, several bag axes): each is fused and computes what the original does (numpy
float64 and the original SavedModel as references), or reported with its reason and left as written.
The cases of a test are signatures of one SavedModel, exported once for the module (case_signatures.py)."""
import numpy as np
import pytest
import tensorflow as tf

from case_signatures import Cases, run_served, signature
from round34_forms import (IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, np_bags, random_ids, run_both,
                           save_and_export)


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
def test_masked_mean_with_its_mask_computed_twice_is_labelled_a_masked_mean(cases, form):
    """sum(rows * m) / sum(m) where m is computed once for the rows and again for the count was
    labelled 'sum' (the two masks were told apart by node, not by value)."""
    case = cases(f"mask_twice_{form}")
    [site] = case.sites
    assert (site.status, site.computes) == ("fused", "masked mean"), site.reason
    ids = random_ids()
    keep = (ids != 0).astype(np.float64)
    want, got = case.run_both(ids)
    expected = np_bags(ids, keep) / keep.sum(1, keepdims=True)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_masks_that_differ_are_not_a_masked_mean(cases):
    """The count of another mask (ids > 1 against ids > 0) leaves the bag a sum divided by something."""
    [site] = cases("masks_that_differ").sites
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
    result = save_and_export(tmp_path, [IDS], body, table=TABLE.astype(np.float16), tflite=lite)
    [site] = result.sites
    assert (site.status, site.computes) == ("fused", "masked mean")
    ids = random_ids()
    keep = (ids != 0).astype(np.float64)
    expected = np.einsum("bk,bkd->bd", keep, TABLE.astype(np.float16).astype(np.float64)[ids]) / \
        keep.sum(1, keepdims=True)
    want, got = run_both(tmp_path, result, ids)
    from_lite = tflite.run_tflite(lite, {"args_0": ids}, interpreter="litert")[0]
    for out in (want, got, from_lite):
        np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1e-2, atol=1e-2)


CUMSUM_ENDS = {  # (body, stop: the bag is ids[:, :stop])
    "declared_last": (lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, K - 1], K),
    "inner_position": (lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=-2)[:, 2], 3),
    "weighted": (lambda m, ids, w: tf.math.cumsum(tf.gather(m.t, ids) * w[..., None], axis=1)[:, K - 1], K),
}


@pytest.mark.parametrize("form", sorted(CUMSUM_ENDS))
def test_running_sum_read_at_a_position_from_the_start_is_the_bag_of_the_positions_up_to_it(cases, form):
    """tf.math.cumsum(rows, axis=1)[:, j] sums ids[:, 0..j] at any width of the ids; it was reported
    ('an end counted off the declared length'). Fused as the bag of ids[:, :j+1]: wider ids (TF Serving
    does not check shapes) give the same bag, narrower ones are refused as the composite's slice
    refuses them, and an id out of range at a later position is refused as the composite's gather does."""
    _, stop = CUMSUM_ENDS[form]
    weighted = form == "weighted"
    case = cases(f"cumsum_end_{form}")
    [site] = case.sites
    assert (site.status, site.pattern, site.computes, site.weighted) == ("fused", "cumsum", "sum", weighted), \
        site.reason
    for width in (K, K + 2):
        feed = {"args_0": random_ids(k=width)}
        if weighted:
            feed["args_1"] = RNG.uniform(0.5, 2, (4, width)).astype(np.float32)
        expected = np_bags(feed["args_0"][:, :stop], feed["args_1"][:, :stop] if weighted else None)
        want = run_served(case.src, case.name, feed)
        got = run_served(case.dst, case.name, feed)
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    narrow = {key: value[:, :stop - 1] for key, value in feed.items()}
    far = dict(feed, args_0=feed["args_0"].copy())
    far["args_0"][1, -1] = N
    for bad in (narrow, far):
        for model in (case.src, case.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                run_served(model, case.name, bad)


@pytest.mark.parametrize("end", ["reverse_inner", "second_last", "exclusive", "inner_kept"])
def test_running_sums_of_other_spans_are_reported(cases, end):
    """reverse=True at [:, 2] (ids[:, 2:], open-ended), [:, -2] (counted from the end) and exclusive
    running sums are no span of the fused op; [:, 1:2] is empty, not refused, for ids narrower than 2,
    which the fused op would not follow: reported and left as written."""
    case = cases(f"running_sum_{end}")
    [site] = case.sites
    assert site.status == "skipped" and "running sum" in site.reason, site.reason
    ids = random_ids()
    want, got = case.run_both(ids)
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
def test_per_position_gather_nd_rows_are_a_bag(cases, form):
    """tf.add_n([tf.gather_nd(t, ids[:, k, None]) for k]) gathers the rows tf.gather(t, ids[:, k]) does:
    it was neither fused nor reported. Fused as the bag of ids[:, first:K], wider ids read as written."""
    _, _, first, weighted = GATHER_ND_POSITIONS[form]
    case = cases(f"gather_nd_{form}")
    [site] = case.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "per-position-sum", weighted), site.reason
    for width in (K, K + 2):
        feed = {"args_0": random_ids(k=width)}
        if weighted:
            feed["args_1"] = RNG.uniform(0.5, 2, (4, width)).astype(np.float32)
        expected = np_bags(feed["args_0"][:, first:K], feed["args_1"][:, first:K] if weighted else None)
        expected = expected / K if form == "stacked_mean" else expected
        for model in (case.src, case.dst):
            np.testing.assert_allclose(run_served(model, case.name, feed), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="positions, but the original model"):
        run_served(case.dst, case.name, {k: v[:, :K - 1] for k, v in feed.items()})


def test_gather_nd_of_the_same_position_twice_is_reported(cases):
    """Position 1 added twice is no bag of a range of positions: reported and left as written."""
    case = cases("gather_nd_same_position_twice")
    [site] = case.sites
    assert site.status == "skipped" and "not each position of a range once" in site.reason, site.reason
    want, got = case.run_both(random_ids())
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
}  # weighted forms: reported (test_export_forms_round34_clamped.py)


@pytest.mark.parametrize("form", sorted(CONCATENATED_POSITIONS))
def test_concatenated_per_position_rows_reduced_over_the_bag_axis_are_a_bag(cases, form):
    """reduce_sum(tf.concat([tf.gather(t, ids[:, k:k+1]) for k], 1), 1) is the bag of the ids: it was
    reported ('ConcatV2 between the gather and the reduction'); fused as tf.stack's per-position bag."""
    _, _, weighted, mean = CONCATENATED_POSITIONS[form]
    case = cases(f"concatenated_{form}")
    [site] = case.sites
    assert (site.status, site.pattern, site.weighted, site.computes) == (
        "fused", "per-position-sum", weighted, "mean" if mean else "sum"), site.reason
    ids = random_ids()
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    want, got = case.run_both(ids, w) if weighted else case.run_both(ids)
    expected = np_bags(ids, w if weighted else None) / (K if mean else 1)
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
def test_concatenations_that_are_no_per_position_bag_are_reported(cases, form):
    """w[:, k:k+1] [B, 1] times rows [B, 1, D] broadcasts to [B, B, D] (every request's weights on every
    request's rows); blocks of positions and a repeated position are no per-position bag either."""
    specs, _, reason = CONCATENATED_NOT_A_BAG[form]
    case = cases(f"concatenated_no_bag_{form}")
    [site] = case.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    ids = random_ids()
    args = (ids, RNG.uniform(0.5, 2, ids.shape).astype(np.float32)) if len(specs) == 2 else (ids,)
    want, got = case.run_both(*args)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form", ["sum", "mean_axis_minus_two", "sliced_rows"])
def test_concatenated_positions_follow_ids_of_any_width_as_the_original(cases, form):
    """ids[:, k:k+1] past the ids' width is empty, not refused: the composite concatenates (and counts)
    fewer rows, as the fused op's ids[:, 0:K] does; wider ids are read up to position K - 1 by both."""
    _, _, _, mean = CONCATENATED_POSITIONS[form]
    case = cases(f"concatenated_{form}")
    for width in (2, K + 2):
        feed = {"args_0": random_ids(k=width)}
        taken = feed["args_0"][:, :K]
        expected = np_bags(taken) / (taken.shape[1] if mean else 1)
        for model in (case.src, case.dst):
            np.testing.assert_allclose(run_served(model, case.name, feed), expected, rtol=1e-5, atol=1e-6)


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
def test_per_position_terms_weighted_by_an_entry_of_positional_weights_are_a_weighted_bag(cases, form):
    """sum_k rows[:, k] * v[k] with v [K] weighs every bag's position k by v[k]: it was neither fused nor
    reported (rows sliced) or reported as 'not per index' (gathered per position). Fused with v[a:b]
    broadcast to ids[:, a:b]."""
    case = cases(f"scalar_position_weights_{form}")
    [site] = case.sites
    assert (site.status, site.pattern, site.weighted) == ("fused", "per-position-sum", True), site.reason
    first = 1 if form == "constant_entry_first" else 0
    widths = (K,) if form == "unstacked_weights" else (K, K + 2)  # tf.unstack(ids) refuses other widths
    for width in widths:
        ids = random_ids(k=width)
        expected = np_bags(ids[:, first:K], POSITION_WEIGHTS[first:])
        for model in (case.src, case.dst):
            np.testing.assert_allclose(run_served(model, case.name, {"args_0": ids}), expected,
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["entry_of_another_position", "entries_of_two_weight_vectors"])
def test_per_position_scalar_weights_that_are_no_positional_weights_are_reported(cases, form):
    """v[k + 1] on position k and entries of two vectors are reported, as before, and left as written
    (one constant for every term is fused: test_export_forms_round36.py)."""
    case = cases(f"no_positional_weights_{form}")
    [site] = case.sites
    assert site.status == "skipped" and "weight" in site.reason, site.reason
    want, got = case.run_both(random_ids())
    np.testing.assert_array_equal(got, want)


def test_gather_nd_of_positions_counted_from_the_end_is_reported(cases):
    """ids[:, k, None] for k in -K..-1 are other positions of ids wider than declared: reported (as tf.gather's
    are), not left silently."""
    case = cases("gather_nd_counted_from_the_end")
    [site] = case.sites
    assert site.status == "skipped" and "counted from the end" in site.reason, site.reason
    want, got = case.run_both(random_ids())
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
def test_bag_sum_divided_by_the_ids_width_read_off_their_shape_is_labelled_a_mean(cases, form):
    """sum / tf.cast(tf.shape(ids)[1]) is the mean at any width of the ids: it was labelled 'sum' (only a
    constant K was read as the bag size); the batch size read off the same shape is no bag size."""
    _, label = BAG_SIZE_READ[form]
    case = cases(f"bag_size_{form}")
    [site] = case.sites
    assert (site.status, site.computes) == ("fused", label)
    for width in (K, K + 3):
        ids = random_ids(k=width)
        expected = np_bags(ids) / (width if form != "batch_size" else ids.shape[0])
        for model in (case.src, case.dst):
            np.testing.assert_allclose(run_served(model, case.name, {"args_0": ids}), expected,
                                       rtol=1e-5, atol=1e-6)


def test_positions_sliced_off_separate_gathers_of_all_the_ids_are_reported_as_such(cases):
    """tf.gather(t, ids)[:, k] * v[k] with the gather written in each term: reported naming the separate
    gathers (it named 'other ids or another table', which the terms do not gather)."""
    [site] = cases("separate_gathers_of_all_the_ids").sites
    assert site.status == "skipped" and "separate gathers" in site.reason, site.reason
    want, got = cases("separate_gathers_of_all_the_ids").run_both(random_ids())
    np.testing.assert_array_equal(got, want)


def test_the_report_names_the_positions_a_partial_bag_reads(tmp_path):
    """A fused running sum read at [:, 2] is the bag of ids[:, 0:3], not of all the ids: the report's line
    says so (it read as a whole-bag sum)."""
    from pkm_serve.export.exporter import format_report
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.math.cumsum(tf.gather(m.t, ids), axis=1)[:, 2])
    [line] = [text for text in format_report(result).splitlines() if text.lstrip().startswith("fused")]
    assert "cumsum" in line and "(ids[..., 0:3])" in line, line


# The module's cases: {SavedModel: {signature: (specs, body(module, *inputs))}}, each SavedModel exported once.
RUNNING_SUMS_OF_OTHER_SPANS = {"inner_kept": lambda rows: tf.math.cumsum(rows, axis=1)[:, 1:2],
                               "reverse_inner": lambda rows: tf.math.cumsum(rows, axis=1, reverse=True)[:, 2],
                               "second_last": lambda rows: tf.math.cumsum(rows, axis=1)[:, -2],
                               "exclusive": lambda rows: tf.math.cumsum(rows, axis=1, exclusive=True)[:, 3]}


def _no_positional_weights(form):
    def body(m, ids):
        rows = [tf.gather(m.t, ids[:, k]) for k in range(K - 1)]
        factor = {"entry_of_another_position": lambda k: m.v[k + 1],
                  "entries_of_two_weight_vectors": lambda k: (m.v if k < 2 else 2.0 * m.v)[k]}[form]
        return tf.add_n([r * factor(k) for k, r in enumerate(rows)])
    return body


SAVED_MODELS = {
    "mask_twice": {f"mask_twice_{form}": ([IDS], lambda m, ids, f=f: f(tf.gather(m.t, ids), ids))
                   for form, f in MASK_TWICE.items()},
    "cumsum_ends": {f"cumsum_end_{form}": ([IDS, WEIGHTS] if form == "weighted" else [IDS], body)
                    for form, (body, _) in CUMSUM_ENDS.items()},
    "running_sums": {f"running_sum_{end}": ([IDS], lambda m, ids, f=f: f(tf.gather(m.t, ids)))
                     for end, f in RUNNING_SUMS_OF_OTHER_SPANS.items()},
    "gather_nd": {f"gather_nd_{form}": (specs, body) for form, (specs, body, _, _) in GATHER_ND_POSITIONS.items()},
    "concatenated": {f"concatenated_{form}": (specs, body)
                     for form, (specs, body, _, _) in CONCATENATED_POSITIONS.items()},
    "concatenated_no_bag": {f"concatenated_no_bag_{form}": (specs, body)
                            for form, (specs, body, _) in CONCATENATED_NOT_A_BAG.items()},
    "scalar_position_weights": {f"scalar_position_weights_{form}": ([IDS], body)
                                for form, body in SCALAR_POSITION_WEIGHTS.items()},
    "no_positional_weights": {f"no_positional_weights_{form}": ([IDS], _no_positional_weights(form))
                              for form in ("entry_of_another_position", "entries_of_two_weight_vectors")},
    "bag_size": {f"bag_size_{form}": ([IDS], body) for form, (body, _) in BAG_SIZE_READ.items()},
    "single_forms": {
        "masks_that_differ": ([IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids) * _mask(ids)[..., None], 1) / (
            1.0 + tf.reduce_sum(tf.cast(ids > 1, tf.float32), 1, keepdims=True))),
        "gather_nd_same_position_twice": ([IDS], lambda m, ids: tf.add_n(
            [tf.gather_nd(m.t, ids[:, k, None]) for k in (0, 1, 1)])),
        "gather_nd_counted_from_the_end": ([IDS], lambda m, ids: tf.add_n(
            [tf.gather_nd(m.t, ids[:, k, None]) for k in range(-K, 0)])),
        "separate_gathers_of_all_the_ids": ([IDS], lambda m, ids: tf.add_n(
            [tf.gather(m.t, ids)[:, k] * m.v[k] for k in range(K)])),
    },
}


def _call(module, body):
    return lambda *args: {"out": body(module, *args)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    path = tmp_path_factory.mktemp("round34")
    module = tf.Module()
    module.t, module.v = tf.Variable(TABLE), tf.Variable(POSITION_WEIGHTS)
    exported = Cases()
    for saved_model, forms in SAVED_MODELS.items():
        signatures = {name: signature(name, specs, _call(module, body)) for name, (specs, body) in forms.items()}
        exported.add(path / saved_model, module, signatures)
    return exported.case
