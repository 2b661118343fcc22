"""Weights of another run-time shape than the ids in bags over several axes and partial running sums:
the fused site must refuse what the composite's rows * w[..., None] refuses and pair ids with weights
as its broadcast does. Before: a bag over [1, 2] flattened ids and weights each on its own (w [B, K, F]
answered with wrong pairs, w [B, 1, K] refused); cumsum(rows * w)[:, j] sliced both to :j+1 first
(w [B, 7] with ids [B, 5] answered). Also: the .tflite of a bag over [1, 2] read F * K as declared."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import run_as_a_server
from round34_forms import FIELD_IDS, FIELDS, K, N, RNG, TABLE, save_and_export

FIELD_WEIGHTS = tf.TensorSpec([None, FIELDS, K], tf.float32)
WIDE = 5
WIDE_IDS, WIDE_WEIGHTS = tf.TensorSpec([None, WIDE], tf.int64), tf.TensorSpec([None, WIDE], tf.float32)


def _ids(*shape):
    return RNG.integers(0, N, shape).astype(np.int64)


def _weights(*shape):
    return RNG.uniform(0.5, 2, shape).astype(np.float32)


def _refused_or_answered_alike(tmp_path, result, feed, expected):
    """expected None: both refuse (InvalidArgument); else both answer it (float64 reference)."""
    for model in (tmp_path / "m", result.dst):
        if expected is None:
            with pytest.raises(tf.errors.InvalidArgumentError):
                run_as_a_server(model, "serving_default", feed)
        else:
            np.testing.assert_allclose(run_as_a_server(model, "serving_default", feed), expected, rtol=1e-5, atol=1e-5)


def _field_bags(ids, w):
    w = np.broadcast_to(w, ids.shape).astype(np.float64)
    return np.einsum("bfk,bfkd->bd", w, TABLE.astype(np.float64)[ids])


BAGS_OVER_TWO_AXES = {
    "reduce_sum": lambda m, ids, w: tf.reduce_sum(tf.gather(m.t, ids) * w[..., None], [1, 2]),
    "einsum": lambda m, ids, w: tf.einsum("bfk,bfkd->bd", w, tf.gather(m.t, ids)),
}


@pytest.mark.parametrize("form", sorted(BAGS_OVER_TWO_AXES))
def test_weighted_bag_over_two_axes_broadcasts_weights_as_the_original(tmp_path, form):
    result = save_and_export(tmp_path, [FIELD_IDS, FIELD_WEIGHTS], BAGS_OVER_TWO_AXES[form])
    [site] = result.sites
    assert site.status == "fused", site.reason
    ids = _ids(2, FIELDS, K)
    for w, broadcasts in ((_weights(2, FIELDS, K), True), (_weights(2, 1, K), True), (_weights(2, FIELDS, 1), True),
                          (_weights(2, K, FIELDS), False), (_weights(2, FIELDS * K), False)):
        if form == "einsum" and w.shape != ids.shape:
            broadcasts = False  # tf.einsum does not broadcast a unit axis against another label's size
        _refused_or_answered_alike(tmp_path, result, {"args_0": ids, "args_1": w},
                                   _field_bags(ids, w) if broadcasts else None)


def test_partial_running_sum_refuses_weights_the_product_refuses(tmp_path):
    result = save_and_export(tmp_path, [WIDE_IDS, WIDE_WEIGHTS], lambda m, ids, w: tf.math.cumsum(
        tf.gather(m.t, ids) * w[..., None], axis=1)[:, 2])
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "cumsum"), site.reason
    for ids, w, broadcasts in ((_ids(2, WIDE), _weights(2, WIDE), True), (_ids(2, WIDE), _weights(2, 1), True),
                               (_ids(2, WIDE), _weights(2, 7), False), (_ids(2, WIDE), _weights(2, 3), False),
                               (_ids(2, 7), _weights(2, WIDE), False)):
        w_full = np.broadcast_to(w, ids.shape) if broadcasts else None
        expected = None if not broadcasts else np.einsum(
            "bk,bkd->bd", w_full[:, :3].astype(np.float64), TABLE.astype(np.float64)[ids[:, :3]])
        _refused_or_answered_alike(tmp_path, result, {"args_0": ids, "args_1": w}, expected)


def test_tflite_of_a_bag_over_two_axes_takes_resized_ids(tmp_path):
    from pkm_serve.tflite import run_tflite
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_mean(tf.gather(m.t, ids), [1, 2]),
                             tflite=str(tmp_path / "m.tflite"))
    assert result.sites[0].status == "fused", result.sites[0].reason
    for shape in ((2, FIELDS, K), (2, FIELDS + 1, K + 1)):
        ids = _ids(*shape)
        [got] = run_tflite(str(tmp_path / "m.tflite"), {"args_0": ids})
        np.testing.assert_allclose(got, TABLE.astype(np.float64)[ids].mean((1, 2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("divisor, label", [
    (lambda ids: tf.cast(tf.shape(ids)[-1], tf.float32), "sum"),   # K of F * K summed: no mean
    (lambda ids: tf.constant(float(K)), "sum"),
    (lambda ids: tf.constant(float(FIELDS * K)), "mean")])
def test_bag_over_two_axes_is_labelled_mean_only_when_divided_by_fields_times_positions(tmp_path, divisor, label):
    """reduce_sum(rows, [1, 2]) / tf.shape(ids)[-1] divides by K, not by the F * K rows summed: it was
    labelled 'mean'. The label follows what the division computes against numpy's mean."""
    result = save_and_export(tmp_path, [FIELD_IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t, ids), [1, 2]) /
                             divisor(ids))
    [site] = result.sites
    assert site.computes == label, (site.status, site.computes, site.reason)
    ids = _ids(2, FIELDS, K)
    got = run_as_a_server(result.dst, "serving_default", {"args_0": ids})
    is_mean = np.allclose(got, TABLE.astype(np.float64)[ids].mean((1, 2)), rtol=1e-5, atol=1e-6)
    assert is_mean == (label == "mean")


@pytest.mark.parametrize("sliced_rows", [False, True])
def test_per_position_sum_refuses_weights_narrower_than_its_positions(tmp_path, sliced_rows):
    """add_n(gather(t, ids[:, k]) * w[:, k:k+1]): w [B, 1] has no w[:, 1:2] to multiply position 1 by, and
    the original refuses it; the fused op broadcast w[:, 0:K] of width 1 over every position."""
    def body(m, ids, w):
        if sliced_rows:
            rows = tf.gather(m.t, ids)
            return tf.add_n([rows[:, k] * w[:, k:k + 1] for k in range(WIDE)])
        return tf.add_n([tf.gather(m.t, ids[:, k]) * w[:, k:k + 1] for k in range(WIDE)])
    result = save_and_export(tmp_path, [WIDE_IDS, WIDE_WEIGHTS], body)
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "per-position-sum"), site.reason
    ids = _ids(2, WIDE)
    for w, answers in ((_weights(2, WIDE), True), (_weights(2, WIDE + 2), True), (_weights(2, 1), False),
                       (_weights(2, 3), False)):
        expected = np.einsum("bk,bkd->bd", w[:, :WIDE].astype(np.float64), TABLE.astype(np.float64)[ids]) \
            if answers else None
        _refused_or_answered_alike(tmp_path, result, {"args_0": ids, "args_1": w}, expected)


@pytest.mark.parametrize("equation, ids_spec", [("bk,bkd->bd", WIDE_IDS), ("bfk,bfkd->bd", FIELD_IDS)])
def test_weighted_einsum_refuses_weights_it_does_not_broadcast(tmp_path, equation, ids_spec):
    """tf.einsum broadcasts no labelled axis: weights fed [B, 1] or [1, K] are refused by the original; the
    fused op broadcast them to the ids and answered."""
    w_spec = tf.TensorSpec(ids_spec.shape, tf.float32)
    result = save_and_export(tmp_path, [ids_spec, w_spec], lambda m, ids, w: tf.einsum(equation, w, tf.gather(m.t, ids)))
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "einsum"), site.reason
    ids = _ids(2, *ids_spec.shape[1:])
    for w_shape, answers in ((ids.shape, True), (ids.shape[:-1] + (1,), False), ((1,) + ids.shape[1:], False)):
        w = _weights(*w_shape)
        expected = np.einsum(equation, w.astype(np.float64), TABLE.astype(np.float64)[ids]) \
            if answers else None
        _refused_or_answered_alike(tmp_path, result, {"args_0": ids, "args_1": w}, expected)
