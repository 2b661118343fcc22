"""quantized.embedding_bag in a tf.function: AutoGraph converted it and every pkm_serve function it
calls (the library loader, the argument checks), 16 s of tracing for one ragged lookup on the 2-core
box, against about 1 s for the float op, which AutoGraph leaves alone (do_not_convert)."""

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api

from pkm_serve import quantized
from tests.reference import bag_list

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0


def test_int8_lookup_in_a_tf_function_is_not_converted_by_autograph(monkeypatch):
    converted = []
    convert = autograph_api._convert_actual  # pylint: disable=protected-access

    def recording_convert(entity, program_ctx):
        converted.append(getattr(entity, "__module__", "") or "")
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", recording_convert)
    table = quantized.quantize_table(TABLE)

    @tf.function
    def lookup(values, splits, weights):
        ids = tf.RaggedTensor.from_row_splits(values, splits)
        return quantized.embedding_bag(table, ids, ids.with_flat_values(weights))

    got = lookup(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1, 3], tf.int64), tf.constant([1.0, 2.0, 3.0]))
    assert [m for m in converted if m.startswith("pkm_serve")] == []
    np.testing.assert_allclose(got.numpy(), bag_list(quantized.dequantize(table).numpy(), [[1], [2, 3]],
                                                     [[1.0], [2.0, 3.0]]), rtol=1e-5)
