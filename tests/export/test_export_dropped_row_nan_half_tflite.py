"""The dropped-row NaN term (dropped_nan.py) of a masked bag whose weights are float16 (Keras mixed precision:
tf.where(mask, cast(rows, float16), 0) * w16) or whose table is float16 was made of float16 Mul / SelectV2 /
Sum / AddV2, which are no TFLite builtins: `--tflite` failed ("the .tflite would need custom ops ['Mul']")
where it converted before round 39. The term is made in float32; the .tflite, like the SavedModel, is NaN
exactly where the original is (an inf or NaN weight on a dropped row) and equal to it elsewhere."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import tflite
from round34_forms import IDS, K, TABLE, save_and_export

W16 = tf.TensorSpec([None, K], tf.float16)
IDS_FED = np.array([[1, 0, 3, 4, 5], [0, 0, 0, 0, 0], [2, 0, 2, 0, 1], [3, 3, 0, 3, 3]], np.int64)
WEIGHTS_FED = np.array([[1, np.inf, 0.5, 1, 1], [0, 0, np.nan, 0, 0], [1, 0, 2, -np.inf, 1], [np.inf, 1, 1, 1, 1]],
                       np.float16)
FORMS = {  # name: (table, body)
    "float32_table_float16_weights": (TABLE, lambda m, i, w: tf.reduce_sum(
        tf.where((i > 0)[..., None], tf.cast(tf.gather(m.t, i), tf.float16), 0.0) * w[..., None], 1)),
    "float16_table_float16_weights": (TABLE.astype(np.float16), lambda m, i, w: tf.reduce_sum(
        tf.where((i > 0)[..., None], tf.gather(m.t, i), 0.0) * w[..., None], 1)),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_half_weighted_masked_bag_converts_and_is_nan_where_the_original_is(tmp_path, form):
    table, body = FORMS[form]
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=IDS_FED, args_1=np.ones(IDS_FED.shape, np.float16))
    lite = str(tmp_path / "m.tflite")
    result = save_and_export(tmp_path, [IDS, W16], body, table=table, tflite=lite, sample_inputs=sample)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    feed = {"args_0": IDS_FED, "args_1": WEIGHTS_FED}
    rows = np.where(IDS_FED[..., None] > 0, table.astype(np.float16).astype(np.float64)[IDS_FED], 0.0)
    with np.errstate(invalid="ignore"):
        want = (rows * WEIGHTS_FED.astype(np.float64)[..., None]).sum(1)
    assert np.isnan(want).any(1).tolist() == [True, True, True, False]
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](**feed)["out"].numpy()
    fused = tf.saved_model.load(result.dst).signatures["serving_default"](**feed)["out"].numpy()
    lite_out = tflite.make_interpreter(lite).get_signature_runner("serving_default")(**feed)["out"]
    for got in (original, fused, lite_out):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)
