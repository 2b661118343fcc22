"""One-hot lookups of rank-3 ids written without the flattening reshape: tf.matmul(tf.one_hot(ids, N), table)
(a BatchMatMulV2 broadcasting the [N, D] table), tf.einsum('bkn,nd->bkd', ...) then reduced, and the einsum
that looks up and sums at once, tf.einsum('bkn,nd->bd', ...). They were no site at all (not even reported).
tf.tensordot(one_hot, table, 1) and keras.ops.matmul (the one-hot flattened to [-1, N], the product reshaped
back) were reported, not fused. One-hot rows divided by a tensor that may be 0 (a mean over the ids in
range, rows / count[:, :, None], for a bag with none; w == 0 at an id outside [0, N)) are 0 / 0, NaN in the
composite, where the fused op's padding left them out (0): reported (REPORTED); divide_no_nan is fused.
One export of one model holding every form; each output slice checked against numpy float64 and the original,
ids outside [0, N) included (a zero row in the composite, padding in the fused op)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import FIELD_IDS, FIELDS, IDS, K, N, RNG, TABLE, WEIGHTS, save_and_export

D = TABLE.shape[1]


def _hot(ids):
    return tf.one_hot(ids, N)


FORMS = [  # (name, body of (module, ids [B, K], weights [B, K], field ids [B, F, K]), output width)
    ("batch_matmul_then_sum", lambda m, i, w, f: tf.reduce_sum(tf.matmul(_hot(i), m.t), 1), D),
    ("batch_matmul_weighted", lambda m, i, w, f: tf.reduce_sum(tf.matmul(_hot(i), m.t) * w[..., None], 1), D),
    ("einsum_lookup_then_mean", lambda m, i, w, f: tf.reduce_mean(tf.einsum("bkn,nd->bkd", _hot(i), m.t), 1), D),
    ("einsum_pooled", lambda m, i, w, f: tf.einsum("bkn,nd->bd", _hot(i), m.t), D),
    ("einsum_pooled_table_first", lambda m, i, w, f: tf.einsum("nd,bkn->bd", m.t, _hot(i)), D),
    ("einsum_pooled_per_field", lambda m, i, w, f: tf.reshape(tf.einsum("bfkn,nd->bfd", _hot(f), m.t),
                                                              [-1, FIELDS * D]), FIELDS * D),
    ("einsum_pooled_over_fields", lambda m, i, w, f: tf.einsum("bfkn,nd->bd", _hot(f), m.t), D),
    # tf.tensordot / keras.ops.matmul flatten the one-hot to [-1, N] and reshape the product back
    ("tensordot_then_sum", lambda m, i, w, f: tf.reduce_sum(tf.tensordot(_hot(i), m.t, 1), 1), D),
    ("keras_matmul_weighted", lambda m, i, w, f: tf.reduce_sum(keras.ops.matmul(_hot(i), m.t) * w[..., None], 1), D),
    ("tensordot_per_field_mean", lambda m, i, w, f: tf.reshape(tf.reduce_mean(
        tf.tensordot(_hot(f), m.t, [[3], [0]]), 2), [-1, FIELDS * D]), FIELDS * D),
    ("tensordot_mean_of_ids_in_range_no_nan", lambda m, i, w, f: tf.reduce_sum(tf.math.divide_no_nan(
        tf.tensordot(_hot(i), m.t, 1), _in_range_count(i)[:, :, None]), 1), D),
]

# one-hot rows divided by a tensor that may be 0: fused with 0 (padding) where the composite's 0 / 0 is NaN
# before round 38's review; reported
REPORTED = [
    ("tensordot_mean_of_ids_in_range", lambda m, i, w, f: tf.reduce_sum(
        tf.tensordot(_hot(i), m.t, 1) / _in_range_count(i)[:, :, None], 1), D),
    ("batch_matmul_divided_per_index", lambda m, i, w, f: tf.reduce_sum(tf.matmul(_hot(i), m.t) / w[..., None], 1),
     D),
]


def _in_range_count(ids):
    return tf.reduce_sum(tf.cast((ids >= 0) & (ids < N), tf.float32), 1, keepdims=True)


def _references(ids, w, fields):
    table = np.concatenate([TABLE.astype(np.float64), np.zeros((1, D))])  # row N: the zero row of other ids
    rows = table[np.where((ids >= 0) & (ids < N), ids, N)]
    field_rows = table[np.where((fields >= 0) & (fields < N), fields, N)]
    return {"batch_matmul_then_sum": rows.sum(1), "batch_matmul_weighted": np.einsum("bk,bkd->bd", w, rows),
            "einsum_lookup_then_mean": rows.mean(1), "einsum_pooled": rows.sum(1),
            "einsum_pooled_table_first": rows.sum(1),
            "einsum_pooled_per_field": field_rows.sum(2).reshape(len(ids), -1),
            "einsum_pooled_over_fields": field_rows.sum((1, 2)), "tensordot_then_sum": rows.sum(1),
            "keras_matmul_weighted": np.einsum("bk,bkd->bd", w, rows),
            "tensordot_per_field_mean": field_rows.mean(2).reshape(len(ids), -1)} | _divided(ids, w, rows)


def _divided(ids, w, rows):
    count = ((ids >= 0) & (ids < N)).sum(1, keepdims=True)[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"tensordot_mean_of_ids_in_range_no_nan": np.where(count == 0, 0.0, rows / count).sum(1),
                "tensordot_mean_of_ids_in_range": (rows / count).sum(1),
                "batch_matmul_divided_per_index": (rows / w[..., None]).sum(1)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("one_hot")
    result = save_and_export(tmp_path, [IDS, WEIGHTS, FIELD_IDS], lambda m, i, w, f: tf.concat(
        [body(m, i, w, f) for _, body, _ in FORMS + REPORTED], 1))
    ids = RNG.integers(0, N, (5, K))
    ids[1, 0], ids[2, 3] = -1, N + 2  # zero rows in the composite
    ids[4] = [-1, N, N + 1, -3, N]  # no id in range: a zero count
    fields = RNG.integers(-1, N + 2, (5, FIELDS, K))
    w = RNG.uniform(0.5, 2, ids.shape).astype(np.float32)
    w[1, 0] = 0.0  # at the id -1: 0 / 0
    inputs = {"args_0": ids, "args_1": w, "args_2": fields}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)["out"].numpy()
    return result, original, fused, _references(ids, w.astype(np.float64), fields)


def test_batched_one_hot_lookups_are_fused_unless_divided_by_what_may_be_0(exported):
    result = exported[0]
    assert [s.status for s in result.sites] == ["fused"] * len(FORMS) + ["skipped"] * len(REPORTED), \
        [s.reason for s in result.sites]
    assert all("which may be 0" in s.reason for s in result.sites[len(FORMS):]), [s.reason for s in result.sites]


@pytest.mark.parametrize("form", range(len(REPORTED)), ids=[name for name, _, _ in REPORTED])
def test_one_hot_rows_divided_by_what_may_be_0_compute_the_original(exported, form):
    _, original, fused, references = exported
    start = sum(width for _, _, width in FORMS + REPORTED[:form])
    name, _, width = REPORTED[form]
    assert np.isnan(references[name]).any()
    np.testing.assert_allclose(original[:, start:start + width], references[name], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[:, start:start + width], references[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", range(len(FORMS)), ids=[name for name, _, _ in FORMS])
def test_batched_one_hot_bag_computes_the_original(exported, form):
    _, original, fused, references = exported
    start = sum(width for _, _, width in FORMS[:form])
    name, _, width = FORMS[form]
    np.testing.assert_allclose(original[:, start:start + width], references[name], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused[:, start:start + width], references[name], rtol=1e-5, atol=1e-5)
