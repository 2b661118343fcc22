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
