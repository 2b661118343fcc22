"""Forms a bug hunt found mishandled: each exports (fused, or reported with a
reason), and the fused model computes what the original does (the original
SavedModel and numpy float64 are the references)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model

ops.load_library()

N, D = 30, 3
RNG = np.random.default_rng(52)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)


def _export(tmp_path, **kw):
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, **kw)


def _outputs(path, **inputs):
    f = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {k: v.numpy() for k, v in f(**inputs).items()}


def _np_sparse(indices, values, weights, batch, combiner):
    table = TABLE.astype(np.float64)
    out = np.zeros((batch, D))
    for b in range(batch):
        at = indices[:, 0] == b
        if not at.any():
            continue
        w = weights[at].astype(np.float64)
        total = (table[values[at]] * w[:, None]).sum(0)
        out[b] = total / {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
    return out


@pytest.mark.parametrize("combiner, weighted", [("mean", False), ("sqrtn", False), ("sum", True)])
def test_embedding_lookup_sparse_over_table_shards(tmp_path, combiner, weighted):
    """embedding_lookup_sparse on a list of shards (div partitioning): the
    export used to abort (TypeError: dtype 0, Unique's out_idx attr left out
    of the NodeDef as its default); it now exports and computes the same."""
    module = tf.Module()
    module.parts = [tf.Variable(TABLE[:10]), tf.Variable(TABLE[10:20]), tf.Variable(TABLE[20:])]
    spec = tf.SparseTensorSpec([None, None], tf.int64)

    @tf.function(input_signature=[spec, tf.SparseTensorSpec([None, None], tf.float32)])
    def f(sp, w):
        return {"out": tf.nn.embedding_lookup_sparse(module.parts, sp, w if weighted else None,
                                                     combiner=combiner)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    # The segment op on the stitched rows is fused (a bag over the looked-up unique
    # rows); weighted, their re-gather by unique.idx is the gather (test_export_fixX30).
    assert [s.status for s in result.sites] == ["fused"], \
        [s.reason for s in result.sites]
    indices = np.array([[0, 0], [0, 1], [0, 2], [2, 0], [3, 0], [3, 1]], np.int64)
    values = np.array([1, 12, 29, 0, 5, 5], np.int64)
    weights = np.linspace(0.5, 2.0, len(values)).astype(np.float32) if weighted else \
        np.ones(len(values), np.float32)
    shape = np.array([4, 3], np.int64)
    feeds = dict(sp=indices, sp_1=values, sp_2=shape, w=indices, w_1=weights, w_2=shape)
    want = _outputs(tmp_path / "m", **feeds)["out"]
    got = _outputs(result.dst, **feeds)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, _np_sparse(indices, values, weights, 4, combiner), rtol=1e-5, atol=1e-6)


def test_a_skip_message_names_a_dtype_it_could_not_read():
    from pkm_serve.export.sites import dtype_name
    assert dtype_name(0) == "unknown" and dtype_name(1) == "float32"


@pytest.mark.parametrize("out_type", [tf.int64, tf.int32])
def test_the_rows_shape_keeps_its_out_type(tmp_path, out_type):
    """tf.shape(rows, out_type=tf.int64) of the gathered rows is rebuilt from the
    ids' shape in int64 (it was rebuilt twice, the second time as int32, and
    the fused SavedModel did not load)."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids")])
    def f(ids):
        rows = tf.gather(module.t, ids)
        k = tf.cast(tf.shape(rows, out_type=out_type)[1], tf.float32)
        return {"out": tf.reduce_sum(rows, axis=1) / k}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"]
    ids = RNG.integers(0, N, (3, 7)).astype(np.int64)
    got = _outputs(result.dst, ids=ids)["out"]
    np.testing.assert_allclose(got, _outputs(tmp_path / "m", ids=ids)["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, TABLE.astype(np.float64)[ids].mean(1), rtol=1e-5, atol=1e-6)


def test_a_model_refusing_the_generated_inputs_names_sample_inputs(tmp_path):
    """Flat ids the model cuts into bags of 7 (a length not a multiple of 7 is refused): the generated ids
    (8 of them) do not fit and the original model refuses them; the error says so and points at
    --sample-inputs, with which the same model exports. (This was RaggedTensor ids of ragged_rank 2, which
    verification now feeds valid nested row_splits.)"""
    from pkm_serve.export import ExportError
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def f(r):
        return {"out": tf.reduce_sum(tf.gather(module.t, tf.reshape(r, [-1, 7])), axis=1)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    with pytest.raises(ExportError, match=r"original model fails on the generated inputs.*--sample-inputs"):
        _export(tmp_path)
    sample = dict(r=RNG.integers(0, N, 14).astype(np.int64))
    np.savez(tmp_path / "s.npz", **sample)
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out2"), quiet=True,
                                sample_inputs=str(tmp_path / "s.npz"))
    np.testing.assert_allclose(_outputs(result.dst, **sample)["out"], _outputs(tmp_path / "m", **sample)["out"],
                               rtol=1e-5, atol=1e-6)


POSITIONS = np.array([1.0, 0.5, 0.25, 0.125], np.float32)


@pytest.mark.parametrize("form", ["variable_1k1", "const_k1", "mean_1k1"])
def test_positional_weights_shared_by_every_bag_are_fused(tmp_path, form):
    """rows * pos with pos [1, K, 1] or [K, 1] (one weight per position, the same
    for every bag) was skipped ("weights shape (1, 4) does not match indices
    shape (None, 4)"): fused with the weights broadcast to the ids."""
    from pkm_serve import tflite
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.pos = tf.Variable(POSITIONS[None, :, None])

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int64, name="ids")])
    def f(ids):
        rows = tf.gather(module.t, ids)
        if form == "const_k1":
            return {"out": tf.reduce_sum(rows * tf.constant(POSITIONS[:, None]), axis=1)}
        reduce = tf.reduce_mean if form == "mean_1k1" else tf.reduce_sum
        return {"out": reduce(rows * module.pos, axis=1)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    lite = str(tmp_path / "m.tflite") if form == "variable_1k1" else None
    result = _export(tmp_path, tflite=lite)
    assert [(s.status, s.weighted) for s in result.sites] == [("fused", True)], [s.reason for s in result.sites]
    ids = RNG.integers(0, N, (5, 4)).astype(np.int64)
    expected = np.einsum("k,bkd->bd", POSITIONS.astype(np.float64), TABLE.astype(np.float64)[ids])
    if form == "mean_1k1":
        expected /= 4
    got = _outputs(result.dst, ids=ids)["out"]
    np.testing.assert_allclose(got, _outputs(tmp_path / "m", ids=ids)["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if lite:
        np.testing.assert_allclose(tflite.run_tflite(lite, [ids], interpreter="litert")[0], expected,
                                   rtol=1e-5, atol=1e-6)
