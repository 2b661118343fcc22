"""A server (TF Serving) feeds inputs of any shape to the graph, whatever the
signature says. A fused site reduces the ids' last axis; the original's
reduce_mean(rows, axis=1) reads another axis of rows gathered by ids of another
rank (or gives another shape). The fused SavedModel (float and int8 tables)
refuses ids of another rank than the site was matched at; ids of the
signature's rank give the original's numbers."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 40, 8, 5
RNG = np.random.default_rng(7)


def _save(path):
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="ids"),
                                  tf.TensorSpec([None, K], tf.float32, name="w")])
    def f(ids, w):
        return {"out": tf.reduce_mean(tf.gather(module.t, ids) * w[..., None], axis=1)}
    module.f = f
    tf.saved_model.save(module, str(path), signatures={"serving_default": f})


def _run(path, ids, w):
    """The signature run as a server runs it: feeds of any shape (a placeholder of
    unknown shape in place of each input), no check against the signature."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        feeds = {"ids": tf.compat.v1.placeholder(tf.int32, None), "w": tf.compat.v1.placeholder(tf.float32, None)}
        meta = tf.compat.v1.saved_model.loader.load(
            sess, ["serve"], str(path), input_map={f"serving_default_{k}:0": v for k, v in feeds.items()})
        out = graph.get_tensor_by_name(meta.signature_def["serving_default"].outputs["out"].name)
        return sess.run(out, {feeds["ids"]: ids, feeds["w"]: w})


@pytest.mark.parametrize("quantize_table", [None, "int8"])
def test_ids_of_another_rank_are_refused_not_reduced_over_another_axis(tmp_path, quantize_table):
    _save(tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                quantize_table=quantize_table)
    assert [s.status for s in result.fused] == ["fused"], [s.reason for s in result.sites]
    rtol = 1e-5 if quantize_table is None else 2e-2
    ids = RNG.integers(0, N, (3, K)).astype(np.int32)
    w = RNG.random((3, K)).astype(np.float32)
    np.testing.assert_allclose(_run(result.dst, ids, w), _run(tmp_path / "m", ids, w), rtol=rtol, atol=rtol)
    off_rank = [
        # original: mean over axis 1 of [1, 5, 5, D] (the middle axis); the fused op
        # reduced the last axis of the ids: same shape, other numbers
        (np.arange(25, dtype=np.int32).reshape(1, 5, 5), np.ones((1, 5, 5), np.float32), 3),
        # original: mean over axis 1 of [3, D] -> [3]; the fused op: one bag -> [D]
        (np.array([1, 2, 3], np.int32), np.ones(3, np.float32), 1),
    ]
    for ids, w, rank in off_rank:
        original = _run(tmp_path / "m", ids, w)
        with pytest.raises(tf.errors.InvalidArgumentError, match=rf"the ids have rank\] \[{rank}\].*"
                           r"fused for ids of rank 2"):
            fused = _run(result.dst, ids, w)
            print("fused", fused.shape, "original", original.shape)
