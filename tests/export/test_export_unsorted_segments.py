"""tf.math.unsorted_segment_sum of gathered rows whose segment ids are no ragged row partition's
(tf.repeat(tf.range(B), K) of flattened [B, K] ids; ids grouped by a key fed in any order) was reported
("segment ids are not those of a ragged row partition"); now fused after a stable sort of the entries by
segment id (unsorted_segments.py), computing what the original does: numpy float64 (np.add.at) and the
original SavedModel as references, entries of a negative segment id dropped, num_segments bags."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import D, IDS, K, N, RNG, TABLE, WEIGHTS, loaded_signature, np_bags, run_both, save_and_export

FLAT = tf.TensorSpec([None], tf.int64)
SEGMENTS = tf.TensorSpec([None], tf.int32)
COUNT = tf.TensorSpec([], tf.int32)


def _ids(batch, k=K):
    ids = RNG.integers(0, N, (batch, k))
    ids[0, :3] = ids[0, 3 % k]  # repeated ids
    return ids


def _bag_rows(m, ids):
    return tf.gather(m.t, tf.reshape(ids, [-1]))


def _dense_segments(ids):
    return tf.repeat(tf.range(tf.shape(ids)[0]), K)


DENSE_BAGS = {
    "unsorted_segment_sum": ([IDS], lambda m, ids: tf.math.unsorted_segment_sum(
        _bag_rows(m, ids), _dense_segments(ids), tf.shape(ids)[0]), False),
    "weighted": ([IDS, WEIGHTS], lambda m, ids, w: tf.math.unsorted_segment_sum(
        _bag_rows(m, ids) * tf.reshape(w, [-1, 1]), _dense_segments(ids), tf.shape(ids)[0]), True),
    "segment_ids_by_division": ([IDS], lambda m, ids: tf.math.unsorted_segment_sum(
        _bag_rows(m, ids), tf.range(tf.size(ids)) // K, tf.shape(ids)[0]), False),
}


@pytest.mark.parametrize("form", sorted(DENSE_BAGS))
def test_segment_sum_of_flattened_bags_is_fused(tmp_path, form):
    specs, body, weighted = DENSE_BAGS[form]
    result = save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert (site.status, site.combiner) == ("fused", "sum"), site.reason
    for batch in (1, 5):
        ids = _ids(batch)
        w = RNG.uniform(-2, 2, (batch, K)).astype(np.float32)
        args = (ids, w) if weighted else (ids,)
        expected = np_bags(ids, w if weighted else None)
        want, got = run_both(tmp_path, result, *args)
        np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _export_any_order(tmp_path, body):
    """Segment ids and num_segments fed: the export verifies on a sample the original serves."""
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=RNG.integers(0, N, 12), args_1=RNG.integers(-1, 4, 12).astype(np.int32),
             args_2=np.int32(5))
    return save_and_export(tmp_path, [FLAT, SEGMENTS, COUNT], body, sample_inputs=sample)


def _segment_reference(ids, seg, n, keep=None):
    out = np.zeros((n, D))
    for i, s in enumerate(seg):
        if s >= 0 and (keep is None or keep[i]):
            out[s] += TABLE[ids[i]].astype(np.float64)
    return out


ANY_ORDER = {
    "plain": lambda m, ids, seg, n: tf.math.unsorted_segment_sum(tf.gather(m.t, ids), seg, n),
    "masked": lambda m, ids, seg, n: tf.math.unsorted_segment_sum(
        tf.where((ids % 3 != 0)[:, None], tf.gather(m.t, ids), 0.0), seg, n),
}


@pytest.mark.parametrize("form", sorted(ANY_ORDER))
def test_segment_ids_in_any_order_with_negative_and_empty_segments(tmp_path, form):
    result = _export_any_order(tmp_path, ANY_ORDER[form])
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = RNG.integers(0, N, 40)
    seg = RNG.integers(-2, 6, 40).astype(np.int32)  # unsorted, some negative (dropped), bags 6, 7 empty
    keep = ids % 3 != 0 if form == "masked" else None
    expected = _segment_reference(ids, seg, 8, keep)
    want, got = run_both(tmp_path, result, ids, seg, np.int32(8))
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_bad_entries_are_refused_as_the_original_refuses_them(tmp_path):
    """A segment id >= num_segments, an id >= N at an entry whose negative segment id drops it (the
    composite gathers it first), or fewer segment ids than ids, is refused by both models (the fused one took
    as many ids as segment ids and dropped the rest)."""
    result = _export_any_order(tmp_path, ANY_ORDER["plain"])
    ids, seg = RNG.integers(0, N, 6), np.array([2, 0, 1, 1, -1, 0], np.int32)
    for bad_ids, bad_seg in ((ids, np.where(seg == 2, 9, seg).astype(np.int32)),
                             (np.where(seg < 0, N + 3, ids), seg), (ids, seg[:-1])):
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                loaded_signature(model)(
                    args_0=bad_ids, args_1=bad_seg, args_2=np.int32(3))


def _flattened_rows(m, ids):
    return tf.reshape(tf.gather(m.t, ids), [-1, D])


def test_rows_flattened_by_a_reshape_then_summed_by_segment_are_fused(tmp_path):
    """keras.ops.segment_sum(keras.ops.reshape(Embedding(ids), [-1, D]), repeat(arange(B), K), B) gathers
    [B, K] ids and flattens the rows: no site was found at all; now the bags of the flattened ids."""
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.math.unsorted_segment_sum(
        _flattened_rows(m, ids), _dense_segments(ids), tf.shape(ids)[0]))
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids(4)
    want, got = run_both(tmp_path, result, ids)
    np.testing.assert_allclose(want, np_bags(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np_bags(ids), rtol=1e-5, atol=1e-5)
    from export_models import run_as_a_server
    for model in (tmp_path / "m", result.dst):  # wider ids than the K of the segment ids: both refuse
        with pytest.raises(tf.errors.InvalidArgumentError):
            run_as_a_server(model, "serving_default", {"args_0": _ids(4, K + 2)})


def test_rows_regrouped_by_a_constant_reshape_are_bags_of_the_regrouped_ids(tmp_path):
    """reduce_sum(reshape(table[ids [B, F * K]], [-1, F, K, D]), axis=2): bags of reshape(ids, [-1, F, K])."""
    fields = 3
    result = save_and_export(tmp_path, [tf.TensorSpec([None, fields * K], tf.int64)], lambda m, ids: tf.reduce_sum(
        tf.reshape(tf.gather(m.t, ids), [-1, fields, K, D]), 2))
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids(4, fields * K)
    expected = np_bags(ids.reshape(-1, K)).reshape(4, fields, D)
    want, got = run_both(tmp_path, result, ids)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_partial_running_sum_of_regrouped_rows_is_reported(tmp_path):
    """cumsum(reshape(rows, [-1, F, K, D]), axis=2)[:, :, j]: its span ids[..., :j+1] is of the regrouped ids,
    not of the ids as fed: reported and left as written (before, the export failed its own verification)."""
    fields = 3
    result = save_and_export(tmp_path, [tf.TensorSpec([None, fields * K], tf.int64)], lambda m, ids: tf.math.cumsum(
        tf.reshape(tf.gather(m.t, ids), [-1, fields, K, D]), axis=2)[:, :, 2])
    [site] = result.sites
    assert site.status == "skipped" and "regrouped by a reshape" in site.reason, site.reason
    ids = _ids(2, fields * K)
    want, got = run_both(tmp_path, result, ids)
    np.testing.assert_allclose(got, np_bags(ids.reshape(-1, K)[:, :3]).reshape(2, fields, D), rtol=1e-5, atol=1e-5)


def test_cast_rows_flattened_then_summed_by_segment_are_fused(tmp_path):
    """Keras mixed precision casts the Embedding's rows to float16 before keras.ops.reshape(rows, [-1, D]):
    the reshape of cast rows (not of the gather itself) was no site."""
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.math.unsorted_segment_sum(
        tf.reshape(tf.cast(tf.gather(m.t, ids), tf.float16), [-1, D]), _dense_segments(ids), tf.shape(ids)[0]))
    [site] = result.sites
    assert (site.status, site.cast_to) == ("fused", "float16"), site.reason
    ids = _ids(4)
    want, got = run_both(tmp_path, result, ids)
    for out in (want, got):
        np.testing.assert_allclose(out.astype(np.float64), np_bags(ids), rtol=1e-2, atol=1e-2)


def test_sorted_segment_sum_of_flattened_rows_is_fused(tmp_path):
    """keras.ops.segment_sum(reshape(rows, [-1, D]), segment_ids, sorted=True) is tf.math.segment_sum of
    flattened rows: reported ("Reshape between the gather and the segment_sum"); now fused, and segment ids
    out of order or not one per id are refused by both models."""
    from export_models import run_as_a_server
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=_ids(2), args_1=np.repeat([0, 1], K).astype(np.int32))
    result = save_and_export(tmp_path, [IDS, SEGMENTS], lambda m, ids, seg: tf.math.segment_sum(
        _flattened_rows(m, ids), seg), sample_inputs=sample)
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids(3)
    seg = np.repeat([0, 2, 3], K).astype(np.int32)  # bag 1 empty
    expected = np.insert(np_bags(ids), 1, 0.0, axis=0)
    want, got = run_both(tmp_path, result, ids, seg)
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for bad_seg in (seg[::-1].copy(), seg[:-2]):
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                run_as_a_server(model, "serving_default", {"args_0": ids, "args_1": bad_seg})


def test_unsorted_segment_sum_converts_to_tflite(tmp_path):
    """The sort by segment id (TopKV2) and the counted row_splits are TFLite builtins: the .tflite holds
    them and the ragged op, and computes the bags."""
    from pkm_serve import tflite
    lite = str(tmp_path / "m.tflite")
    result = save_and_export(tmp_path, [IDS], lambda m, ids: tf.math.unsorted_segment_sum(
        _flattened_rows(m, ids), _dense_segments(ids)[::-1], tf.shape(ids)[0]), tflite=lite)
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids(3)
    expected = np_bags(ids)[::-1]
    np.testing.assert_allclose(tflite.run_tflite(lite, {"args_0": ids}, interpreter="litert")[0], expected,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run_both(tmp_path, result, ids)[1], expected, rtol=1e-5, atol=1e-5)


def test_segment_sum_of_rows_scaled_twice_is_one_weighted_bag(tmp_path):
    """unsorted_segment_sum(rows_flat * w_flat * mask_flat, ...): no site was listed at all; now one weight."""
    result = save_and_export(tmp_path, [IDS, WEIGHTS, WEIGHTS], lambda m, ids, w, mask: tf.math.unsorted_segment_sum(
        _flattened_rows(m, ids) * tf.reshape(w, [-1, 1]) * -tf.reshape(mask, [-1, 1]), _dense_segments(ids),
        tf.shape(ids)[0]))
    [site] = result.sites
    assert (site.status, site.weighted) == ("fused", True), site.reason
    ids, w, mask = _ids(4), RNG.uniform(-2, 2, (4, K)).astype(np.float32), (RNG.uniform(size=(4, K)) > .4)
    expected = np_bags(ids, -w.astype(np.float64) * mask)
    want, got = run_both(tmp_path, result, ids, w, mask.astype(np.float32))
    np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


ANY_IDS, ANY_WEIGHTS = tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None, None], tf.float32)


def _flat_weighted_rows(m, ids, w):
    return _flattened_rows(m, ids) * tf.reshape(w, [-1, 1])


def test_segment_sum_of_rows_broadcast_against_their_weights_answers_and_refuses_as_the_original(tmp_path):
    """Fed one id [1, 1] and K weights [1, K], the composite's rows * w broadcasts to K entries: with K
    segment ids it sums them, with one segment id it refuses. The fused model counted the ids alone: it
    refused the first and answered the second. Now the ids are broadcast against the weights first."""
    by_weights = save_and_export(tmp_path / "a", [ANY_IDS, ANY_WEIGHTS], lambda m, ids, w: tf.math.unsorted_segment_sum(
        _flat_weighted_rows(m, ids, w), tf.repeat(tf.range(tf.shape(w)[0]), tf.shape(w)[1]), tf.shape(w)[0]))
    by_ids = save_and_export(tmp_path / "b", [ANY_IDS, ANY_WEIGHTS], lambda m, ids, w: tf.math.unsorted_segment_sum(
        _flat_weighted_rows(m, ids, w), tf.repeat(tf.range(tf.shape(ids)[0]), tf.shape(ids)[1]), tf.shape(ids)[0]))
    for result in (by_weights, by_ids):
        assert result.sites[0].status == "fused", result.sites[0].reason
    one_id, w = _ids(1, 1), RNG.uniform(-2, 2, (1, K)).astype(np.float32)
    expected = np_bags(np.repeat(one_id, K, axis=1), w)
    for out in run_both(tmp_path / "a", by_weights, one_id, w):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for model in (tmp_path / "b" / "m", by_ids.dst):
        with pytest.raises(tf.errors.InvalidArgumentError):
            loaded_signature(model)(args_0=one_id, args_1=w)


def test_int64_segment_ids_past_int32_are_dropped_or_refused_as_the_original(tmp_path):
    """int64 segment ids were cast to int32 for the sort, wrapping: -2**32 + 1 (dropped by the composite, being
    negative) became 1 and was summed into bag 1; 2**32 + 2 (refused, >= num_segments) became 2 and was summed."""
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=RNG.integers(0, N, 12), args_1=RNG.integers(-1, 4, 12), args_2=np.int32(5))
    result = save_and_export(tmp_path, [FLAT, tf.TensorSpec([None], tf.int64), COUNT], ANY_ORDER["plain"],
                             sample_inputs=sample)
    assert result.sites[0].status == "fused", result.sites[0].reason
    ids = RNG.integers(0, N, 6)
    seg = np.array([0, 1, -2**32 + 1, 1, -2**31 - 1, 2])
    expected = _segment_reference(ids, seg, 3)
    for out in run_both(tmp_path, result, ids, seg, np.int32(3)):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for too_large in (2**32 + 2, 2**31):
        for model in (tmp_path / "m", result.dst):
            with pytest.raises(tf.errors.InvalidArgumentError):
                loaded_signature(model)(
                    args_0=ids, args_1=np.where(seg < 0, too_large, seg), args_2=np.int32(3))


def test_sorted_segment_sum_refuses_int64_segment_ids_that_wrap_in_int32(tmp_path):
    """segment_sum of flattened rows with int64 segment ids: -2**32 (refused by the composite: negative) was
    cast to int32 as 0, and the fused model answered."""
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=_ids(2), args_1=np.repeat([0, 1], K))
    result = save_and_export(tmp_path, [IDS, tf.TensorSpec([None], tf.int64)], lambda m, ids, seg: tf.math.segment_sum(
        _flattened_rows(m, ids), seg), sample_inputs=sample)
    assert result.sites[0].status == "fused", result.sites[0].reason
    ids = _ids(3)
    np.testing.assert_allclose(run_both(tmp_path, result, ids, np.repeat([0, 1, 2], K))[1], np_bags(ids),
                               rtol=1e-5, atol=1e-5)
    for model in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError):
            loaded_signature(model)(
                args_0=ids, args_1=np.repeat([-2**32, 0, 1], K))
