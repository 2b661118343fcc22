"""Bags users write with segment ops and matrix-vector products (round 31):
each is fused and equal to numpy in the SavedModel and the .tflite, or
reported and left as written."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model

ops.load_library()

N, D = 30, 4
RNG = np.random.default_rng(131)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)


def _save(path, specs, body):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(lambda *args: {"out": body(module.t, *args)}, input_signature=specs)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})


def _export(tmp_path, samples=None):
    kw = {}
    if samples is not None:
        np.savez(tmp_path / "samples.npz", **samples)
        kw["sample_inputs"] = str(tmp_path / "samples.npz")
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), tflite=str(tmp_path / "m.tflite"),
                              quiet=True, **kw)


def _outputs(tmp_path, result, inputs):
    """(original, fused SavedModel, .tflite) outputs on `inputs`."""
    def serve(path):
        signature = tf.saved_model.load(str(path)).signatures["serving_default"]
        return signature(**{k: tf.constant(v) for k, v in inputs.items()})["out"].numpy()
    runner = tflite.make_interpreter(str(tmp_path / "m.tflite")).get_signature_runner("serving_default")
    return serve(tmp_path / "m"), serve(result.dst), runner(**inputs)["out"]


def test_a_segment_mean_of_gathered_rows_is_fused(tmp_path):
    """tf.math.segment_mean was neither fused nor reported (segment_sum and
    segment_max were). Bag 0 and bag 2 are empty (0), bag 1 holds a duplicate."""
    specs = [tf.TensorSpec([None], tf.int64, "values"), tf.TensorSpec([None], tf.int64, "segments")]
    _save(tmp_path / "m", specs, lambda t, values, segments: tf.math.segment_mean(tf.gather(t, values), segments))
    inputs = {"values": np.array([3, 3, 7, 0, 29, 11], np.int64), "segments": np.array([1, 1, 1, 3, 3, 4], np.int64)}
    result = _export(tmp_path, samples=inputs)
    assert [(s.status, s.pattern, s.combiner, s.computes) for s in result.sites] == [
        ("fused", "segment-reduce", "mean", "mean")]
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    table = TABLE.astype(np.float64)
    reference = np.zeros((5, D))
    for bag in range(5):
        rows = table[inputs["values"][inputs["segments"] == bag]]
        if len(rows):
            reference[bag] = rows.mean(0)
    for got in _outputs(tmp_path, result, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


MATVEC_FORMS = {
    # [B, D]: matmul(rows, w[..., None], adjoint_a=True), squeezed
    "matvec": lambda rows, w: tf.linalg.matvec(rows, w, transpose_a=True),
    # [B, D, 1]: the rows transposed by a Transpose op
    "transposed_rows": lambda rows, w: tf.matmul(tf.transpose(rows, [0, 2, 1]), w[:, :, None]),
    # [B, 1, D]: the weights as a column, adjoint (was reported as "not w[..., None, :] @ rows")
    "adjoint_weights": lambda rows, w: tf.matmul(w[:, :, None], rows, transpose_a=True),
    # [B, D, 1]: a [B, K, 1] column of another tensor (squeezed for the op)
    "weights_column": lambda rows, w: tf.matmul(rows, tf.stack([w, -w], -1)[:, :, :1], transpose_a=True),
}


@pytest.mark.parametrize("form", list(MATVEC_FORMS))
def test_a_weighted_bag_as_a_matrix_vector_product_is_fused(tmp_path, form):
    """Before, the rows-first spellings were not even reported."""
    specs = [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, 5], tf.float32, "w")]
    _save(tmp_path / "m", specs, lambda t, ids, w: MATVEC_FORMS[form](tf.gather(t, ids), w))
    result = _export(tmp_path)
    assert [(s.status, s.pattern, s.weighted) for s in result.sites] == [("fused", "matmul", True)], \
        [s.reason for s in result.sites]
    assert result.tflite["custom_ops"] == ["PkmEmbeddingBag"]
    ids = RNG.integers(0, N, (6, 5)).astype(np.int64)
    ids[0] = 4  # one id five times
    inputs = {"ids": ids, "w": RNG.uniform(-1.0, 2.0, (6, 5)).astype(np.float32)}
    bag = np.einsum("bk,bkd->bd", inputs["w"].astype(np.float64), TABLE.astype(np.float64)[ids])
    reference = {"matvec": bag, "adjoint_weights": bag[:, None, :]}.get(form, bag[:, :, None])
    for got in _outputs(tmp_path, result, inputs):
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_rows_scored_by_a_vector_are_no_bag(tmp_path):
    """rows @ v ([B, K, D] @ [D, 1]: a score per row, attention's first step)
    pools nothing: neither fused nor reported."""
    specs = [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, D], tf.float32, "v")]
    _save(tmp_path / "m", specs, lambda t, ids, v: tf.matmul(tf.gather(t, ids), v[:, :, None]))
    assert _export(tmp_path).sites == []



def test_rows_pooled_into_several_columns_are_no_bag_and_an_adjoint_column_is_reported(tmp_path):
    """As docs/export.md says: rows^T @ W [B, K, 3] pools the rows into three columns (no bag:
    neither fused nor reported); rows^T @ adjoint(w[:, None, :]) is one column, reported."""
    specs = [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, 5, 3], tf.float32, "w")]
    _save(tmp_path / "m", specs, lambda t, ids, w: tf.matmul(tf.gather(t, ids), w, transpose_a=True))
    assert _export(tmp_path).sites == []
    specs = [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, 5], tf.float32, "w")]
    _save(tmp_path / "m2", specs,
          lambda t, ids, w: tf.matmul(tf.gather(t, ids), w[:, None, :], transpose_a=True, transpose_b=True))
    result = export_saved_model(str(tmp_path / "m2"), str(tmp_path / "out2"), quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("skipped", "matmul")]

SPARSE_SPEC = tf.SparseTensorSpec([None, N], tf.float32)


def _sparse_inputs(indices, values, rows=5):
    return {"sp": np.array(indices, np.int64), "sp_1": np.array(values, np.float32), "sp_2": np.array([rows, N], np.int64)}


def test_sparse_dense_matmul_by_the_table_is_a_weighted_bag(tmp_path):
    """tf.sparse.sparse_dense_matmul(sp [B, N], table) was neither fused nor reported
    (and its op has no TFLite builtin). Row 1 and the last row are empty, (0, 7)
    is given twice (summed, as the composite does)."""
    def body(t, sp):
        return tf.sparse.sparse_dense_matmul(sp, t)
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(lambda sp: {"out": body(module.t, sp)}, input_signature=[SPARSE_SPEC])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    names = sorted(tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"].structured_input_signature[1])
    inputs = dict(zip(names, _sparse_inputs([[0, 7], [0, 7], [0, 29], [2, 0], [3, 11], [3, 4]],
                                            [1.0, 0.5, -2.0, 3.0, 1.5, 0.25]).values()))
    result = _export(tmp_path)
    assert [(s.status, s.pattern, s.weighted) for s in result.sites] == [("fused", "sparse_dense_matmul", True)]
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    indices, values = inputs[names[0]], inputs[names[1]]
    reference = np.zeros((5, D))
    for (row, column), value in zip(indices, values):
        reference[row] += value * TABLE[column].astype(np.float64)
    for got in _outputs(tmp_path, result, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    # Rows out of order are served as the composite serves them (test_export_bag_forms_round32.py).
    with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
        fused(**dict(zip(names, map(tf.constant, _sparse_inputs([[0, -1]], [1.0]).values()))))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrt_n"])
def test_a_sparse_segment_reduction_with_num_segments_is_fused(tmp_path, combiner):
    """tf.sparse.segment_*(table, ids, segments, num_segments=6) was neither fused
    nor reported. Bags 1, 3, 4 and 5 are empty (the last three past the last
    segment id: num_segments, not the last id + 1, sets the bag count)."""
    reduce = getattr(tf.sparse, "segment_" + combiner)
    specs = [tf.TensorSpec([None], tf.int64, "ids"), tf.TensorSpec([None], tf.int32, "segments")]
    _save(tmp_path / "m", specs, lambda t, ids, segments: reduce(t, ids, segments, num_segments=6))
    inputs = {"ids": np.array([5, 5, 17, 0], np.int64), "segments": np.array([0, 0, 0, 2], np.int32)}
    result = _export(tmp_path, samples=inputs)
    assert [(s.status, s.combiner) for s in result.sites] == [("fused", combiner.replace("_", ""))]
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    reference = np.zeros((6, D))
    for bag in (0, 2):
        rows = TABLE.astype(np.float64)[inputs["ids"][inputs["segments"] == bag]]
        reference[bag] = rows.sum(0) / {"sum": 1, "mean": len(rows), "sqrt_n": np.sqrt(len(rows))}[combiner]
    for got in _outputs(tmp_path, result, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


def test_a_weighted_ragged_mean_is_labelled_a_mean(tmp_path):
    """reduce_mean(ragged rows * ragged w, axis=1) divides the weighted bag by the
    row's length: the report said "sum". Row 1 is empty (0 / 0: NaN, as the original)."""
    ragged = tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)
    weights = tf.RaggedTensorSpec([None, None], tf.float32, row_splits_dtype=tf.int64)
    _save(tmp_path / "m", [ragged, weights],
          lambda t, rt, w: tf.reduce_mean(tf.nn.embedding_lookup(t, rt) * tf.expand_dims(w, -1), axis=1))
    splits = np.array([0, 3, 3, 5], np.int64)
    values, w = np.array([3, 3, 29, 0, 11], np.int64), np.array([1.0, -0.5, 2.0, 0.25, 1.5], np.float32)
    inputs = {"rt": values, "rt_1": splits, "w": w, "w_1": splits}
    names = sorted(tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"].structured_input_signature[1])
    inputs = dict(zip(names, inputs.values()))
    result = _export(tmp_path, samples=inputs)
    assert [(s.status, s.computes) for s in result.sites] == [("fused", "mean")]
    table = TABLE.astype(np.float64)
    with np.errstate(invalid="ignore"):
        reference = np.stack([(w[a:b, None] * table[values[a:b]]).sum(0) / (b - a)
                              for a, b in zip(splits[:-1], splits[1:])])
    for got in _outputs(tmp_path, result, inputs)[:2]:
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


SEGMENT_REDUCTIONS = {"sum": tf.math.segment_sum, "mean": tf.math.segment_mean, "max": tf.math.segment_max}
SEGMENT_INPUTS = {"values": np.array([3, 3, 7, 0, 29, 11], np.int64), "segments": np.array([1, 1, 1, 3, 3, 4], np.int64),
                  "w": np.array([1.0, 0.5, -2.0, 3.0, 1.5, 0.25], np.float32)}
SEGMENT_SPECS = [tf.TensorSpec([None], tf.int64, "values"), tf.TensorSpec([None], tf.int64, "segments"),
                 tf.TensorSpec([None], tf.float32, "w")]


def _segment_site_and_outputs(tmp_path, body):
    _save(tmp_path / "m", SEGMENT_SPECS, body)
    np.savez(tmp_path / "samples.npz", **SEGMENT_INPUTS)
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                sample_inputs=str(tmp_path / "samples.npz"))
    def serve(path):
        signature = tf.saved_model.load(str(path)).signatures["serving_default"]
        return signature(**{k: tf.constant(v) for k, v in SEGMENT_INPUTS.items()})["out"].numpy()
    return result.sites, serve(tmp_path / "m"), serve(result.dst)


@pytest.mark.parametrize("reduction", ["mean", "max"])
def test_a_segment_reduction_of_masked_rows_is_reported(tmp_path, reduction):
    """segment_<reduction>(tf.where(mask, gather(t, values), 0), segments) was neither
    fused nor reported. The masked rows are not padding for mean and max (they count,
    as zeros), so the site is reported and left as written (same outputs)."""
    reduce = SEGMENT_REDUCTIONS[reduction]
    sites, original, exported = _segment_site_and_outputs(tmp_path, lambda t, values, segments, w: reduce(
        tf.where((values != 3)[:, None], tf.gather(t, values), 0.0), segments))
    assert [(s.status, s.pattern, s.combiner) for s in sites] == [("skipped", "segment-reduce", reduction)]
    assert f"masked (tf.where) before the segment_{reduction}" in sites[0].reason
    np.testing.assert_array_equal(exported, original)


def test_a_weighted_segment_mean_is_reported_with_its_true_reason(tmp_path):
    """segment_mean(rows * w[:, None]) divides by the bag's id count, not by the
    weights' sum: it was skipped as if only an unfused step were in the way
    ("only the ids' unique-inverse and per-id weights are fused")."""
    sites, original, exported = _segment_site_and_outputs(
        tmp_path, lambda t, values, segments, w: tf.math.segment_mean(tf.gather(t, values) * w[:, None], segments))
    assert [(s.status, s.pattern) for s in sites] == [("skipped", "segment-reduce")]
    assert "per-id weights" in sites[0].reason and "not a segment_mean of weighted rows" in sites[0].reason
    assert "are fused" not in sites[0].reason
    np.testing.assert_array_equal(exported, original)


@pytest.mark.parametrize("reduction", list(SEGMENT_REDUCTIONS))
def test_segment_reductions_of_gathered_rows_share_one_label(tmp_path, reduction):
    """tf.math.segment_sum/mean were labelled embedding_lookup_sparse (which writes
    neither) and segment_max sparse-segment-max: all three are segment-reduce."""
    reduce = SEGMENT_REDUCTIONS[reduction]
    sites, original, exported = _segment_site_and_outputs(
        tmp_path, lambda t, values, segments, w: reduce(tf.gather(t, values), segments))
    assert [(s.status, s.pattern, s.combiner, s.computes) for s in sites] == [
        ("fused", "segment-reduce", reduction, reduction)]
    assert sites[0].saved_bytes_at_batch is None  # ids per batch depend on the input
    np.testing.assert_allclose(exported, original, rtol=1e-6, atol=1e-6)


def test_a_segment_sum_of_masked_rows_is_fused(tmp_path):
    """segment_sum(tf.where(mask, gather(t, values), 0), segments) was neither fused
    nor reported: a masked row adds 0, the bag of the unmasked ids. Bags 0 and 2
    are empty, bag 4 all masked (0); a masked id >= N or < 0 is refused, as the
    original's gather refuses it."""
    _save(tmp_path / "m", SEGMENT_SPECS, lambda t, values, segments, w: tf.math.segment_sum(
        tf.where((w > 0)[:, None], tf.gather(t, values), 0.0), segments))
    result = _export(tmp_path, samples=SEGMENT_INPUTS)
    assert [(s.status, s.pattern, s.combiner, s.computes, s.masked) for s in result.sites] == [
        ("fused", "segment-reduce", "sum", "sum", True)], [s.reason for s in result.sites]
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    inputs = dict(SEGMENT_INPUTS, w=np.array([1.0, -0.5, 2.0, 3.0, 1.5, -0.25], np.float32))
    reference = np.zeros((5, D))
    for value, bag, weight in zip(inputs["values"], inputs["segments"], inputs["w"]):
        reference[bag] += TABLE[value].astype(np.float64) if weight > 0 else 0.0
    outputs = _outputs(tmp_path, result, inputs)
    for got in outputs:
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    for bad in (N, -1):
        values = inputs["values"].copy()
        values[1] = bad  # a masked position (w < 0)
        feed = {k: tf.constant(v) for k, v in dict(inputs, values=values).items()}
        for model in (original, fused):
            with pytest.raises(tf.errors.InvalidArgumentError):
                model(**feed)
