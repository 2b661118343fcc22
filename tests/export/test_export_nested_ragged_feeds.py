"""A signature taking RaggedTensors of ragged_rank 2 ([users, sessions, (ids)] with their weights) is saved
as `ids, ids_1, ids_2` (flat values, then each dimension's row_splits). The verification grouped only
ragged_rank 1 parts, so ids_1 and ids_2 got random ids as row_splits and the export failed ("the original
model fails on the generated inputs"). Now each dimension gets a valid row partition, shared by the ids and
their weights, and the fused model's bags are numpy float64's."""
import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()
N, D = 30, 4
TABLE = np.random.default_rng(36).standard_normal((N, D)).astype(np.float32)
NESTED = [tf.RaggedTensorSpec([None, None, None], tf.int64, ragged_rank=2),
          tf.RaggedTensorSpec([None, None, None], tf.float32, ragged_rank=2)]


def _sessions_of_users(module, ids, w):
    rows = tf.gather(module.t, ids.flat_values) * w.flat_values[:, None]
    sessions = tf.reduce_sum(tf.RaggedTensor.from_row_splits(rows, ids.values.row_splits), axis=1)
    return tf.reduce_sum(tf.RaggedTensor.from_row_splits(sessions, ids.row_splits), axis=1)


def test_ragged_rank_2_inputs_get_a_row_partition_per_dimension(tmp_path):
    """The parts are read off the saved function's RaggedTensorSpecs (the function is tracked)."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(input_signature=NESTED)(lambda ids, w: {"out": _sessions_of_users(module, ids, w)})
    f = module.f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    outer, inner = np.array([0, 2, 2, 3]), np.array([0, 3, 3, 5])
    ids, w = np.array([1, 7, 7, 29, 0]), np.array([0.5, 2.0, 1.0, 3.0, 1.5], np.float32)
    rows = TABLE.astype(np.float64)[ids] * w[:, None]
    sessions = np.stack([rows[inner[i]:inner[i + 1]].sum(0) for i in range(3)])
    expected = np.stack([sessions[outer[u]:outer[u + 1]].sum(0) for u in range(3)])
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    got = fused(ids=ids, ids_1=outer, ids_2=inner, w=w, w_1=outer, w_2=inner)["out"].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_three_int_vectors_named_like_keras_inputs_stay_dense(tmp_path):
    """input_layer, input_layer_1, input_layer_2 (Keras 3's names for scalar features) are no RaggedTensor's
    parts: fed as ids, each [batch], the stacked bag verifies."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    names = ("input_layer", "input_layer_1", "input_layer_2")
    module.f = tf.function(input_signature=[tf.TensorSpec([None], tf.int64, name=n) for n in names])(
        lambda a, b, c: {"out": tf.reduce_sum(tf.gather(module.t, tf.stack([a, b, c], 1)), 1)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = np.array([[1, 2, 3], [4, 4, 29]])
    got = tf.saved_model.load(result.dst).signatures["serving_default"](
        **{n: ids[:, k] for k, n in enumerate(names)})["out"].numpy()
    np.testing.assert_allclose(got, TABLE.astype(np.float64)[ids].sum(1), rtol=1e-5, atol=1e-6)
