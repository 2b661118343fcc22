"""Bag forms users write that earlier rounds neither fused nor reported: each is
fused and computes what the original does (numpy float64 and the original
SavedModel as references), or reported with its true reason and left as written."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model
from round34_forms import loaded_signature

ops.load_library()

N, D = 30, 4
RNG = np.random.default_rng(32)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
IDS = tf.TensorSpec([None, 5], tf.int64)
WEIGHTS = tf.TensorSpec([None, 5], tf.float32)
RAGGED = tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)


def _save_and_export(tmp_path, specs, body, tflite_file=None):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.t_transposed = tf.Variable(TABLE.T.copy())
    module.shards = [tf.Variable(TABLE[:15]), tf.Variable(TABLE[15:])]  # "div": 15 rows each
    f = tf.function(input_signature=specs)(lambda *args: {"out": body(module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, tflite=tflite_file)


def _run_both(tmp_path, result, **inputs):
    original, fused = loaded_signature(tmp_path / "m"), loaded_signature(result.dst)
    return original(**inputs)["out"].numpy(), fused(**inputs)["out"].numpy()


def _sequence_masked_mean(padded, rt):
    mask = tf.sequence_mask(rt.row_lengths(), tf.shape(padded)[1], dtype=tf.float32)
    return tf.reduce_sum(padded * mask[..., None], 1) / tf.reduce_sum(mask, 1, keepdims=True)


UNFUSABLE = {
    "reduce_min": ([IDS], lambda m, ids: tf.reduce_min(tf.gather(m.t, ids), axis=1), "reduce_min"),
    "reduce_prod": ([IDS], lambda m, ids: tf.reduce_prod(tf.gather(m.t, ids), axis=-2), "reduce_prod"),
    "euclidean_norm": ([IDS], lambda m, ids: tf.math.reduce_euclidean_norm(tf.gather(m.t, ids), axis=1),
                       "reduce_euclidean_norm"),
    "ragged_reduce_min": ([RAGGED], lambda m, rt: tf.reduce_min(tf.gather(m.t, rt), axis=1),
                          "ragged reduce_min"),
    "segment_prod": ([RAGGED], lambda m, rt: tf.math.segment_prod(tf.gather(m.t, rt.values),
                                                                  rt.value_rowids()), "segment_prod"),
    "padded_to_fixed_shape": ([RAGGED], lambda m, rt: tf.reduce_sum(
        tf.gather(m.t, rt).to_tensor(shape=[None, 2, D]), axis=1), "fixed shape"),
    "padded_max": ([RAGGED], lambda m, rt: tf.reduce_max(tf.gather(m.t, rt).to_tensor(), axis=1),
                   "zero padding rows take part"),
    "padded_masked_mean": ([RAGGED], lambda m, rt: _sequence_masked_mean(tf.gather(m.t, rt).to_tensor(), rt),
                           "Mul between to_tensor()"),
    "padded_where": ([RAGGED], lambda m, rt: tf.reduce_sum(tf.where(
        tf.sequence_mask(rt.row_lengths())[..., None], tf.gather(m.t, rt).to_tensor(), 0.0), axis=1),
        "SelectV2 between to_tensor()"),
    "dense_over_shards": ([IDS], lambda m, ids: tf.reduce_mean(tf.nn.embedding_lookup(m.shards, ids), axis=1),
                          "split into shards"),
    "ragged_over_shards": ([RAGGED], lambda m, rt: tf.reduce_sum(tf.nn.embedding_lookup(m.shards, rt), axis=1),
                           "split into shards"),
    "gather_nd_of_reshaped_ids": ([IDS], lambda m, ids: tf.reduce_sum(
        tf.gather_nd(m.t, tf.reshape(ids, [-1, 5, 1])), axis=1), "tf.gather_nd of indices that are not"),
    "transposed_rows_keepdims": ([IDS], lambda m, ids: tf.reduce_mean(
        tf.transpose(tf.gather(m.t, ids), [0, 2, 1]), axis=2, keepdims=True), "transposed to [..., D, K]"),
    "transposed_table": ([IDS], lambda m, ids: tf.reduce_sum(tf.gather(m.t_transposed, ids, axis=1), axis=2),
                         "stored transposed"),
}


@pytest.mark.parametrize("form", sorted(UNFUSABLE))
def test_bags_the_op_cannot_compute_are_reported_and_left_as_written(tmp_path, form):
    specs, body, reason = UNFUSABLE[form]
    result = _save_and_export(tmp_path, specs, body)
    [site] = result.sites
    assert site.status == "skipped" and reason in site.reason, site.reason
    if specs[0] is RAGGED:
        bags = tf.ragged.constant([[1, 2, 3], [4], [5, 6]], dtype=tf.int64)
        inputs = {"args_0": bags.values, "args_0_1": bags.row_splits}
    else:
        inputs = {"args_0": RNG.integers(0, N, (3, 5))}
        if len(specs) == 2:
            inputs["args_1"] = RNG.uniform(0.5, 2, (3, 5)).astype(np.float32)
    want, got = _run_both(tmp_path, result, **inputs)
    np.testing.assert_array_equal(got, want)


def test_reductions_over_the_feature_axis_are_not_reported(tmp_path):
    """reduce_min / reduce_prod over D (each id's own row) pools no bag."""
    result = _save_and_export(tmp_path, [IDS], lambda m, ids: tf.reduce_min(tf.gather(m.t, ids), axis=-1) +
                              tf.reduce_prod(tf.gather(m.t, ids), axis=2))
    assert result.sites == []


REDUCE = {"sum": tf.reduce_sum, "mean": tf.reduce_mean}
RAGGED_WEIGHTS = tf.RaggedTensorSpec([None, None], tf.float32, row_splits_dtype=tf.int64)


def _padded_reference(bags, weights, reduce):
    """Each bag's weighted sum; a mean divides it by the longest bag (the padded axis)."""
    sums = np.array([np.sum([wk * TABLE[k].astype(np.float64) for k, wk in zip(bag, wb)], axis=0)
                     if bag else np.zeros(D) for bag, wb in zip(bags, weights)]).reshape(-1, D)
    if reduce == "sum":
        return sums
    with np.errstate(invalid="ignore"):
        return sums / max([len(b) for b in bags], default=0)


@pytest.mark.parametrize("reduce", sorted(REDUCE))
@pytest.mark.parametrize("weighted", [False, True])
def test_ragged_rows_padded_by_to_tensor_then_reduced_are_fused(tmp_path, reduce, weighted):
    """to_tensor() pads bags with zero rows, so their sum is the ragged bag sum, and
    their mean that sum over the longest bag's length (NaN where all bags are empty)."""
    lite = str(tmp_path / "m.tflite") if weighted == (reduce == "mean") else None  # conversions are slow
    if weighted:  # shape=[None, None, D] fixes nothing the rows do not have
        body = lambda m, rt, w: REDUCE[reduce]((tf.gather(m.t, rt) * w[..., None]).to_tensor(  # noqa: E731
            shape=[None, None, D]), 1)
        result = _save_and_export(tmp_path, [RAGGED, RAGGED_WEIGHTS], body, lite)
    else:
        result = _save_and_export(tmp_path, [RAGGED], lambda m, rt: REDUCE[reduce](
            tf.gather(m.t, rt).to_tensor(), axis=1), lite)
    [site] = result.sites
    assert (site.status, site.pattern, site.weighted, site.computes) == ("fused", "ragged-reduce", weighted, reduce)
    for bags in ([[1, 2, 3], [], [4], [5, 6, 7, 8]], [[], []], [[9]], []):
        ids = tf.ragged.constant(bags, dtype=tf.int64, ragged_rank=1, inner_shape=()) if bags \
            else tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), tf.zeros([1], tf.int64))
        w = tf.RaggedTensor.from_row_splits(
            RNG.uniform(0.5, 2, ids.values.shape).astype(np.float32), ids.row_splits)
        inputs = {"args_0": ids.values, "args_0_1": ids.row_splits}
        if weighted:
            inputs.update(args_1=w.values, args_1_1=w.row_splits)
        reference = _padded_reference(bags, w.to_list() if weighted else [[1.0] * len(b) for b in bags], reduce)
        want, got = _run_both(tmp_path, result, **inputs)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-6)
        if lite:
            from_lite = tflite.run_tflite(lite, inputs, interpreter="litert")[0]
            np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-6)


GATHER_ND = {
    "sum": ([IDS], lambda m, ids: tf.reduce_sum(tf.gather_nd(m.t, ids[..., None]), axis=1)),
    "mean_expand_dims": ([IDS], lambda m, ids: tf.reduce_mean(tf.gather_nd(m.t, tf.expand_dims(ids, -1)), 1)),
    "weighted": ([IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        tf.gather_nd(m.t, ids[..., None]) * w[..., None], axis=1)),
}


@pytest.mark.parametrize("form", sorted(GATHER_ND))
def test_gather_nd_of_ids_with_a_unit_last_axis_is_a_row_gather_and_fused(tmp_path, form):
    """tf.gather_nd(table, ids[..., None]) gathers table[ids]: fused like tf.gather."""
    specs, body = GATHER_ND[form]
    lite = str(tmp_path / "m.tflite") if form == "weighted" else None
    result = _save_and_export(tmp_path, specs, body, lite)
    [site] = result.sites
    assert (site.status, site.pattern) == ("fused", "gather-reduce")
    ids = RNG.integers(0, N, (3, 5))
    w = RNG.uniform(-2, 2, (3, 5)).astype(np.float32) if len(specs) == 2 else np.ones((3, 5), np.float32)
    inputs = {"args_0": ids, **({"args_1": w} if len(specs) == 2 else {})}
    reference = np.einsum("bk,bkd->bd", w.astype(np.float64), TABLE.astype(np.float64)[ids])
    reference /= 5 if form.startswith("mean") else 1
    want, got = _run_both(tmp_path, result, **inputs)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-6)
    if lite:
        np.testing.assert_allclose(tflite.run_tflite(lite, inputs, interpreter="litert")[0], reference,
                                   rtol=1e-5, atol=1e-6)
    for bad in (N + 3, -1):  # the original's gather_nd refuses both; so does the fused model
        inputs["args_0"] = np.where(np.arange(5) == 2, bad, ids)
        for model in (tf.saved_model.load(str(tmp_path / "m")), tf.saved_model.load(result.dst)):
            with pytest.raises(tf.errors.InvalidArgumentError):
                model.signatures["serving_default"](**inputs)


def _one_hot_weighted_counts(module, ids, w):
    return tf.reduce_sum(tf.one_hot(ids, N) * w[..., None], axis=1) @ module.t


def test_weighted_one_hot_counts_times_the_table_are_fused(tmp_path):
    """sum_k one_hot(ids)[b, k] * w[b, k] @ table is the weighted bag; an id outside
    [0, N) has an all-zero one_hot row, so it counts nowhere (padding)."""
    lite = str(tmp_path / "m.tflite")
    result = _save_and_export(tmp_path, [IDS, WEIGHTS], _one_hot_weighted_counts, lite)
    [site] = result.sites
    assert site.status == "fused" and site.pattern == "counts-matmul" and site.weighted
    ids = RNG.integers(0, N, (4, 5))
    ids[1, 2], ids[2, 0] = N + 3, -2
    w = RNG.uniform(-2, 2, (4, 5)).astype(np.float32)
    for feed_ids, feed_w in ((ids, w), (ids[:1], w[:1]), (ids[:0], w[:0])):
        inside = (feed_ids >= 0) & (feed_ids < N)
        reference = np.einsum("bk,bkd->bd", np.where(inside, feed_w, 0).astype(np.float64),
                              TABLE.astype(np.float64)[np.where(inside, feed_ids, 0)])
        want, got = _run_both(tmp_path, result, args_0=feed_ids, args_1=feed_w)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-5)
        from_lite = tflite.run_tflite(lite, {"args_0": feed_ids, "args_1": feed_w}, interpreter="litert")[0]
        np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-5)


def test_one_hot_times_a_multiplier_not_per_index_is_reported(tmp_path):
    """w[:, :1, None] weighs every id of a bag by its first weight: no per-index weights."""
    result = _save_and_export(tmp_path, [IDS, WEIGHTS], lambda m, ids, w: tf.reduce_sum(
        tf.one_hot(ids, N) * w[:, :1, None], axis=1) @ m.t)
    [site] = result.sites
    assert site.status == "skipped" and "not per index" in site.reason
    ids, w = RNG.integers(0, N, (3, 5)), RNG.uniform(0.5, 2, (3, 5)).astype(np.float32)
    want, got = _run_both(tmp_path, result, args_0=ids, args_1=w)
    np.testing.assert_array_equal(got, want)


def _sparse_dense_matmul(module, sp):
    return tf.sparse.sparse_dense_matmul(sp, module.t)


def _sparse_reference(indices, values, rows):
    out = np.zeros((rows, D))
    for (row, column), value in zip(indices, values):
        out[row] += value * TABLE[column].astype(np.float64)
    return out


def test_sparse_dense_matmul_entries_in_any_row_order_give_the_composite_bags(tmp_path):
    """The composite takes sp's entries in any order; the fused SavedModel refused
    them (a sorted-rows Assert) and the .tflite summed them into the wrong bags."""
    lite = str(tmp_path / "m.tflite")
    result = _save_and_export(tmp_path, [tf.SparseTensorSpec([None, N], tf.float32)], _sparse_dense_matmul, lite)
    assert [(s.status, s.pattern) for s in result.sites] == [("fused", "sparse_dense_matmul")]
    indices = np.array([[3, 7], [0, 1], [2, 9], [0, 5], [3, 2], [2, 9]], np.int64)
    values = RNG.uniform(-2, 2, len(indices)).astype(np.float32)
    for order, rows in ((RNG.permutation(len(indices)), 5), (np.arange(len(indices)), 4), ([], 0), ([], 2)):
        inputs = {"args_0": indices[order].reshape(-1, 2), "args_0_1": values[order],
                  "args_0_2": np.array([rows, N], np.int64)}
        reference = _sparse_reference(indices[order].reshape(-1, 2), values[order], rows)
        want, got = _run_both(tmp_path, result, **inputs)
        np.testing.assert_allclose(want, reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
        from_lite = tflite.run_tflite(lite, inputs, interpreter="litert")[0]
        np.testing.assert_allclose(from_lite, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("columns", [N - 10, N + 10])
def test_sparse_dense_matmul_of_another_width_than_the_table_is_refused(tmp_path, columns):
    """sp [B, M] @ table [N, D] with M != N: the composite refuses it; the fused
    SavedModel served it."""
    result = _save_and_export(tmp_path, [tf.SparseTensorSpec([None, N], tf.float32)], _sparse_dense_matmul)
    inputs = {"args_0": np.array([[0, 1], [1, 3]], np.int64), "args_0_1": np.ones(2, np.float32),
              "args_0_2": np.array([2, columns], np.int64)}
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    with pytest.raises(tf.errors.InvalidArgumentError, match="inner dimension"):
        original(**inputs)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"dense_shape\[1\] =\] \[{columns}\] \[columns, but "
                       rf"the table has {N} rows"):
        fused(**inputs)
