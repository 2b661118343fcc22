"""Forms once reported with a reason that misled, and what holds now. Weights applied to gathered rows of
flattened ids before the reshape that groups them into bags (reshape(gather(t, reshape(ids, [-1])) *
reshape(w, [-1, 1]), [-1, K, D]), or to concat(tf.shape(ids), [D])) weigh each id: since round 38 they are
fused, reshaped with the ids (FUSED_FORMS); a mask there stays reported. tf.gather(params, ids, batch_dims=1)
of one table broadcast over the ids' own batch is t[ids], fused since round 38; a table per request stays
reported. (A one-hot lookup written with tf.tensordot, once listed here, is fused:
test_export_one_hot_batched_lookups.py.) One export of one model holding every form: each reported with its
reason or fused, outputs against numpy float64 and the original."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import FIELD_IDS, FIELDS, IDS, K, N, RNG, TABLE, WEIGHTS, save_and_export

D = TABLE.shape[1]
RESHAPE_WORDS = "before the reshape that groups them into bags"
BATCH_DIMS_WORDS = "batch_dims=1): each batch entry gathers from its own params"
FIELD_WEIGHTS = tf.TensorSpec([None, FIELDS, K], tf.float32)


def _flat_rows(m, ids, width=-1):
    return tf.gather(m.t, tf.reshape(ids, [width] if width == -1 else [-1, width]))


FORMS = {  # name: (body of (module, ids, w, field ids, field weights), numpy float64 reference[, reason words])
    "masked": (lambda m, i, w, f, fw: tf.reduce_sum(tf.reshape(tf.where(
        tf.reshape(i, [-1, 1]) > 3, _flat_rows(m, i), 0.0), [-1, K, D]), 1),
        lambda ids, rows, w, frows, fw: np.where(ids[..., None] > 3, rows, 0.0).sum(1)),
    "batch_dims_per_request_table": (lambda m, i, w, f, fw: tf.reduce_sum(tf.gather(
        m.t[None] * w[:, :1, None], i, batch_dims=1), 1),
        lambda ids, rows, w, frows, fw: rows.sum(1) * w[:, :1], BATCH_DIMS_WORDS),
}


# Fused since round 38: weights of the flattened ids applied before the reshape into bags (reshaped with the
# ids), and tf.gather(params, ids, batch_dims=1) of one table broadcast over the ids' batch (t[ids])
FUSED_FORMS = {
    # weights of the flattened ids before the reshape into bags: reported before round 38
    "constant_target": (lambda m, i, w, f, fw: tf.reduce_sum(tf.reshape(
        _flat_rows(m, i) * tf.reshape(w, [-1, 1]), [-1, K, D]), 1),
        lambda ids, rows, w, frows, fw: np.einsum("bk,bkd->bd", w, rows)),
    "shape_target": (lambda m, i, w, f, fw: tf.reduce_sum(tf.reshape(
        _flat_rows(m, i) * tf.reshape(w, [-1, 1]), tf.concat([tf.shape(i), [D]], 0)), 1),
        lambda ids, rows, w, frows, fw: np.einsum("bk,bkd->bd", w, rows)),
    "regrouped_fields": (lambda m, i, w, f, fw: tf.reshape(tf.reduce_sum(tf.reshape(
        _flat_rows(m, f, FIELDS * K) * tf.reshape(fw, [-1, FIELDS * K, 1]), [-1, FIELDS, K, D]), 2),
        [-1, FIELDS * D]), lambda ids, rows, w, frows, fw: np.einsum("bfk,bfkd->bfd", fw, frows).reshape(len(w), -1)),
    "batch_dims_broadcast_table": (lambda m, i, w, f, fw: tf.reduce_sum(tf.gather(
        tf.broadcast_to(m.t[None], [tf.shape(i)[0], N, D]), i, batch_dims=1), 1),
        lambda ids, rows, w, frows, fw: rows.sum(1)),
    "batch_dims_tiled_weighted": (lambda m, i, w, f, fw: tf.reduce_sum(tf.gather(
        tf.tile(tf.expand_dims(m.t, 0), [tf.shape(i)[0], 1, 1]), i, batch_dims=1) * w[..., None], 1),
        lambda ids, rows, w, frows, fw: np.einsum("bk,bkd->bd", w, rows)),
    "batch_dims_per_field_mean": (lambda m, i, w, f, fw: tf.reshape(tf.reduce_mean(tf.gather(
        tf.broadcast_to(m.t[None], [tf.shape(f)[0], N, D]), f, batch_dims=1), 2), [-1, FIELDS * D]),
        lambda ids, rows, w, frows, fw: frows.mean(2).reshape(len(w), -1)),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("weights_before_reshape")
    result = save_and_export(tmp_path, [IDS, WEIGHTS, FIELD_IDS, FIELD_WEIGHTS], lambda m, *args: tf.concat(
        [form[0](m, *args) for form in list(FORMS.values()) + list(FUSED_FORMS.values())], 1))
    ids, fields = RNG.integers(0, N, (4, K)), RNG.integers(0, N, (4, FIELDS, K))
    w, fw = RNG.uniform(0.5, 2, ids.shape).astype(np.float32), RNG.uniform(0.5, 2, fields.shape).astype(np.float32)
    inputs = {"args_0": ids, "args_1": w, "args_2": fields, "args_3": fw}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    table = TABLE.astype(np.float64)
    expected = [ref(ids, table[ids], w.astype(np.float64), table[fields], fw.astype(np.float64))
                for _, ref, *_ in list(FORMS.values()) + list(FUSED_FORMS.values())]
    return result, original, fused, np.concatenate(expected, 1)


def test_misleading_forms_are_reported_with_what_the_model_does(exported):
    result = exported[0]
    assert len(result.sites) == len(FORMS) + len(FUSED_FORMS), [s.reason for s in result.sites]
    for site in result.sites[len(FORMS):]:
        assert site.status == "fused", site.reason
    for site, (_, _, *words) in zip(result.sites, FORMS.values()):
        assert site.status == "skipped" and (words or [RESHAPE_WORDS])[0] in site.reason, site.reason
        assert "multiplier is not per-index" not in site.reason.split("(")[0]


def test_misleading_forms_still_compute_the_original(exported):
    _, original, fused, expected = exported
    np.testing.assert_allclose(original, expected, rtol=1e-5, atol=1e-5)
    reported = sum(ref(np.zeros((1, K), int), np.zeros((1, K, D)), np.ones((1, K)), np.zeros((1, FIELDS, K, D)),
                       np.ones((1, FIELDS, K))).shape[1] for _, ref, *_ in FORMS.values())
    np.testing.assert_array_equal(fused[:, :reported], original[:, :reported])
    np.testing.assert_allclose(fused[:, reported:], expected[:, reported:], rtol=1e-5, atol=1e-5)


def test_weights_before_the_reshape_follow_ids_a_server_feeds_in_another_shape(tmp_path):
    """TF Serving feeds [2, 2K] ids to the [None, K] signature: the constant reshape makes 4 bags of K of the
    weighted rows; the fused weights are reshaped with the ids as the composite's rows are."""
    from export_models import run_as_a_server
    body = FUSED_FORMS["constant_target"][0]
    result = save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, i, w: body(m, i, w, None, None))
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids, w = RNG.integers(0, N, (2, 2 * K)), RNG.uniform(0.5, 2, (2, 2 * K)).astype(np.float32)
    expected = np.einsum("bk,bkd->bd", w.reshape(4, K), TABLE.astype(np.float64)[ids.reshape(4, K)])
    for model in (tmp_path / "m", result.dst):
        got = run_as_a_server(model, "serving_default", {"args_0": ids, "args_1": w})
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
