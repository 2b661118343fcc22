"""A float16 table's rows transposed to [B, D, K] and weighted per position after it, reduce_sum(tf.transpose(
rows, [0, 2, 1]) * w[:, None, :], -1), exported with --tflite: the fused op read the weights as w[:, None, :]
reshaped back to [B, K], so the float16 StridedSlice stayed in the graph, which is no TFLite builtin ("the
.tflite would need custom ops ['StridedSlice']"), where rows * w[..., None] of the same table converts. The op
now reads w itself; the .tflite matches numpy float64 at float16's tolerance."""
import numpy as np
import tensorflow as tf

from pkm_serve import tflite
from round34_forms import K, N, RNG, TABLE, save_and_export

HALF = TABLE.astype(np.float16)
HALF_TOLERANCE = 2e-3


def test_float16_rows_weighted_after_the_transpose_convert_to_tflite(tmp_path):
    feed = {"args_0": RNG.integers(0, N, (3, K)), "args_1": RNG.uniform(-2, 2, (3, K)).astype(np.float16)}
    np.savez(str(tmp_path / "sample.npz"), **feed)
    lite = str(tmp_path / "m.tflite")
    result = save_and_export(tmp_path, [tf.TensorSpec([None, K], tf.int64), tf.TensorSpec([None, K], tf.float16)],
                             lambda m, ids, w: tf.reduce_sum(
                                 tf.transpose(tf.gather(m.t, ids), [0, 2, 1]) * w[:, None, :], -1),
                             table=HALF, tflite=lite, sample_inputs=str(tmp_path / "sample.npz"))
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    got = tflite.make_interpreter(lite).get_signature_runner("serving_default")(**feed)["out"]
    expected = np.einsum("bk,bkd->bd", feed["args_1"].astype(np.float64), HALF.astype(np.float64)[feed["args_0"]])
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=HALF_TOLERANCE, atol=HALF_TOLERANCE)
