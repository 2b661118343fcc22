"""`--quantize-table int8` of fused sites whose table is read through an Identity
(`tf.identity(table)`, `table.read_value()`), and whose read value's shape clips the ids
(`tf.shape(table.read_value())[0] - 1`): the float export fused them, but the int8 one refused
("its table is not read from a checkpointed variable", then "... also used by Shape, which
needs the float table"). Now the table is int8 (variables <= 0.35x) and the outputs, out-of-range
ids clipped included, are within the tolerance of the original model's."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import export_saved_model

N, D, K = 80, 16, 4


def _save(path, read):
    table = np.random.default_rng(5).normal(size=(N, D)).astype(np.float32)

    class Model(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            value = tf.identity(self.table) if read == "identity" else self.table.read_value()
            if read == "read_value_clipped_to_its_shape":
                ids = tf.clip_by_value(ids, 0, tf.shape(value)[0] - 1)
            return {"out": tf.reduce_sum(tf.gather(value, ids), axis=1)}

    model = Model()
    tf.saved_model.save(model, path, signatures={"serving_default": model.serve})


@pytest.mark.parametrize("read", ["identity", "read_value", "read_value_clipped_to_its_shape"])
def test_a_table_read_through_identity_is_quantized(tmp_path, read):
    src = str(tmp_path / "src")
    _save(src, read)
    result = export_saved_model(src, str(tmp_path / "dst"), quantize_table="int8", quiet=True)
    q = result.quantization
    assert q["variables_bytes_after"] <= 0.35 * q["variables_bytes_before"]
    high = N + 5 if read == "read_value_clipped_to_its_shape" else N
    ids = tf.constant(np.random.default_rng(0).integers(0, high, size=(24, K)).astype(np.int32))
    want = tf.saved_model.load(src).signatures["serving_default"](ids=ids)["out"].numpy()
    got = tf.saved_model.load(result.dst).signatures["serving_default"](ids=ids)["out"].numpy()
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()
