"""reduce_max(tf.where(mask[..., None], rows, c), axis=1) of gathered rows with a constant fill c (-inf, the
dtype's lowest, 0, tf.fill(tf.shape(rows), c); the mask inverted too) was reported, not fused ("tf.where fills
masked rows with something other than a constant 0"; a 0 fill: "max of masked rows"). It is now the op's
max of the kept ids, then the fill where a bag has a masked entry: the original's outputs on edge feeds
(bags all masked, a NaN and a -inf row, a batch of 1 and of 0)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()
N, D, K = 12, 3, 4
TABLE = np.random.default_rng(7).standard_normal((N, D)).astype(np.float32)
TABLE[5] = np.nan
TABLE[6] = -np.inf
IDS = tf.TensorSpec([None, K], tf.int64)
FORMS = {
    "minus_inf": lambda rows, kept: tf.where(kept[..., None], rows, float("-inf")),
    "lowest": lambda rows, kept: tf.where(kept[..., None], rows, tf.float32.min),
    "zero_inverted": lambda rows, kept: tf.where(tf.logical_not(kept)[..., None], 0.0, rows),
    "filled_like_rows": lambda rows, kept: tf.where(kept[..., None], rows, tf.fill(tf.shape(rows), -2.0)),
}
FEEDS = {
    "mixed": np.array([[1, 2, 0, 0], [0, 0, 0, 0], [3, 3, 4, 7], [6, 0, 0, 0], [6, 6, 1, 0], [5, 1, 0, 0]]),
    "batch_of_one": np.array([[0, 8, 0, 9]]),
    "batch_of_zero": np.zeros((0, K), np.int64),
}


@pytest.fixture(scope="module", params=sorted(FORMS))
def exported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    masked = FORMS[request.param]
    module.f = tf.function(input_signature=[IDS])(
        lambda ids: {"out": tf.reduce_max(masked(tf.gather(module.t, ids), ids > 0), axis=1)})
    tf.saved_model.save(module, str(tmp / "m"), signatures={"serving_default": module.f})
    sample = str(tmp / "sample.npz")
    np.savez(sample, ids=FEEDS["mixed"])
    result = export_saved_model(str(tmp / "m"), str(tmp / "out"), quiet=True, sample_inputs=sample)
    original = tf.saved_model.load(str(tmp / "m")).signatures["serving_default"]
    return result, original, tf.saved_model.load(result.dst).signatures["serving_default"]


@pytest.mark.parametrize("feed", sorted(FEEDS))
def test_masked_max_with_a_constant_fill_is_fused_and_answers_as_the_original(exported, feed):
    result, original, fused = exported
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = FEEDS[feed].astype(np.int64)
    want, got = original(ids=ids)["out"].numpy(), fused(ids=ids)["out"].numpy()
    np.testing.assert_array_equal(got, want)  # max picks a row's value: exact, NaN and -inf in place
