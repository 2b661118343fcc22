"""An input that is a segment op's num_segments was fed the rows of the smallest table (every segment id
was drawn from [0, rows)): with a 100k-row table each verification run and each warmup request written
into the export asked for 100k bags, so every server start ran [100k, D] sums per warmup request (a
10M-row table: gigabytes). Segment ids a segment op reads straight from an input are now drawn from the
batch, [0, batch), sorted where the op needs them so, and num_segments is the batch: the warmup request
is a batch of bags, valid for the original (numpy float64 agrees)."""
import numpy as np
import pytest
import tensorflow as tf

from export_models import warmup_request
from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()
ROWS, D, BATCH = 100_000, 2, 8
TABLE = np.random.default_rng(38).standard_normal((ROWS, D)).astype(np.float32)
FLAT, COUNT64 = tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.int64)
FORMS = {
    "unsorted_segment_sum": lambda m, ids, seg, n: tf.math.unsorted_segment_sum(tf.gather(m.t, ids), seg, n),
    "sparse_segment_sum": lambda m, ids, seg, n: tf.sparse.segment_sum(m.t, ids, seg, num_segments=n),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_warmup_request_asks_for_a_batch_of_bags_not_a_table_of_them(tmp_path, form):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(input_signature=[FLAT, FLAT, COUNT64])(
        lambda *args: {"out": FORMS[form](module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                verify_batch_size=BATCH, warmup_requests=1)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    request = {k: tf.make_ndarray(v) for k, v in warmup_request(tmp_path / "out").inputs.items()}
    ids, seg, n = request["args_0"], request["args_1"], int(request["args_2"])
    assert n <= BATCH and seg.max() < n, (n, seg)
    expected = np.zeros((n, D))
    np.add.at(expected, seg, TABLE.astype(np.float64)[ids])
    got = tf.saved_model.load(result.dst).signatures["serving_default"](**request)["out"].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


COUNT32 = tf.TensorSpec([], tf.int32)
K = 3
FED_FORMS = {
    # num_segments cast before the op: was not seen as num_segments, fed a random id in [0, rows)
    "cast_num_segments": ([FLAT, FLAT, COUNT32], lambda m, ids, seg, n: tf.math.unsorted_segment_sum(
        tf.gather(m.t, ids), seg, tf.cast(n, tf.int64))),
    # segment ids computed from the ids' shape, no segment-id input: num_segments was fed the table's rows
    "positions_num_segments": ([tf.TensorSpec([None, K], tf.int64), COUNT64], lambda m, ids, n:
                               tf.math.unsorted_segment_sum(tf.gather(m.t, tf.reshape(ids, [-1])),
                                                            tf.repeat(tf.range(tf.shape(ids)[0]), K), n)),
    # segment ids of a RaggedTensor's rows (value_rowids() of its row_splits): num_segments was the table's rows
    "ragged_rows_num_segments": ([tf.RaggedTensorSpec([None, None], tf.int64), COUNT64], lambda m, ids, n:
                                 tf.math.unsorted_segment_sum(tf.gather(m.t, ids.values), ids.value_rowids(), n)),
}


def _bags_by_segment(ids, seg, n):
    expected = np.zeros((n, D))
    np.add.at(expected, seg, TABLE.astype(np.float64)[ids])
    return expected


@pytest.mark.parametrize("form", sorted(FED_FORMS))
def test_num_segments_through_a_cast_or_of_computed_segment_ids_is_a_batch_of_bags(tmp_path, form):
    specs, body = FED_FORMS[form]
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(input_signature=specs)(lambda *args: {"out": body(module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                verify_batch_size=BATCH, warmup_requests=1)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    request = {k: tf.make_ndarray(v) for k, v in warmup_request(tmp_path / "out").inputs.items()}
    if form == "cast_num_segments":
        ids, seg, n = request["args_0"], request["args_1"], int(request["args_2"])
    elif form == "positions_num_segments":
        ids, n = request["args_0"].reshape(-1), int(request["args_1"])
        seg = np.repeat(np.arange(BATCH), K)
    else:
        ids, splits, n = request["args_0"], request["args_0_1"], int(request["args_1"])
        seg = np.repeat(np.arange(len(splits) - 1), np.diff(splits))
    assert seg.max() < n <= BATCH * K, (n, seg)
    got = tf.saved_model.load(result.dst).signatures["serving_default"](**request)["out"].numpy()
    np.testing.assert_allclose(got, _bags_by_segment(ids, seg, n), rtol=1e-5, atol=1e-6)
