"""Bag forms a round-36 hunt found not fused (each a form users write): every fused one computes what the
original does (numpy float64 and the original SavedModel as references); one left composite is reported
with its reason and the exported model still computes the original's outputs. The cases of
tf.Module bodies are signatures of one SavedModel, exported once for the module (case_signatures.py)."""
import numpy as np
import pytest
import tensorflow as tf

from case_signatures import exported_bodies
from round34_forms import (IDS, K, N, POSITION_WEIGHTS, RNG, TABLE, WEIGHTS, np_bags, random_ids, run_both,
                           save_and_export)


def _weights(ids):
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    w[1, 1:3] = 0.0  # multiply_no_nan's zeros
    return w


def _fused_weighted(case, pattern=None):
    """(ids, w, the original's outputs, the fused model's) of a weighted form the export fuses as one site."""
    [site] = case.sites
    if pattern is None:
        assert site.status == "fused", site.reason
    else:
        assert (site.status, site.pattern) == ("fused", pattern), site.reason
    ids = random_ids()
    w = _weights(ids)
    return (ids, w, *case.run_both(ids, w))


def _assert_both_match(want, got, expected):
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


MULTIPLY_NO_NAN = {
    "sum": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1), 1),
    "mean": (lambda m, ids, w: tf.reduce_mean(tf.math.multiply_no_nan(tf.gather(m.t, ids), w[..., None]), 1),
             1 / K),
    "after_a_mask": (lambda m, ids, w: tf.reduce_sum(tf.math.multiply_no_nan(
        tf.gather(m.t, ids) * tf.cast(ids > 0, tf.float32)[..., None], w[..., None]), 1), None),
}


@pytest.mark.parametrize("form", sorted(MULTIPLY_NO_NAN))
def test_multiply_no_nan_of_rows_by_weights_is_a_weighted_bag(cases, form):
    """tf.math.multiply_no_nan(rows, w[..., None]) before the reduction stopped the walk to the gather
    (MulNoNan was no multiply): the site was left composite."""
    _, scale = MULTIPLY_NO_NAN[form]
    ids, w, want, got = _fused_weighted(cases(f"multiply_no_nan_{form}"))
    _assert_both_match(want, got, np_bags(ids, w * (ids > 0)) if scale is None else np_bags(ids, w) * scale)


def test_multiply_no_nan_of_weights_by_rows_is_reported(cases):
    """multiply_no_nan(w, rows) is 0 wherever a row entry is 0, an inf weight included: not the op's w * row."""
    case = cases("multiply_no_nan_of_weights_by_rows")
    [site] = case.sites
    assert site.status == "skipped" and "multiply_no_nan(w, rows)" in site.reason
    ids = random_ids()
    w = _weights(ids)
    want, got = case.run_both(ids, w)
    np.testing.assert_allclose(got, np_bags(ids, w), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)


TRANSPOSED = {  # (body, bag of the rows as gathered: numpy float64 of rows [B, K, D])
    "sum_last_axis": (lambda m, ids: tf.reduce_sum(tf.transpose(tf.gather(m.t, ids), [0, 2, 1]), -1),
                      lambda rows, w: rows.sum(1)),
    "max_last_axis": (lambda m, ids: tf.reduce_max(tf.transpose(tf.gather(m.t, ids), [0, 2, 1]), 2),
                      lambda rows, w: rows.max(1)),
    "weighted_mean": (lambda m, ids, w: tf.reduce_mean(tf.transpose(tf.gather(m.t, ids) * w[..., None],
                                                                      [0, 2, 1]), -1),
                      lambda rows, w: np.einsum("bk,bkd->bd", w, rows) / K),
}


@pytest.mark.parametrize("form", sorted(TRANSPOSED))
def test_rows_transposed_to_features_first_then_reduced_over_the_bag_are_a_bag(cases, form):
    """reduce over K of transpose(rows, [0, 2, 1]) ([B, D, K]) was reported, left composite."""
    _, reference = TRANSPOSED[form]
    weighted = form == "weighted_mean"
    case = cases(f"transposed_{form}")
    [site] = case.sites
    assert site.status == "fused", site.reason
    ids = random_ids()
    args = (ids, _weights(ids)) if weighted else (ids,)
    want, got = case.run_both(*args)
    expected = reference(TABLE.astype(np.float64)[ids], args[-1] if weighted else None)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_keras_permute_then_channels_first_pooling_is_a_mean_bag(tmp_path):
    """Keras Embedding -> Permute((2, 1)) -> GlobalAveragePooling1D(channels_first), exported by Keras."""
    import keras
    inp = keras.Input(shape=(K,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(N, 4, name="emb")
    x = keras.layers.Permute((2, 1))(emb(inp))
    model = keras.Model(inp, keras.layers.GlobalAveragePooling1D(data_format="channels_first")(x))
    emb.embeddings.assign(TABLE)
    model.export(str(tmp_path / "m"), format="tf_saved_model", verbose=False)
    from pkm_serve.export import export_saved_model
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = random_ids().astype(np.int32)
    loaded = tf.saved_model.load(result.dst)
    fused = loaded.serve(ids).numpy()
    np.testing.assert_allclose(fused, TABLE.astype(np.float64)[ids].mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused, model(ids).numpy(), rtol=1e-6, atol=1e-6)


def test_transposed_rows_reduced_over_features_or_keeping_dims_are_left_as_written(cases):
    """Over D of the transposed rows is each row's own sum (no bag); keepdims keeps [B, D, 1]: not fused."""
    case = cases("transposed_over_features_or_keeping_dims")
    assert all(s.status != "fused" for s in case.sites)
    ids = random_ids()
    want, got = case.run_both(ids)
    rows = TABLE.astype(np.float64)[ids]
    np.testing.assert_allclose(got, np.concatenate([rows.sum(2), rows.sum(1)], 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)


def _segment_max_reference(ids, seg, n):
    """unsorted_segment_max in float64: the max over the entries of each segment id >= 0, float32's lowest
    value for a segment without any."""
    out = np.full((n, TABLE.shape[1]), np.finfo(np.float32).min, np.float64)
    for i, s in enumerate(seg):
        if s >= 0:
            out[s] = np.maximum(out[s], TABLE[ids[i]])
    return out


def test_unsorted_segment_max_of_flattened_bags_is_a_max_bag(cases):
    """unsorted_segment_max(reshape(rows, [-1, D]), repeat(range(B), K), B) was reported ("segment ids are not
    those of a ragged row partition"): only the segment sum was sorted by segment id and fused."""
    case = cases("unsorted_segment_max_of_flattened_bags")
    [site] = case.sites
    assert (site.status, site.combiner) == ("fused", "max"), site.reason
    ids = random_ids()
    want, got = case.run_both(ids)
    expected = TABLE.astype(np.float64)[ids].max(1)
    np.testing.assert_allclose(want, expected, rtol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_unsorted_segment_max_in_any_order_gives_empty_segments_the_lowest_value(tmp_path):
    """Segment ids in any order, negative ones (dropped) and segments without entries (segment 0 among them,
    into which the sort puts the dropped entries as padding): each empty one is float32's lowest value."""
    flat, seg_spec, count = (tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int32),
                             tf.TensorSpec([], tf.int32))
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=RNG.integers(0, N, 12), args_1=RNG.integers(-1, 4, 12).astype(np.int32),
             args_2=np.int32(5))
    result = save_and_export(tmp_path, [flat, seg_spec, count], lambda m, ids, seg, n: tf.math.unsorted_segment_max(
        tf.gather(m.t, ids), seg, n), sample_inputs=sample)
    [site] = result.sites
    assert (site.status, site.combiner) == ("fused", "max"), site.reason
    ids = RNG.integers(0, N, 30)
    seg = RNG.integers(-2, 6, 30).astype(np.int32)
    seg[seg == 0] = -1  # segment 0 holds only dropped entries; 6 and 7 none at all
    want, got = run_both(tmp_path, result, ids, seg, np.int32(8))
    expected = _segment_max_reference(ids, seg, 8)
    np.testing.assert_allclose(want, expected, rtol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def _flat_rows(m, ids):
    return tf.reshape(tf.gather(m.t, ids), [-1, 4])


def _dense_segments(ids):
    return tf.repeat(tf.range(tf.shape(ids)[0]), K)


FLAT_SEGMENT_BAGS = {  # (body, the weights of the numpy bags of ids, w)
    "weighted": (lambda m, ids, w: tf.math.segment_sum(_flat_rows(m, ids) * tf.reshape(w, [-1, 1]),
                                                       _dense_segments(ids)), lambda ids, w: w),
    "masked": (lambda m, ids, w: tf.math.segment_sum(tf.where(tf.reshape(w > 1, [-1, 1]), _flat_rows(m, ids), 0.0),
                                                     _dense_segments(ids)), lambda ids, w: w > 1),
    "scaled_twice": (lambda m, ids, w: tf.math.segment_sum(_flat_rows(m, ids) * tf.reshape(w, [-1, 1]) * 0.5,
                                                           _dense_segments(ids)), lambda ids, w: w * 0.5),
    "unsorted_masked": (lambda m, ids, w: tf.math.unsorted_segment_sum(tf.where(
        tf.reshape(w > 1, [-1, 1]), _flat_rows(m, ids), 0.0), _dense_segments(ids), tf.shape(ids)[0]),
        lambda ids, w: w > 1),
}


@pytest.mark.parametrize("form", sorted(FLAT_SEGMENT_BAGS))
def test_flattened_rows_weighted_or_masked_then_summed_by_segment_are_bags(cases, form):
    """segment_sum(reshape(rows, [-1, D]) * reshape(w, [-1, 1]), seg) found no site at all (a segment_sum of
    flattened rows was fused unweighted only); tf.where by a mask [B * K, 1] failed the export's own check
    (unsorted_segment_sum: reported), several factors found no site."""
    _, weights = FLAT_SEGMENT_BAGS[form]
    ids, w, want, got = _fused_weighted(cases(f"flat_segment_{form}"))
    _assert_both_match(want, got, np_bags(ids, weights(ids, w).astype(np.float64)))


def _sum_of_sliced_positions(rows, w):
    return sum(SCALE * rows[:, k] * w[:, k, None] for k in range(1, K))


SCALE = 0.125  # sqrt(64)^-1: an embedding scale written into each position's term
SCALED_POSITIONS = {  # (body, weights of the numpy bag: w [B, K] -> [B, K] or [K])
    "gathered_per_position": (lambda m, ids, w: tf.add_n([
        tf.gather(m.t, ids[:, k]) * w[:, k:k + 1] * SCALE for k in range(K)]), lambda w: w * SCALE),
    "weight_times_constant": (lambda m, ids, w: sum(
        tf.gather(m.t, ids[:, k]) * (w[:, k:k + 1] * SCALE) for k in range(K)), lambda w: w * SCALE),
    "sliced_rows": (lambda m, ids, w: _sum_of_sliced_positions(tf.gather(m.t, ids), w),
        lambda w: np.concatenate([np.zeros_like(w[:, :1]), w[:, 1:] * SCALE], 1)),
    "unweighted": (lambda m, ids, w: tf.add_n([tf.gather(m.t, ids[:, k]) * 2.0 for k in range(K)]),
                   lambda w: np.full_like(w, 2.0)),
    "positional_weights": (lambda m, ids, w: tf.add_n([
        tf.gather(m.t, ids[:, k]) * m.v[k] * SCALE for k in range(K)]), lambda w: POSITION_WEIGHTS * SCALE),
}


@pytest.mark.parametrize("form", sorted(SCALED_POSITIONS))
def test_positions_scaled_by_one_constant_are_a_bag(cases, form):
    """rows[:, k] * w[:, k:k+1] * c summed over k found no site (the term's second multiply stopped it)."""
    _, weights = SCALED_POSITIONS[form]
    ids, w, want, got = _fused_weighted(cases(f"scaled_positions_{form}"), "per-position-sum")
    _assert_both_match(want, got, np_bags(ids, weights(w.astype(np.float64))))


def test_positions_scaled_by_different_constants_are_reported(cases):
    case = cases("positions_scaled_by_different_constants")
    [site] = case.sites
    assert site.status == "skipped" and "different constants" in site.reason, site.reason
    ids = random_ids()
    w = _weights(ids)
    want, got = case.run_both(ids, w)
    np.testing.assert_allclose(got, np_bags(ids, w * np.arange(1.0, K + 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_positions_divided_by_one_constant_are_a_mean_bag(cases):
    """sum_k rows[:, k] / K (a mean written one position at a time) found no site (RealDiv in each term)."""
    case = cases("positions_divided_by_one_constant")
    [site] = case.sites
    assert (site.status, site.pattern) == ("fused", "per-position-sum"), site.reason
    ids = random_ids()
    want, got = case.run_both(ids)
    expected = np_bags(ids) / K
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_transposed_rows_whose_shape_is_read_stay_composite(cases):
    """sum(x, -1) / shape(x)[-1] of x = transpose(rows) [B, D, K]: the fused site rebuilt Shape(x) as the rows'
    [B, K, D], so the division took D for K and the export failed its own verification."""
    case = cases("transposed_rows_whose_shape_is_read")
    [site] = case.sites
    assert site.status == "skipped" and "shape of the transposed" in site.reason, site.reason
    ids = random_ids()
    want, got = case.run_both(ids)
    np.testing.assert_allclose(got, np_bags(ids) / K, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_ragged_multiply_no_nan_of_rows_by_weights_is_a_ragged_bag(tmp_path):
    """multiply_no_nan(ragged rows, ragged w[..., None]): ragged broadcasting re-gathers the weights too, so
    both inputs led to a gather and the rows were taken for the second one (reported as multiply_no_nan(w, rows))."""
    ragged_ids = tf.RaggedTensorSpec([None, None], tf.int64)
    ragged_w = tf.RaggedTensorSpec([None, None], tf.float32)
    result = save_and_export(tmp_path, [ragged_ids, ragged_w], lambda m, rt, rw: tf.reduce_sum(
        tf.math.multiply_no_nan(tf.gather(m.t, rt), rw[..., None]), 1))
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "ragged-reduce"), site.reason
    bags = [[1, 2, 3], [], [4, 4], [5]]
    weights = [[0.5, 0.0, 2.0], [], [1.5, -1.0], [0.0]]
    rt, rw = tf.ragged.constant(bags, tf.int64), tf.ragged.constant(weights, tf.float32)
    inputs = {"args_0": rt.values, "args_0_1": rt.row_splits, "args_1": rw.values, "args_1_1": rw.row_splits}
    expected = np.array([sum((w * TABLE[i].astype(np.float64) for i, w in zip(b, ws)), np.zeros(4))
                         for b, ws in zip(bags, weights)])
    for model in (tmp_path / "m", result.dst):
        out = tf.saved_model.load(str(model)).signatures["serving_default"](**inputs)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def _transposed_rows_over_their_read_shape(m, ids):
    x = tf.transpose(tf.gather(m.t, ids), [0, 2, 1])
    return tf.reduce_sum(x, -1) / tf.cast(tf.shape(x)[-1], tf.float32)


# The module's SavedModel: {signature: (specs, body(module, *inputs))}, exported once.
CASES = {
    **{f"multiply_no_nan_{form}": ([IDS, WEIGHTS], body) for form, (body, _) in MULTIPLY_NO_NAN.items()},
    "multiply_no_nan_of_weights_by_rows": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        tf.math.multiply_no_nan(w[..., None], tf.gather(m.t, ids)), 1)),
    **{f"transposed_{form}": ([IDS, WEIGHTS] if form == "weighted_mean" else [IDS], body)
       for form, (body, _) in TRANSPOSED.items()},
    "transposed_over_features_or_keeping_dims": ([IDS], lambda m, ids: tf.concat([
        tf.reduce_sum(tf.transpose(tf.gather(m.t, ids), [0, 2, 1]), 1),
        tf.reshape(tf.reduce_sum(tf.transpose(tf.gather(m.t, ids), [0, 2, 1]), -1, keepdims=True), [-1, 4])], 1)),
    "unsorted_segment_max_of_flattened_bags": ([IDS], lambda m, ids: tf.math.unsorted_segment_max(
        tf.reshape(tf.gather(m.t, ids), [-1, 4]), tf.repeat(tf.range(tf.shape(ids)[0]), K), tf.shape(ids)[0])),
    **{f"flat_segment_{form}": ([IDS, WEIGHTS], body) for form, (body, _) in FLAT_SEGMENT_BAGS.items()},
    **{f"scaled_positions_{form}": ([IDS, WEIGHTS], body) for form, (body, _) in SCALED_POSITIONS.items()},
    "positions_scaled_by_different_constants": ([IDS, WEIGHTS], lambda m, ids, w: tf.add_n([
        tf.gather(m.t, ids[:, k]) * w[:, k:k + 1] * (k + 1.0) for k in range(K)])),
    "positions_divided_by_one_constant": ([IDS], lambda m, ids: tf.add_n([tf.gather(m.t, ids[:, k]) / float(K)
                                                                          for k in range(K)])),
    "transposed_rows_whose_shape_is_read": ([IDS], _transposed_rows_over_their_read_shape),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return exported_bodies(tmp_path_factory.mktemp("round36") / "forms", {"t": TABLE, "v": POSITION_WEIGHTS}, CASES)
