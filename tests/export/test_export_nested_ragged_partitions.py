"""Verification feeds of RaggedTensors deeper than ragged_rank 1, whose row partitions must agree with the
saved spec and with each other: a dimension of fixed length (RaggedTensorSpec([None, 3, None]),
`from_uniform_row_length`) got rows of 1-4 values, and session weights [users, (sessions)] got a user
partition of their own beside ids [users, (sessions), (items)], so the original model refused the generated
inputs ("Input to reshape is a tensor with 88 values", "Incompatible shapes: [22,4] vs. [15,1]") and the
export failed. Now a fixed dimension gets rows of its length and a shallower RaggedTensor shares the outer
partitions of a deeper one; the fused model's bags are numpy float64's."""
import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()
N, D, SESSIONS = 30, 4, 3
TABLE = np.random.default_rng(37).standard_normal((N, D)).astype(np.float32)
USERS, ITEMS = np.array([0, 3, 6]), np.array([0, 2, 2, 3, 4, 4, 5])  # 2 users of 3 sessions
IDS = np.array([1, 7, 29, 0, 11])


def _export(tmp_path, specs, body):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(input_signature=specs)(lambda *args: {"out": body(module, *args)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    return tf.saved_model.load(result.dst).signatures["serving_default"]


def _session_bags(module, ids):
    rows = tf.gather(module.t, ids.flat_values)
    return tf.reduce_sum(tf.RaggedTensor.from_row_splits(rows, ids.values.row_splits), axis=1)


def _np_session_bags():
    rows = TABLE.astype(np.float64)[IDS]
    return np.stack([rows[ITEMS[s]:ITEMS[s + 1]].sum(0) for s in range(len(ITEMS) - 1)])


def test_a_dimension_of_fixed_length_gets_rows_of_that_length(tmp_path):
    spec = tf.RaggedTensorSpec([None, SESSIONS, None], tf.int64, ragged_rank=2)
    fused = _export(tmp_path, [spec], lambda m, ids: tf.reduce_sum(
        tf.reshape(_session_bags(m, ids), [-1, SESSIONS, D]), axis=1))
    got = fused(args_0=IDS, args_0_1=USERS, args_0_2=ITEMS)["out"].numpy()
    np.testing.assert_allclose(got, _np_session_bags().reshape(-1, SESSIONS, D).sum(1), rtol=1e-5, atol=1e-6)


def test_session_weights_share_the_user_partition_of_the_ids(tmp_path):
    specs = [tf.RaggedTensorSpec([None, None, None], tf.int64, ragged_rank=2),
             tf.RaggedTensorSpec([None, None], tf.float32, ragged_rank=1)]

    def weighted_users(m, ids, session_weights):
        sessions = _session_bags(m, ids) * session_weights.values[:, None]
        return tf.reduce_sum(tf.RaggedTensor.from_row_splits(sessions, ids.row_splits), axis=1)
    fused = _export(tmp_path, specs, weighted_users)
    weights = np.array([0.5, 2.0, 1.0, 3.0, 1.5, 0.25], np.float32)
    got = fused(args_0=IDS, args_0_1=USERS, args_0_2=ITEMS, args_1=weights, args_1_1=USERS)["out"].numpy()
    sessions = _np_session_bags() * weights[:, None]
    expected = np.stack([sessions[USERS[u]:USERS[u + 1]].sum(0) for u in range(len(USERS) - 1)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
