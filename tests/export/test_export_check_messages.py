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
