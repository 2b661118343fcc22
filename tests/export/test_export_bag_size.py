"""A weighted or masked reduce_mean divides by the bag size K of the request.

TF Serving (and pkm_serve's server, which runs the SavedModel in a Session as it
does) feeds a signature whatever shape the request has: a model whose signature
declares ids [None, 7] still serves [n, 5], and its Mean divides by 5. The fused
model must divide by the same run-time K, not by the K the graph was traced at;
a signature that leaves K open ([None, None]) is fused too. References: numpy
float64 and the original SavedModel, both run through the server's Session.
The .tflite divides by the K of its resized input too (the converter folded a
K read off the ids' static shape).
"""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve import tflite as pkm_tflite  # noqa: E402
from pkm_serve.export import export_saved_model  # noqa: E402
from pkm_serve.serving.servable import Servable  # noqa: E402

ops.load_library()
TRACED_K = 7
BAG_LENGTHS = (1, 3, 5, 7, 9)


def _weighted_mean(t, ids, w):
    return tf.reduce_mean(tf.gather(t, ids) * w[..., None], axis=1)


def _where_mean(t, ids, w):
    rows = tf.where(tf.not_equal(ids, 0)[..., None], tf.gather(t, ids), 0.0)
    return tf.reduce_mean(rows, axis=1)


def _np_weighted_mean(table, ids, w):
    return M.np_bag(table, ids, w) / ids.shape[1]


def _np_where_mean(table, ids, _w):
    return M.np_bag(table, ids, (ids != 0).astype(np.float64)) / ids.shape[1]


def _keras_ops_mean(path, k):
    """Keras 3: Embedding(mask_zero=True) and a layer taking keras.ops.mean of
    the masked rows, exported with model.export."""
    import keras

    class MaskedMean(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.supports_masking = True

        def call(self, x, mask=None):
            return keras.ops.mean(x * keras.ops.cast(mask, x.dtype)[..., None], axis=1)

        def compute_mask(self, x, mask=None):
            return None

    table = M._table(41)
    inp = keras.Input(shape=(k,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(M.N, M.D, mask_zero=True)
    model = keras.Model(inp, MaskedMean()(emb(inp)))
    emb.embeddings.assign(table)
    model.export(str(path), format="tf_saved_model", verbose=False)
    return table


def _module(path, k, body):
    table = M._table(40)
    M.save_bag_module(path, table, body, k=k)
    return table


MODELS = {
    "weighted_mean": (lambda p, k: _module(p, k, _weighted_mean), _np_weighted_mean),
    "where_mean": (lambda p, k: _module(p, k, _where_mean), _np_where_mean),
    "keras_ops_mean": (_keras_ops_mean, _np_where_mean),
}


@pytest.fixture(scope="module", params=[TRACED_K, None], ids=["k7", "kNone"])
def exported(request, tmp_path_factory):
    out = {}
    for name, (build, reference) in MODELS.items():
        src = tmp_path_factory.mktemp(f"{name}_{request.param}") / "src"
        table = build(src, request.param)
        result = export_saved_model(str(src), str(src.parent / "fused"), quiet=True,
                                    tflite=str(src.parent / "m.tflite"), signatures=["serving_default"])
        out[name] = (str(src), result.dst, table, reference, result)
    return out


def _inputs(rng, k, batch=4):
    ids = rng.integers(1, M.N, (batch, k)).astype(np.int32)
    ids[1, (k + 1) // 2:] = 0          # trailing padding
    ids[2, :] = 0                      # all padding
    w = (rng.uniform(0.5, 2.0, (batch, k)) * (ids != 0)).astype(np.float32)
    return ids, w


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mean_divides_by_the_request_bag_size(exported, name):
    src, dst, table, reference, result = exported[name]
    [site] = [s for s in result.sites if s.status == "fused"]
    assert site.computes in ("mean", "masked mean", "weighted mean") and site.combiner == "sum"
    original, fused = Servable("o", 1, src, warmup=False), Servable("f", 1, dst, warmup=False)
    try:
        sig_o, sig_f = original.signatures["serving_default"], fused.signatures["serving_default"]
        rng = np.random.default_rng(3)
        for k in BAG_LENGTHS:
            ids, w = _inputs(rng, k)
            feed = {key: {"idx": ids, "ids": ids, "w": w}[key] for key in sig_o.input_specs}
            [want] = sig_o.run(feed).values()
            [got] = sig_f.run(feed).values()
            expected = reference(table, ids, w)
            np.testing.assert_allclose(want, expected, rtol=1e-5, atol=1e-6, err_msg=f"original K={k}")
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"fused K={k}")
    finally:
        original.release()
        fused.release()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tflite_mean_divides_by_the_resized_bag_size(exported, name):
    src, dst, table, reference, result = exported[name]
    rng = np.random.default_rng(5)
    for k in BAG_LENGTHS:
        ids, w = _inputs(rng, k)
        feed = {"ids": ids} if name == "keras_ops_mean" else {"idx": ids, "w": w}
        [got] = pkm_tflite.run_tflite(result.tflite["file"], feed)
        np.testing.assert_allclose(got, reference(table, ids, w), rtol=1e-5, atol=1e-6, err_msg=f"K={k}")
