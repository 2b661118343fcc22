"""A masked max, reduce_max(tf.where(kept[..., None], rows, -inf), 1), exported with --tflite: the fused site's
bag of no kept row is -inf, as the composite's. The TFLite converter writes a -inf constant as -3.4e38 (float32's
lowest), so the .tflite gave -3.4e38 there and the export's TFLite verification failed on such a sample; the -inf
is now computed at run time. Another fill (the dtype's lowest) is kept as it was."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model

ops.load_library()
N, D, K = 12, 3, 4
TABLE = np.random.default_rng(37).standard_normal((N, D)).astype(np.float32)
IDS = tf.TensorSpec([None, K], tf.int64)
FILLS = {"minus_inf": -np.inf, "lowest": np.finfo(np.float32).min}
FEED = {"ids": np.array([[1, 2, 0, 0], [0, 0, 0, 0], [3, 3, 4, 7]])}


def _masked_max(ids, fill):
    """numpy float64: the max of the rows of the nonzero ids, and `fill` where some id is 0 (-inf where none kept)."""
    kept = ids != 0
    rows = np.where(kept[..., None], TABLE.astype(np.float64)[ids], fill)
    return rows.max(1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("masked_max_tflite")
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    f = tf.function(input_signature=[IDS])(lambda ids: {name: tf.reduce_max(tf.where(
        (ids != 0)[..., None], tf.gather(module.t, ids), fill), 1) for name, fill in FILLS.items()})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    np.savez(str(tmp_path / "sample.npz"), **FEED)
    lite = str(tmp_path / "m.tflite")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, tflite=lite,
                                sample_inputs=str(tmp_path / "sample.npz"))
    return result, tflite.make_interpreter(lite).get_signature_runner("serving_default")(**FEED)


@pytest.mark.parametrize("fill", list(FILLS))
def test_masked_max_tflite_keeps_the_bag_of_no_kept_row(exported, fill):
    result, got = exported
    assert [s.status for s in result.sites] == ["fused"] * len(FILLS), [s.reason for s in result.sites]
    expected = _masked_max(FEED["ids"], FILLS[fill])
    assert np.isneginf(expected[1]).all() == (fill == "minus_inf")
    np.testing.assert_allclose(got[fill], expected, rtol=1e-6)
