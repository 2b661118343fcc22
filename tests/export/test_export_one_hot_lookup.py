"""A lookup written as tf.matmul(tf.one_hot(ids, N), table) (tf-models-official's OnDeviceEmbedding with
use_one_hot=True, as TPU configs set it) pooled over the sequence found no site; now the bag of the ids, an id
outside [0, N) (a zero row in the composite) padding in the fused op. Checked against numpy float64 and
the original SavedModel, out-of-range ids included."""
import numpy as np
import pytest
import tensorflow as tf

from round34_forms import D, N, RNG, TABLE, save_and_export

L = 5
IDS = tf.TensorSpec([None, L], tf.int32)
WEIGHTS = tf.TensorSpec([None, L], tf.float32)


def _one_hot_module(reduce):
    from official.nlp.modeling.layers import OnDeviceEmbedding
    layer = OnDeviceEmbedding(N, D, use_one_hot=True)
    layer.build([None, L])
    layer.embeddings.assign(TABLE)
    module = tf.Module()
    module.layer = layer
    module.f = tf.function(input_signature=[IDS, WEIGHTS])(lambda ids, w: {"out": reduce(layer(ids), w)})
    return module


def _ids_with_zero_rows():
    ids = RNG.integers(0, N, (4, L)).astype(np.int32)
    ids[1, 2], ids[2, 0], ids[3, :] = -1, N + 3, -2  # one_hot gives them zero rows; row 3 all of them
    return ids


def _reference(ids, w, divide_by):
    rows = np.where(((ids >= 0) & (ids < N))[..., None], TABLE.astype(np.float64)[np.clip(ids, 0, N - 1)], 0.0)
    return np.einsum("bl,bld->bd", w.astype(np.float64), rows) / divide_by


POOLED = {"sum": (lambda rows, w: tf.reduce_sum(rows, 1), False, 1),
          "mean": (lambda rows, w: tf.reduce_mean(rows, 1), False, L),
          "weighted_sum": (lambda rows, w: tf.reduce_sum(rows * w[..., None], 1), True, 1)}


@pytest.mark.parametrize("form", sorted(POOLED))
def test_one_hot_lookup_pooled_over_the_sequence_is_a_bag(tmp_path, form):
    reduce, weighted, divide_by = POOLED[form]
    module = _one_hot_module(reduce)
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    from pkm_serve.export import export_saved_model
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = _ids_with_zero_rows()
    w = RNG.uniform(0.5, 1.5, ids.shape).astype(np.float32)
    expected = _reference(ids, w if weighted else np.ones(ids.shape), divide_by)
    for model in (tmp_path / "m", result.dst):
        out = tf.saved_model.load(str(model)).signatures["serving_default"](ids=ids, w=w)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_max_of_a_one_hot_lookup_is_reported(tmp_path):
    """An out-of-range id's zero row takes part in the composite's max; the op's padding would not."""
    def body(m, ids):
        rows = tf.reshape(tf.matmul(tf.one_hot(tf.reshape(ids, [-1]), N), m.t), tf.concat([tf.shape(ids), [D]], 0))
        return tf.reduce_max(rows, 1)
    result = save_and_export(tmp_path, [tf.TensorSpec([None, L], tf.int64)], body)
    [site] = result.sites
    assert site.status == "skipped" and "one-hot" in site.reason, site.reason
    ids = _ids_with_zero_rows().astype(np.int64)
    out = tf.saved_model.load(result.dst).signatures["serving_default"](args_0=ids)["out"].numpy()
    rows = np.where(((ids >= 0) & (ids < N))[..., None], TABLE.astype(np.float64)[np.clip(ids, 0, N - 1)], 0.0)
    np.testing.assert_allclose(out, rows.max(1), rtol=1e-6)


def test_one_hot_lookups_one_position_at_a_time_keep_zero_rows_for_ids_outside_the_table(tmp_path):
    """tf.add_n([tf.matmul(tf.one_hot(ids[:, k], N), t) for k]) is a per-position bag; an id outside [0, N) is a
    zero row there, so the fused model must not refuse it (its range check came with the per-position site)."""
    ids_spec = tf.TensorSpec([None, L], tf.int64)
    result = save_and_export(tmp_path, [ids_spec], lambda m, ids: tf.add_n(
        [tf.matmul(tf.one_hot(ids[:, k], N), m.t) for k in range(L)]))
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "per-position-sum"), site.reason
    ids = _ids_with_zero_rows().astype(np.int64)
    expected = _reference(ids, np.ones(ids.shape), 1)
    for model in (tmp_path / "m", result.dst):
        out = tf.saved_model.load(str(model)).signatures["serving_default"](args_0=ids)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


MASKED = {  # a mask of the one-hot rows: where(mask, rows, 0), or multiply_no_nan's zero weights (padding too)
    "where": (lambda rows, w: tf.reduce_sum(tf.where((w > 0)[..., None], rows, 0.0), 1), lambda w: w > 0),
    "multiply_no_nan": (lambda rows, w: tf.reduce_sum(tf.math.multiply_no_nan(rows, w[..., None]), 1), lambda w: w),
}


@pytest.mark.parametrize("form", sorted(MASKED))
def test_masked_one_hot_lookup_takes_ids_outside_the_table_as_zero_rows(tmp_path, form):
    """A masked site asserts every id < N (a gather refuses one, masked or not); a one-hot lookup gives it a zero
    row, so the fused model failed an assertion where the original returned the bag."""
    reduce, weights = MASKED[form]
    module = _one_hot_module(reduce)
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    from pkm_serve.export import export_saved_model
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = _ids_with_zero_rows()
    w = RNG.uniform(-1, 1.5, ids.shape).astype(np.float32)
    w[2, 0] = 1.0  # the id N + 3 kept
    expected = _reference(ids, weights(w).astype(np.float64), 1)
    for model in (tmp_path / "m", result.dst):
        out = tf.saved_model.load(str(model)).signatures["serving_default"](ids=ids, w=w)["out"].numpy()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
