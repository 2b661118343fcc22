"""What the fused model's checks say: they name the op the site was fused into
and the id the user sent (numbers checked against what the original refuses)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D = 30, 4
TABLE = np.random.default_rng(7).standard_normal((N, D)).astype(np.float32)


def test_a_masked_segment_sum_names_the_ragged_op_and_the_id(tmp_path):
    """tf.math.segment_sum(tf.where(mask[:, None], gather(t, values), 0), seg) is fused into
    PkmRaggedEmbeddingBag; its masked-id check said PkmEmbeddingBag."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    specs = [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.bool), tf.TensorSpec([None], tf.int64)]

    @tf.function(input_signature=specs)
    def f(values, mask, seg):
        return {"out": tf.math.segment_sum(tf.where(mask[:, None], tf.gather(module.t, values), 0), seg)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    np.savez(tmp_path / "s.npz", values=np.array([1, 2, 3]), mask=np.array([True, False, True]),
             seg=np.array([0, 0, 2]))
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                sample_inputs=str(tmp_path / "s.npz"))
    assert [(s.status, s.pattern, s.masked) for s in result.sites] == [("fused", "segment-reduce", True)]
    inputs = {"values": tf.constant([1, N + 10], tf.int64), "mask": tf.constant([True, False]),
              "seg": tf.constant([0, 0], tf.int64)}
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"indices.*{N + 10}.*not in"):
        tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**inputs)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        tf.saved_model.load(result.dst).signatures["serving_default"](**inputs)
    message = raised.value.message
    assert "PkmRaggedEmbeddingBag (fused masked gather" in message and "PkmEmbeddingBag" not in message
    assert f"[{N + 10}] [is not in [0, {N})" in message


def _sharded_tflite(tmp_path, ragged):
    from pkm_serve import tflite

    table = np.random.default_rng(8).standard_normal((1000, 2)).astype(np.float32)
    module = tf.Module()
    module.shards = [tf.Variable(table[:600]), tf.Variable(table[600:])]
    if ragged:
        specs = [tf.TensorSpec([None], tf.int64, "values"), tf.TensorSpec([None], tf.int64, "splits")]
        body = lambda v, s: ops.embedding_bag(module.shards, tf.RaggedTensor.from_row_splits(v, s))  # noqa: E731
    else:
        specs = [tf.TensorSpec([None, 2], tf.int64, "ids")]
        body = lambda ids: ops.embedding_bag(module.shards, ids, combiner="mean")  # noqa: E731
    module.f = tf.function(lambda *a: {"out": body(*a)}, input_signature=specs)
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    converter = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "m"))
    converter.allow_custom_ops = True
    path = tmp_path / "m.tflite"
    path.write_bytes(converter.convert())
    return table, lambda inputs: tflite.run_tflite(str(path), inputs, interpreter="litert")[0]


@pytest.mark.parametrize("ragged", [False, True])
def test_a_sharded_table_in_a_tflite_names_the_users_id_past_the_table(tmp_path, ragged):
    """ops.embedding_bag over [600, D] + [400, D] shards, converted to a .tflite: id 1234 was
    refused by the last shard's kernel as "indices[1] = 634 is out of range [0, 400)"."""
    table, run = _sharded_tflite(tmp_path, ragged)
    ids = np.array([[1, 1234]], np.int64)
    inputs = {"values": ids[0], "splits": np.array([0, 2], np.int64)} if ragged else {"ids": ids}
    with pytest.raises(RuntimeError, match=r"indices\[1\] = 1234 is out of range \[0, 1000\)"):
        run(inputs)
    ids = np.array([[1, 999], [600, -1]], np.int64)  # in range (and padding): served as before
    inputs = {"values": ids.reshape(-1), "splits": np.array([0, 2, 4], np.int64)} if ragged else {"ids": ids}
    got = run(inputs)
    rows = table.astype(np.float64)
    reference = np.stack([rows[[1, 999]].sum(0), rows[600]]) if ragged else \
        np.stack([rows[[1, 999]].mean(0), rows[600]])
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
