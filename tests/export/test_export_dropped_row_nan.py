"""A row the composite drops is still a zero it multiplies: tf.where(mask, rows, 0) * w, a one-hot lookup's zero
row (an id outside [0, N)) times w, a weighted one-hot count (every w times the one-hot's zeros). An inf or NaN
w there makes the composite's bag NaN (0 * inf); the fused op skipped the dropped position and gave a finite bag.
Now the fused bag is NaN exactly where the original's is. One export of one model holding every form.
References: numpy float64 of each composite's arithmetic, and the original SavedModel.
The same model holds pkm_serve's own embedding_bag_composite(combiner="max"), whose two reductions were reported
as "mask is not per-index": their masks are computed from the rows' values (NaN, -inf), which the report says."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve._composite import embedding_bag_composite
from round34_forms import FIELD_IDS, FIELDS, IDS, K, N, TABLE, WEIGHTS, save_and_export

D = TABLE.shape[1]
FIELD_WEIGHTS = tf.TensorSpec([None, FIELDS, K], tf.float32)


def _rows(m, ids):
    return tf.gather(m.t, ids)


def _one_hot(ids, mask):
    return tf.one_hot(tf.where(mask > 0, ids, -1), N)


FORMS = {  # name: (body of (m, ids, w, mask), reference of (ids, w, mask) in float64)
    "where_then_weights": (
        lambda m, i, w, k: tf.reduce_sum(tf.where(k[..., None] > 0, _rows(m, i), 0.0) * w[..., None], 1),
        lambda rows, w, k: (np.where(k[..., None] > 0, rows, 0.0) * w[..., None]).sum(1)),
    "where_then_weights_mean": (
        lambda m, i, w, k: tf.reduce_mean(tf.where(k[..., None] > 0, _rows(m, i), 0.0) * w[..., None], 1),
        lambda rows, w, k: (np.where(k[..., None] > 0, rows, 0.0) * w[..., None]).sum(1) / K),
    "where_then_multiply_no_nan": (
        lambda m, i, w, k: tf.reduce_sum(tf.math.multiply_no_nan(tf.where(k[..., None] > 0, _rows(m, i), 0.0),
                                                                 w[..., None]), 1),
        lambda rows, w, k: np.where(w[..., None] == 0, 0.0,
                                    np.where(k[..., None] > 0, rows, 0.0) * w[..., None]).sum(1)),
    "weights_then_where": (  # the mask after the weights: the dropped w never multiplies, the bag stays finite
        lambda m, i, w, k: tf.reduce_sum(tf.where(k[..., None] > 0, _rows(m, i) * w[..., None], 0.0), 1),
        lambda rows, w, k: np.where(k[..., None] > 0, rows * w[..., None], 0.0).sum(1)),
    "one_hot_rows_then_weights": (
        lambda m, i, w, k: tf.reduce_sum(tf.matmul(_one_hot(i, k), m.t) * w[..., None], 1),
        lambda rows, w, k: (np.where(k[..., None] > 0, rows, 0.0) * w[..., None]).sum(1)),
    "one_hot_rows_weights_then_where": (  # the mask after the weights drops their NaN: finite
        lambda m, i, w, k: tf.reduce_sum(tf.where(k[..., None] > 0, tf.matmul(tf.one_hot(i, N), m.t) * w[..., None],
                                                  0.0), 1),
        lambda rows, w, k: np.where(k[..., None] > 0, rows * w[..., None], 0.0).sum(1)),
    "one_hot_tensordot_then_weights": (
        lambda m, i, w, k: tf.reduce_sum(tf.tensordot(_one_hot(i, k), m.t, 1) * w[..., None], 1),
        lambda rows, w, k: (np.where(k[..., None] > 0, rows, 0.0) * w[..., None]).sum(1)),
}


def _weighted_counts_reference(ids, w, k):
    """(sum_k one_hot(id_k) * w_k) @ table: every w times N - 1 zeros."""
    one_hot = (np.where(k > 0, ids, -1)[..., None] == np.arange(N)).astype(np.float64)
    return (one_hot * w[..., None]).sum(1) @ TABLE.astype(np.float64)


FORMS["weighted_one_hot_counts"] = (
    lambda m, i, w, k: tf.matmul(tf.reduce_sum(_one_hot(i, k) * w[..., None], 1), m.t), None)


FLAT_IDS, FLAT_WEIGHTS = tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.float32)
SEGMENT_FORMS = {  # the dense forms' bags as segments of the flattened ids (bag b: ids[b]), same references
    "unsorted_segments_where_then_weights": lambda m, i, w, k, s: tf.math.unsorted_segment_sum(
        tf.where(k[:, None] > 0, _rows(m, i), 0.0) * w[:, None], s, 5),
    "segments_one_hot_rows_then_weights": lambda m, i, w, k, s: tf.math.segment_sum(
        tf.matmul(_one_hot(i, k), m.t) * w[:, None], s),
}
SEGMENT_REFERENCES = {"unsorted_segments_where_then_weights": "where_then_weights",
                      "segments_one_hot_rows_then_weights": "one_hot_rows_then_weights"}


def _one_hot_over_fields(m, f, fw):
    """One bag of the ids' last two axes ([B, FIELDS, K]) of one-hot rows, weighted after the lookup."""
    return tf.reduce_sum(tf.matmul(tf.one_hot(f, N), m.t) * fw[..., None], [1, 2])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dropped_row_nan")
    specs = [IDS, WEIGHTS, WEIGHTS, FIELD_IDS, FIELD_WEIGHTS, FLAT_IDS, FLAT_WEIGHTS, FLAT_WEIGHTS, FLAT_IDS]
    ids = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [1, 2, 3, 4, 5], [11, 12, 13, 14, 15], [3, 4, 5, 6, 7]])
    w = np.ones(ids.shape, np.float32)
    mask = np.ones(ids.shape, np.float32)
    w[0, 3], mask[0, 3] = np.inf, 0.0  # inf where the mask drops the row
    w[1, 1], mask[1, 1] = np.nan, 0.0  # NaN there
    w[2, 0] = 0.5  # finite weights, a row dropped: finite
    mask[2, 4] = 0.0
    w[3, :], mask[3, :] = np.inf, 0.0  # every row dropped, every weight inf
    w[4, 2] = -np.inf  # inf at a kept row
    field_ids = np.stack([ids, ids[::-1], ids], 1)
    field_ids[1, 2, 3], field_ids[2, 0, 1] = -1, N + 2  # ids outside [0, N): a one-hot zero row
    field_w = np.ones(field_ids.shape, np.float32)
    field_w[1, 2, 3], field_w[2, 0, 1], field_w[0, 1, 0] = np.inf, np.nan, 0.5
    inputs = {"args_0": ids, "args_1": w, "args_2": mask, "args_3": field_ids, "args_4": field_w,
              "args_5": ids.ravel(), "args_6": w.ravel(), "args_7": mask.ravel(),
              "args_8": np.repeat(np.arange(len(ids)), K)}
    np.savez(tmp_path / "inputs.npz", **inputs)  # the segment forms' ids and segment ids must agree
    result = save_and_export(tmp_path, specs, lambda m, i, w, k, f, fw, fi, fwt, fk, fs: tf.concat(
        [body(m, i, w, k) for body, _ in FORMS.values()] + [embedding_bag_composite(m.t, i, combiner="max"),
                                                            _one_hot_over_fields(m, f, fw)] +
        [body(m, fi, fwt, fk, fs) for body in SEGMENT_FORMS.values()], 1), sample_inputs=str(tmp_path / "inputs.npz"))
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    return result, original, fused, ids, w, mask, field_ids, field_w


def test_dropped_row_forms_are_fused(exported):
    sites = [s for s in exported[0].sites if not s.root.startswith("embedding_bag_composite")]
    assert [s.status for s in sites] == ["fused"] * (len(FORMS) + 1 + len(SEGMENT_FORMS)), [s.reason for s in sites]


def test_composite_max_is_reported_for_its_masks_read_from_the_rows(exported):
    """Before: "mask is not per-index (broadcast on the last axis of the rows)" for both of its reductions."""
    result, original, fused, ids = exported[:4]
    sites = [s for s in result.sites if s.root.startswith("embedding_bag_composite")]
    assert [s.status for s in sites] == ["skipped"] * 2
    assert all("computed from the gathered rows' own values" in s.reason for s in sites), [s.reason for s in sites]
    start = len(FORMS) * D
    np.testing.assert_allclose(fused[:, start:start + D], TABLE.astype(np.float64)[ids].max(1), rtol=1e-6)
    np.testing.assert_array_equal(fused[:, start:start + D], original[:, start:start + D])


@pytest.mark.parametrize("form", list(FORMS) + list(SEGMENT_FORMS))
def test_fused_bag_is_nan_where_the_original_multiplies_a_dropped_row_by_inf(exported, form):
    """Before: the fused bag was finite in rows 0, 1 and 3 (and row 4 of the counts), the original's NaN.
    The segment forms were fused so before round 39, then reported; now fused with the term per segment."""
    _, original, fused, ids, w, mask = exported[:6]
    start = list(FORMS).index(form) * D if form in FORMS else (len(FORMS) + 2 + list(SEGMENT_FORMS).index(form)) * D
    reference = FORMS[SEGMENT_REFERENCES.get(form, form)][1]
    with np.errstate(invalid="ignore"):
        want = _weighted_counts_reference(ids, w, mask) if reference is None else \
            reference(TABLE.astype(np.float64)[ids], w.astype(np.float64), mask)
    got = fused[:, start:start + D]
    np.testing.assert_allclose(original[:, start:start + D], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.isfinite(got[2]).all()


def test_one_hot_bag_over_two_axes_is_nan_where_the_original_is(exported):
    """Before: rows 1 and 2 (inf, NaN weights on ids outside [0, N)) were finite once fused."""
    _, original, fused, _, _, _, field_ids, field_w = exported
    inside = ((field_ids >= 0) & (field_ids < N))[..., None]
    rows = np.where(inside, TABLE.astype(np.float64)[np.clip(field_ids, 0, N - 1)], 0.0)
    with np.errstate(invalid="ignore"):
        want = (rows * field_w[..., None].astype(np.float64)).sum((1, 2))
    start = (len(FORMS) + 1) * D
    np.testing.assert_allclose(original[:, start:start + D], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[:, start:start + D], want, rtol=1e-5, atol=1e-5)
    assert np.isnan(want[1]).all() and np.isnan(want[2]).all() and np.isfinite(want[[0, 3, 4]]).all()
