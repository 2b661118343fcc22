"""Bags users write with segment ops and matrix-vector products (round 31):
each is fused and equal to numpy in the SavedModel and the .tflite, or
reported and left as written. Each case is a signature of one SavedModel,
exported once for the module (case_signatures.py)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from case_signatures import Cases, export_cases, signature

ops.load_library()

N, D = 30, 4
RNG = np.random.default_rng(131)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)

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
SEGMENT_REDUCTIONS = {"sum": tf.math.segment_sum, "mean": tf.math.segment_mean, "max": tf.math.segment_max}
SEGMENT_INPUTS = {"values": np.array([3, 3, 7, 0, 29, 11], np.int64), "segments": np.array([1, 1, 1, 3, 3, 4], np.int64),
                  "w": np.array([1.0, 0.5, -2.0, 3.0, 1.5, 0.25], np.float32)}
SEGMENT_SPECS = [tf.TensorSpec([None], tf.int64, "values"), tf.TensorSpec([None], tf.int64, "segments"),
                 tf.TensorSpec([None], tf.float32, "w")]
IDS_W_SPECS = [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, 5], tf.float32, "w")]
SPARSE_SPEC = tf.SparseTensorSpec([None, N], tf.float32)
RAGGED_SPECS = [tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64),
                tf.RaggedTensorSpec([None, None], tf.float32, row_splits_dtype=tf.int64)]
SEGMENT_MEAN_INPUTS = {"values": np.array([3, 3, 7, 0, 29, 11], np.int64),
                       "segments": np.array([1, 1, 1, 3, 3, 4], np.int64)}
SPARSE_SEGMENT_INPUTS = {"ids": np.array([5, 5, 17, 0], np.int64), "segments": np.array([0, 0, 0, 2], np.int32)}
RAGGED_SPLITS = np.array([0, 3, 3, 5], np.int64)
RAGGED_VALUES = np.array([3, 3, 29, 0, 11], np.int64)
RAGGED_W = np.array([1.0, -0.5, 2.0, 0.25, 1.5], np.float32)


def _masked_segment(reduce):
    return lambda t, values, segments, w: reduce(tf.where((values != 3)[:, None], tf.gather(t, values), 0.0), segments)


# name: (specs, body(table, *inputs), sample inputs or None); exported with a .tflite
TFLITE_CASES = {
    "segment_mean": ([tf.TensorSpec([None], tf.int64, "values"), tf.TensorSpec([None], tf.int64, "segments")],
                     lambda t, values, segments: tf.math.segment_mean(tf.gather(t, values), segments),
                     SEGMENT_MEAN_INPUTS),
    **{f"matvec_{form}": (IDS_W_SPECS, lambda t, ids, w, form=form: MATVEC_FORMS[form](tf.gather(t, ids), w), None)
       for form in MATVEC_FORMS},
    "sparse_dense_matmul": ([SPARSE_SPEC], lambda t, sp: tf.sparse.sparse_dense_matmul(sp, t), None),
    **{f"sparse_segment_{c}": ([tf.TensorSpec([None], tf.int64, "ids"), tf.TensorSpec([None], tf.int32, "segments")],
                               lambda t, ids, segments, c=c: getattr(tf.sparse, "segment_" + c)(
                                   t, ids, segments, num_segments=6), SPARSE_SEGMENT_INPUTS)
       for c in ("sum", "mean", "sqrt_n")},
    "weighted_ragged_mean": (RAGGED_SPECS, lambda t, rt, w: tf.reduce_mean(
        tf.nn.embedding_lookup(t, rt) * tf.expand_dims(w, -1), axis=1),
        [RAGGED_VALUES, RAGGED_SPLITS, RAGGED_W, RAGGED_SPLITS]),  # in the order of the sorted input names
    "segment_sum_of_masked_rows": (SEGMENT_SPECS, lambda t, values, segments, w: tf.math.segment_sum(
        tf.where((w > 0)[:, None], tf.gather(t, values), 0.0), segments), SEGMENT_INPUTS),
}
# Exported without a .tflite.
SAVED_MODEL_CASES = {
    "rows_scored_by_a_vector": ([tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, D], tf.float32, "v")],
                                lambda t, ids, v: tf.matmul(tf.gather(t, ids), v[:, :, None]), None),
    "rows_pooled_into_three_columns": (
        [tf.TensorSpec([None, 5], tf.int64, "ids"), tf.TensorSpec([None, 5, 3], tf.float32, "w")],
        lambda t, ids, w: tf.matmul(tf.gather(t, ids), w, transpose_a=True), None),
    "adjoint_column": (IDS_W_SPECS, lambda t, ids, w: tf.matmul(tf.gather(t, ids), w[:, None, :], transpose_a=True,
                                                                transpose_b=True), None),
    **{f"masked_segment_{r}": (SEGMENT_SPECS, _masked_segment(SEGMENT_REDUCTIONS[r]), SEGMENT_INPUTS)
       for r in ("mean", "max")},
    "weighted_segment_mean": (SEGMENT_SPECS, lambda t, values, segments, w: tf.math.segment_mean(
        tf.gather(t, values) * w[:, None], segments), SEGMENT_INPUTS),
    **{f"segment_{r}_of_rows": (SEGMENT_SPECS, lambda t, values, segments, w, r=r: SEGMENT_REDUCTIONS[r](
        tf.gather(t, values), segments), SEGMENT_INPUTS) for r in SEGMENT_REDUCTIONS},
}
CASES = {**TFLITE_CASES, **SAVED_MODEL_CASES}


def _input_names(original, name):
    return sorted(original.signatures[name].structured_input_signature[1])


def _samples(original, cases):
    samples = {}
    for name, (_, _, inputs) in cases.items():
        if isinstance(inputs, list):
            inputs = dict(zip(_input_names(original, name), inputs))
        samples.update({f"{name}/{key}": value for key, value in (inputs or {}).items()})
    return samples


def _call(module, body):
    return lambda *args: {"out": body(module.t, *args)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    path = tmp_path_factory.mktemp("segment_and_matvec")
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    cases = Cases()
    # Sample inputs, once given, must feed every signature exported: cases with and without go apart.
    for with_tflite, group in ((True, TFLITE_CASES), (False, SAVED_MODEL_CASES)):
        for sampled in (True, False):
            part = {name: case for name, case in group.items() if (case[2] is not None) == sampled}
            signatures = {name: signature(name, specs, _call(module, body)) for name, (specs, body, _) in part.items()}
            cases.add(path / f"{'lite' if with_tflite else 'saved_model'}_{'sampled' if sampled else 'generated'}",
                      module, signatures, with_tflite, (lambda original, part=part: _samples(original, part)))
    return cases


def _outputs(cases, name, inputs):
    """(original, fused SavedModel, .tflite) outputs on `inputs`."""
    export = cases.get(name)
    feed = {k: tf.constant(v) for k, v in inputs.items()}
    return (cases.original(name)(**feed)["out"].numpy(), export.fused(name)(**feed)["out"].numpy(),
            export.runner(name)(**inputs)["out"])


def _sites(cases, name):
    return cases.get(name).sites.get(name, [])


def test_a_segment_mean_of_gathered_rows_is_fused(cases):
    """tf.math.segment_mean was neither fused nor reported (segment_sum and
    segment_max were). Bag 0 and bag 2 are empty (0), bag 1 holds a duplicate."""
    inputs = SEGMENT_MEAN_INPUTS
    assert [(s.status, s.pattern, s.combiner, s.computes) for s in _sites(cases, "segment_mean")] == [
        ("fused", "segment-reduce", "mean", "mean")]
    assert cases.get("segment_mean").custom_ops("segment_mean") == ["PkmRaggedEmbeddingBag"]
    table = TABLE.astype(np.float64)
    reference = np.zeros((5, D))
    for bag in range(5):
        rows = table[inputs["values"][inputs["segments"] == bag]]
        if len(rows):
            reference[bag] = rows.mean(0)
    for got in _outputs(cases, "segment_mean", inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", list(MATVEC_FORMS))
def test_a_weighted_bag_as_a_matrix_vector_product_is_fused(cases, form):
    """Before, the rows-first spellings were not even reported."""
    name = f"matvec_{form}"
    sites = _sites(cases, name)
    assert [(s.status, s.pattern, s.weighted) for s in sites] == [("fused", "matmul", True)], [s.reason for s in sites]
    assert cases.get(name).custom_ops(name) == ["PkmEmbeddingBag"]
    ids = RNG.integers(0, N, (6, 5)).astype(np.int64)
    ids[0] = 4  # one id five times
    inputs = {"ids": ids, "w": RNG.uniform(-1.0, 2.0, (6, 5)).astype(np.float32)}
    bag = np.einsum("bk,bkd->bd", inputs["w"].astype(np.float64), TABLE.astype(np.float64)[ids])
    reference = {"matvec": bag, "adjoint_weights": bag[:, None, :]}.get(form, bag[:, :, None])
    for got in _outputs(cases, name, inputs):
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_rows_scored_by_a_vector_are_no_bag(cases):
    """rows @ v ([B, K, D] @ [D, 1]: a score per row, attention's first step)
    pools nothing: neither fused nor reported."""
    assert _sites(cases, "rows_scored_by_a_vector") == []


def test_rows_pooled_into_several_columns_are_no_bag_and_an_adjoint_column_is_reported(cases):
    """As docs/export.md says: rows^T @ W [B, K, 3] pools the rows into three columns (no bag:
    neither fused nor reported); rows^T @ adjoint(w[:, None, :]) is one column, reported."""
    assert _sites(cases, "rows_pooled_into_three_columns") == []
    assert [(s.status, s.pattern) for s in _sites(cases, "adjoint_column")] == [("skipped", "matmul")]


def _sparse_inputs(indices, values, rows=5):
    return {"sp": np.array(indices, np.int64), "sp_1": np.array(values, np.float32), "sp_2": np.array([rows, N], np.int64)}


def test_sparse_dense_matmul_by_the_table_is_a_weighted_bag(cases):
    """tf.sparse.sparse_dense_matmul(sp [B, N], table) was neither fused nor reported
    (and its op has no TFLite builtin). Row 1 and the last row are empty, (0, 7)
    is given twice (summed, as the composite does)."""
    name = "sparse_dense_matmul"
    names = _input_names(cases.originals[name], name)
    inputs = dict(zip(names, _sparse_inputs([[0, 7], [0, 7], [0, 29], [2, 0], [3, 11], [3, 4]],
                                            [1.0, 0.5, -2.0, 3.0, 1.5, 0.25]).values()))
    assert [(s.status, s.pattern, s.weighted) for s in _sites(cases, name)] == [
        ("fused", "sparse_dense_matmul", True)]
    assert cases.get(name).custom_ops(name) == ["PkmRaggedEmbeddingBag"]
    indices, values = inputs[names[0]], inputs[names[1]]
    reference = np.zeros((5, D))
    for (row, column), value in zip(indices, values):
        reference[row] += value * TABLE[column].astype(np.float64)
    for got in _outputs(cases, name, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    fused = cases.get(name).fused(name)
    # Rows out of order are served as the composite serves them (test_export_bag_forms_round32.py).
    with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
        fused(**dict(zip(names, map(tf.constant, _sparse_inputs([[0, -1]], [1.0]).values()))))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrt_n"])
def test_a_sparse_segment_reduction_with_num_segments_is_fused(cases, combiner):
    """tf.sparse.segment_*(table, ids, segments, num_segments=6) was neither fused
    nor reported. Bags 1, 3, 4 and 5 are empty (the last three past the last
    segment id: num_segments, not the last id + 1, sets the bag count)."""
    name, inputs = f"sparse_segment_{combiner}", SPARSE_SEGMENT_INPUTS
    assert [(s.status, s.combiner) for s in _sites(cases, name)] == [("fused", combiner.replace("_", ""))]
    assert cases.get(name).custom_ops(name) == ["PkmRaggedEmbeddingBag"]
    reference = np.zeros((6, D))
    for bag in (0, 2):
        rows = TABLE.astype(np.float64)[inputs["ids"][inputs["segments"] == bag]]
        reference[bag] = rows.sum(0) / {"sum": 1, "mean": len(rows), "sqrt_n": np.sqrt(len(rows))}[combiner]
    for got in _outputs(cases, name, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


def test_a_weighted_ragged_mean_is_labelled_a_mean(cases):
    """reduce_mean(ragged rows * ragged w, axis=1) divides the weighted bag by the
    row's length: the report said "sum". Row 1 is empty (0 / 0: NaN, as the original)."""
    name = "weighted_ragged_mean"
    splits, values, w = RAGGED_SPLITS, RAGGED_VALUES, RAGGED_W
    inputs = dict(zip(_input_names(cases.originals[name], name), TFLITE_CASES[name][2]))
    assert [(s.status, s.computes) for s in _sites(cases, name)] == [("fused", "mean")]
    table = TABLE.astype(np.float64)
    with np.errstate(invalid="ignore"):
        reference = np.stack([(w[a:b, None] * table[values[a:b]]).sum(0) / (b - a)
                              for a, b in zip(splits[:-1], splits[1:])])
    for got in _outputs(cases, name, inputs)[:2]:
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)


def _segment_site_and_outputs(cases, name):
    feed = {k: tf.constant(v) for k, v in SEGMENT_INPUTS.items()}
    return (_sites(cases, name), cases.original(name)(**feed)["out"].numpy(),
            cases.get(name).fused(name)(**feed)["out"].numpy())


@pytest.mark.parametrize("reduction", ["mean", "max"])
def test_a_segment_reduction_of_masked_rows_is_reported(cases, reduction):
    """segment_<reduction>(tf.where(mask, gather(t, values), 0), segments) was neither
    fused nor reported. The masked rows are not padding for mean and max (they count,
    as zeros), so the site is reported and left as written (same outputs)."""
    sites, original, exported = _segment_site_and_outputs(cases, f"masked_segment_{reduction}")
    assert [(s.status, s.pattern, s.combiner) for s in sites] == [("skipped", "segment-reduce", reduction)]
    assert f"masked (tf.where) before the segment_{reduction}" in sites[0].reason
    np.testing.assert_array_equal(exported, original)


def test_a_weighted_segment_mean_is_reported_with_its_true_reason(cases):
    """segment_mean(rows * w[:, None]) divides by the bag's id count, not by the
    weights' sum: it was skipped as if only an unfused step were in the way
    ("only the ids' unique-inverse and per-id weights are fused")."""
    sites, original, exported = _segment_site_and_outputs(cases, "weighted_segment_mean")
    assert [(s.status, s.pattern) for s in sites] == [("skipped", "segment-reduce")]
    assert "per-id weights" in sites[0].reason and "not a segment_mean of weighted rows" in sites[0].reason
    assert "are fused" not in sites[0].reason
    np.testing.assert_array_equal(exported, original)


@pytest.mark.parametrize("reduction", list(SEGMENT_REDUCTIONS))
def test_segment_reductions_of_gathered_rows_share_one_label(cases, reduction):
    """tf.math.segment_sum/mean were labelled embedding_lookup_sparse (which writes
    neither) and segment_max sparse-segment-max: all three are segment-reduce."""
    sites, original, exported = _segment_site_and_outputs(cases, f"segment_{reduction}_of_rows")
    assert [(s.status, s.pattern, s.combiner, s.computes) for s in sites] == [
        ("fused", "segment-reduce", reduction, reduction)]
    assert sites[0].saved_bytes_at_batch is None  # ids per batch depend on the input
    np.testing.assert_allclose(exported, original, rtol=1e-6, atol=1e-6)


def test_a_segment_sum_of_masked_rows_is_fused(cases):
    """segment_sum(tf.where(mask, gather(t, values), 0), segments) was neither fused
    nor reported: a masked row adds 0, the bag of the unmasked ids. Bags 0 and 2
    are empty, bag 4 all masked (0); a masked id >= N or < 0 is refused, as the
    original's gather refuses it."""
    name = "segment_sum_of_masked_rows"
    sites = _sites(cases, name)
    assert [(s.status, s.pattern, s.combiner, s.computes, s.masked) for s in sites] == [
        ("fused", "segment-reduce", "sum", "sum", True)], [s.reason for s in sites]
    assert cases.get(name).custom_ops(name) == ["PkmRaggedEmbeddingBag"]
    inputs = dict(SEGMENT_INPUTS, w=np.array([1.0, -0.5, 2.0, 3.0, 1.5, -0.25], np.float32))
    reference = np.zeros((5, D))
    for value, bag, weight in zip(inputs["values"], inputs["segments"], inputs["w"]):
        reference[bag] += TABLE[value].astype(np.float64) if weight > 0 else 0.0
    for got in _outputs(cases, name, inputs):
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    fused, original = cases.get(name).fused(name), cases.original(name)
    for bad in (N, -1):
        values = inputs["values"].copy()
        values[1] = bad  # a masked position (w < 0)
        feed = {k: tf.constant(v) for k, v in dict(inputs, values=values).items()}
        for model in (original, fused):
            with pytest.raises(tf.errors.InvalidArgumentError):
                model(**feed)
