"""A SavedModel traced from a jit_compile function with ragged weights carries the op library's
PkmCheckThen (a run-time check XLA keeps). `--tflite` failed on it ("the .tflite would need custom
ops ['PkmCheckThen']"); now the .tflite is converted from a copy with each written as Assert +
Identity, and the SavedModel written keeps the check."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

TABLE = np.random.default_rng(5).standard_normal((10, 3)).astype(np.float32)
SPECS = [tf.TensorSpec([None], tf.int64, name="v"), tf.TensorSpec([None], tf.int64, name="s"),
         tf.TensorSpec([None], tf.float32, name="wv"), tf.TensorSpec([None], tf.int64, name="ws")]
FEED = dict(v=np.array([1, 2, 3]), s=np.array([0, 1, 3]), wv=np.array([1., 2., 3.], np.float32),
            ws=np.array([0, 1, 3]))


def _ops_in(saved_model_dir):
    proto = saved_model_pb2.SavedModel()
    with open(f"{saved_model_dir}/saved_model.pb", "rb") as f:
        proto.ParseFromString(f.read())
    return {n.op for f in proto.meta_graphs[0].graph_def.library.function for n in f.node_def}


def _save(tmp_path):
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=SPECS, jit_compile=True)
    def serve(v, s, wv, ws):
        return {"out": ops.embedding_bag(module.t, tf.RaggedTensor.from_row_splits(v, s),
                                         tf.RaggedTensor.from_row_splits(wv, ws))}
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": serve})
    return tmp_path / "m"


def test_ragged_weights_checked_under_xla_convert_to_tflite(tmp_path):
    src = _save(tmp_path)
    if "PkmCheckThen" not in _ops_in(src):
        pytest.skip("this op library keeps no PkmCheckThen under XLA")
    np.savez(tmp_path / "s.npz", **FEED)
    result = export_saved_model(str(src), str(tmp_path / "out"), quiet=True, sample_inputs=str(tmp_path / "s.npz"),
                                tflite=str(tmp_path / "m.tflite"))
    assert "PkmCheckThen" not in result.tflite["custom_ops"], result.tflite
    from pkm_serve.tflite import run_tflite
    [got] = run_tflite(str(tmp_path / "m.tflite"), FEED)
    expected = np.stack([TABLE[1] * 1.0, TABLE[2] * 2.0 + TABLE[3] * 3.0])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # The SavedModel served keeps the check (an Assert would be dropped under XLA).
    assert "PkmCheckThen" in _ops_in(result.dst)
    bad = dict(FEED, ws=np.array([0, 2, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="row partition"):
        tf.saved_model.load(result.dst).signatures["serving_default"](**{k: tf.constant(v) for k, v in bad.items()})
