"""Bag reductions written with keepdims=True ([..., 1, D], round 31): fused as
the bag with its unit axis put back, equal to numpy in the SavedModel and the
.tflite (they were reported as "reduction keeps dims" and left composite)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 30, 4, 5
RNG = np.random.default_rng(231)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)

def _masked_mean(rows, mask):
    return tf.reduce_sum(tf.where(mask[..., None], rows, 0.0), 1, keepdims=True) / \
        tf.expand_dims(tf.maximum(tf.reduce_sum(tf.cast(mask, tf.float32), 1, keepdims=True), 1.0), -1)


FORMS = {
    "sum": (lambda rows, ids, w: tf.reduce_sum(rows, axis=1, keepdims=True), "sum"),
    "mean_axis_minus_two": (lambda rows, ids, w: tf.reduce_mean(rows, axis=-2, keepdims=True), "mean"),
    "weighted_mean": (lambda rows, ids, w: tf.reduce_mean(rows * w[..., None], axis=1, keepdims=True), "mean"),
    "max": (lambda rows, ids, w: tf.reduce_max(rows, axis=1, keepdims=True), "max"),
    "masked_mean": (lambda rows, ids, w: _masked_mean(rows, ids > 0), "masked mean"),
    "keras_ops_sum": (lambda rows, ids, w: keras.ops.sum(rows * w[..., None], axis=1, keepdims=True), "sum"),
}


def _numpy(form, ids, w):
    rows = TABLE.astype(np.float64)[ids]
    if form == "max":
        return rows.max(1, keepdims=True)
    if form == "masked_mean":
        keep = (ids > 0)[..., None]
        return (rows * keep).sum(1, keepdims=True) / np.maximum(keep.sum(1, keepdims=True), 1)
    weighted = rows * (w.astype(np.float64)[..., None] if form in ("weighted_mean", "keras_ops_sum") else 1.0)
    return weighted.mean(1, keepdims=True) if "mean" in form else weighted.sum(1, keepdims=True)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_bag_kept_as_one_row_is_fused(tmp_path, form):
    reduce, computes = FORMS[form]
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(lambda ids, w: {"out": reduce(tf.gather(module.t, ids), ids, w)},
                           input_signature=[tf.TensorSpec([None, K], tf.int64, "ids"),
                                            tf.TensorSpec([None, K], tf.float32, "w")])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), tflite=str(tmp_path / "m.tflite"),
                                quiet=True)
    assert [(s.status, s.computes) for s in result.sites] == [("fused", computes)], [s.reason for s in result.sites]
    ids = RNG.integers(0, N, (6, K))
    ids[0], ids[1, :3], ids[2] = 9, 0, 0  # one id five times; a partly and a wholly masked bag
    inputs = {"ids": ids.astype(np.int64), "w": RNG.uniform(-1.0, 2.0, (6, K)).astype(np.float32)}
    reference = _numpy(form, ids, inputs["w"])
    runner = tflite.make_interpreter(str(tmp_path / "m.tflite")).get_signature_runner("serving_default")
    for path in (tmp_path / "m", result.dst):
        got = tf.saved_model.load(str(path)).signatures["serving_default"](
            **{k: tf.constant(v) for k, v in inputs.items()})["out"].numpy()
        assert got.shape == (6, 1, D)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runner(**inputs)["out"], reference, rtol=1e-5, atol=1e-6)
