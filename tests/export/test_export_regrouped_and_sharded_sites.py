"""A constant unflatten reshape served with ids of another shape, and weighted
embedding_lookup_sparse over table shards. Each fused model is compared with the original
SavedModel run as a server runs it (a Session fed inputs of any shape) and with
numpy float64."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 30, 4, 7
RNG = np.random.default_rng(30)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)


def _export(tmp_path, **kw):
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, **kw)


def _run(path, **inputs):
    """The serving_default signature fed like TF Serving feeds it: placeholders of
    unknown shape in place of the inputs, no check against the signature."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        feeds = {k: tf.compat.v1.placeholder(tf.as_dtype(v.dtype), None) for k, v in inputs.items()}
        meta = tf.compat.v1.saved_model.loader.load(
            sess, ["serve"], str(path), input_map={f"serving_default_{k}:0": v for k, v in feeds.items()})
        out = graph.get_tensor_by_name(meta.signature_def["serving_default"].outputs["out"].name)
        return sess.run(out, {feeds[k]: v for k, v in inputs.items()})


@pytest.mark.parametrize("form", ["sum", "weighted_mean"])
def test_a_constant_unflatten_regroups_ids_of_any_request_shape(tmp_path, form):
    """reshape(gather(t, reshape(ids, [-1])), [-1, 7, D]) summed over axis 1, signature
    ids [None, 7]: ids fed as [7, 5] are 5 bags of 7 to the original (its constant
    reshape regroups them); the fused model summed 7 bags of 5."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="ids"),
                                  tf.TensorSpec([None, K], tf.float32, name="w")])
    def f(ids, w):
        rows = tf.reshape(tf.gather(module.t, tf.reshape(ids, [-1])), [-1, K, D])
        if form == "sum":
            return {"out": tf.reduce_sum(rows, axis=1)}
        return {"out": tf.reduce_mean(rows * w[..., None], axis=1)}
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    table = TABLE.astype(np.float64)
    for shape in [(3, K), (K, 5), (1, 5, K), (2 * K,)]:
        ids = RNG.integers(0, N, shape).astype(np.int32)
        w = RNG.uniform(0.5, 1.5, (ids.size // K, K)).astype(np.float32)
        bags = ids.reshape(-1, K)
        weights = np.ones(bags.shape) if form == "sum" else w.astype(np.float64) / K
        reference = np.einsum("bk,bkd->bd", weights, table[bags])
        original, fused = _run(tmp_path / "m", ids=ids, w=w), _run(result.dst, ids=ids, w=w)
        np.testing.assert_allclose(original, reference, rtol=1e-5, atol=1e-5)
        assert fused.shape == original.shape, shape
        np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)


def test_a_constant_unflatten_regroups_ids_in_the_tflite_too(tmp_path):
    """The .tflite of the fused model, its ids input resized to [7, 5]: 5 bags of 7."""
    from pkm_serve import tflite as pkm_tflite
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="ids")])
    def f(ids):
        return {"out": tf.reduce_sum(tf.reshape(tf.gather(module.t, tf.reshape(ids, [-1])), [-1, K, D]), axis=1)}
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path, tflite=str(tmp_path / "m.tflite"))
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = RNG.integers(0, N, (K, 5)).astype(np.int32)
    reference = TABLE.astype(np.float64)[ids.reshape(-1, K)].sum(1)
    np.testing.assert_allclose(_run(tmp_path / "m", ids=ids), reference, rtol=1e-5, atol=1e-5)
    [got] = pkm_tflite.run_tflite(result.tflite["file"], {"ids": ids})
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def _np_sparse(indices, values, weights, batch, combiner, default_id=None):
    """float64 bags of a [batch, L] SparseTensor; an empty bag is zeros or table[default_id]."""
    table = TABLE.astype(np.float64)
    out = np.zeros((batch, D))
    for b in range(batch):
        at = indices[:, 0] == b
        if not at.any():
            out[b] = 0 if default_id is None else table[default_id]
            continue
        w = weights[at].astype(np.float64)
        total = (table[values[at]] * w[:, None]).sum(0)
        out[b] = total / {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
    return out


@pytest.mark.parametrize("lookup, default_id", [("plain", None), ("safe", None), ("safe", 2)])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_embedding_lookup_sparse_over_table_shards_is_fused(tmp_path, combiner, lookup, default_id):
    """embedding_lookup_sparse(params=[shard0, shard1, shard2], sp_ids, sp_weights): the
    unique rows are stitched from the shards, re-gathered by unique.idx and weighted.
    The export neither fused nor reported it; it is the weighted bag of the stitched
    rows on unique.idx (the unweighted form is fused on them already)."""
    module = tf.Module()
    module.parts = [tf.Variable(TABLE[:10]), tf.Variable(TABLE[10:20]), tf.Variable(TABLE[20:])]
    spec = tf.SparseTensorSpec([None, None], tf.int64)

    @tf.function(input_signature=[spec, tf.SparseTensorSpec([None, None], tf.float32)])
    def f(sp, w):
        if lookup == "plain":
            return {"out": tf.nn.embedding_lookup_sparse(module.parts, sp, w, combiner=combiner)}
        return {"out": tf.nn.safe_embedding_lookup_sparse(module.parts, sp, w, combiner=combiner,
                                                          default_id=default_id)}
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"], [(s.pattern, s.reason) for s in result.sites]
    assert result.sites[0].weighted
    indices = np.array([[0, 0], [0, 1], [0, 2], [2, 0], [3, 0], [3, 1], [5, 0]], np.int64)
    values = np.array([1, 12, 29, 0, 5, 5, 17], np.int64)
    weights = np.linspace(0.5, 2.0, len(values)).astype(np.float32)
    shape = np.array([6, 3], np.int64)
    feeds = {"sp": indices, "sp_1": values, "sp_2": shape, "w": indices, "w_1": weights, "w_2": shape}
    reference = _np_sparse(indices, values, weights, 6, combiner, default_id if lookup == "safe" else None)
    np.testing.assert_allclose(_run(tmp_path / "m", **feeds), reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_run(result.dst, **feeds), reference, rtol=1e-5, atol=1e-6)
