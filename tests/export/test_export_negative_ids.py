"""A negative id the original model's gather refuses is refused by the fused
SavedModel too (an Assert on the ids fed to the fused op), not taken as
padding; composites that map negative ids to padding themselves keep that."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model
from pkm_serve.export.exporter import read_saved_model

ops.load_library()

N, D, K = 30, 4, 5
RNG = np.random.default_rng(41)


def _export(tmp_path):
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    return result


def _call(path, ids):
    f = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {k: v.numpy() for k, v in f(ids=tf.constant(ids)).items()}


def _assert_count(path):
    graph = read_saved_model(str(path)).meta_graphs[0].graph_def
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op == "Assert" and "pkm_ids_check" in n.name for n in nodes)


def _keras_embedding_mean(path):
    """Keras 3 Embedding -> GlobalAveragePooling1D: `take` wraps id + N first."""
    import keras
    inp = keras.Input(shape=(K,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(N, D, name="emb")
    model = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(emb(inp)))
    model.export(str(path), format="tf_saved_model", verbose=False)


def _tf_gather_sum(path):
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64, name="ids")])
    def f(ids):
        return {"out": tf.reduce_sum(tf.gather(module.t, ids), axis=1)}
    module.f = f
    tf.saved_model.save(module, str(path), signatures={"serving_default": f})


@pytest.mark.parametrize("model, dtype, bad, good", [
    # -(N + 1) wraps to -1 in the Keras model: refused; -N .. -1 wrap into the table.
    (_keras_embedding_mean, np.int32, -(N + 1), [-1, -N, 0, N - 1]),
    (_tf_gather_sum, np.int64, -1, [0, 3, N - 1]),
])
def test_a_negative_id_the_original_refuses_is_refused(tmp_path, model, dtype, bad, good):
    model(tmp_path / "m")
    result = _export(tmp_path)
    assert _assert_count(result.dst) == 1
    ids = RNG.integers(0, N, (4, K)).astype(dtype)
    ids[:, 0] = np.resize(good, 4)
    want, got = _call(tmp_path / "m", ids), _call(result.dst, ids)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    ids[2, 3] = bad
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        _call(tmp_path / "m", ids)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"an id is negative.*\[-1\]|an id is negative.*\[%d\]" % bad):
        _call(result.dst, ids)
    # An empty request passes the check (the smallest of no ids is the dtype's largest).
    empty = _call(result.dst, np.zeros((0, K), ids.dtype))
    assert all(v.shape[0] == 0 for v in empty.values())


def test_a_composite_that_masks_negative_ids_keeps_them_as_padding(tmp_path):
    """where(ids >= 0, ids, 0) before the gather and a mask after: the fused op's
    padding is what the composite computes, and no check is added."""
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="ids")])
    def f(ids):
        valid = ids >= 0
        rows = tf.gather(module.t, tf.where(valid, ids, tf.zeros_like(ids)))
        total = tf.reduce_sum(tf.where(valid[..., None], rows, tf.zeros_like(rows)), axis=1)
        return {"out": total / tf.maximum(tf.reduce_sum(tf.cast(valid, tf.float32), 1, keepdims=True), 1.0)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    assert _assert_count(result.dst) == 0
    ids = RNG.integers(0, N, (4, K)).astype(np.int32)
    ids[1, 2:] = -1
    ids[2, :] = -7  # an all-padding bag
    want, got = _call(tmp_path / "m", ids), _call(result.dst, ids)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    assert np.all(got["out"][2] == 0)


def test_in_tflite_the_check_is_dropped_and_a_negative_id_is_padding(tmp_path):
    """The TFLite converter drops Asserts (as it drops the sparse row-order one):
    the .tflite converts, computes the bag of good ids, and takes a negative id
    as padding (docs/export.md, Limits)."""
    from pkm_serve import tflite
    _tf_gather_sum(tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                tflite=str(tmp_path / "m.tflite"))
    assert _assert_count(result.dst) == 1
    ids = RNG.integers(0, N, (3, K)).astype(np.int64)
    want = _call(tmp_path / "m", ids)["out"]
    got = tflite.run_tflite(str(tmp_path / "m.tflite"), [ids], interpreter="litert")[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    padded = ids.copy()
    padded[0, 1] = -5
    got = tflite.run_tflite(str(tmp_path / "m.tflite"), [padded], interpreter="litert")[0]
    table = tf.saved_model.load(str(tmp_path / "m")).t.numpy()
    np.testing.assert_allclose(got[0], want[0] - table[ids[0, 1]], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5, atol=1e-6)


def _sequence_masked_mean(path):
    """ids padded past each row's length: where(sequence_mask(lengths), gather(t, ids), 0)."""
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids"),
                                  tf.TensorSpec([None], tf.int32, name="lengths")])
    def f(ids, lengths):
        mask = tf.sequence_mask(lengths, tf.shape(ids)[1])
        rows = tf.where(mask[..., None], tf.gather(module.t, ids), 0.)
        return {"out": tf.reduce_sum(rows, 1) / tf.cast(tf.maximum(lengths, 1), tf.float32)[:, None]}
    module.f = f
    tf.saved_model.save(module, str(path), signatures={"serving_default": f})


def _inverted_where_sum(path):
    """where(mask, 0, rows): the mask selects the zero branch."""
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64, name="ids"),
                                  tf.TensorSpec([None], tf.int32, name="lengths")])
    def f(ids, lengths):
        masked = tf.logical_not(tf.sequence_mask(lengths, K))
        return {"out": tf.reduce_sum(tf.where(masked[..., None], 0., tf.gather(module.t, ids)), axis=1)}
    module.f = f
    tf.saved_model.save(module, str(path), signatures={"serving_default": f})


def _call_lengths(path, ids, lengths):
    f = tf.saved_model.load(str(path)).signatures["serving_default"]
    return f(ids=tf.constant(ids), lengths=tf.constant(lengths, tf.int32))["out"].numpy()


@pytest.mark.parametrize("model", [_sequence_masked_mean, _inverted_where_sum])
def test_an_id_past_the_table_in_a_masked_position_is_refused(tmp_path, model):
    """The composite gathers every id before its tf.where, so an id >= N in a
    masked position fails its gather; the fused op makes that position padding
    and would never read the id: the fused SavedModel asserts ids < N too."""
    model(tmp_path / "m")
    result = _export(tmp_path)
    table = tf.saved_model.load(str(tmp_path / "m")).t.numpy().astype(np.float64)
    ids = RNG.integers(0, N, (3, K)).astype(np.int64)
    ids[:, -1] = N - 1  # the last row of the table is in range
    lengths = np.array([2, K, 0], np.int32)
    keep = np.arange(K)[None, :] < lengths[:, None]
    if model is _inverted_where_sum:
        want = np.einsum("bk,bkd->bd", keep, table[ids])
    else:
        want = np.einsum("bk,bkd->bd", keep, table[ids]) / np.maximum(lengths, 1)[:, None]
    np.testing.assert_allclose(_call_lengths(result.dst, ids, lengths), want, rtol=1e-5, atol=1e-6)
    ids[0, 3] = N  # masked in row 0 (length 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        _call_lengths(tmp_path / "m", ids, lengths)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"out of range.*\[%d\].*not in \[0, %d\)" % (N, N)):
        _call_lengths(result.dst, ids, lengths)
    empty = _call_lengths(result.dst, np.zeros((0, K), np.int64), np.zeros([0], np.int32))
    assert empty.shape == (0, D)


def test_in_tflite_a_masked_id_past_the_table_is_padding(tmp_path):
    """The TFLite converter drops the bound Assert too: in the .tflite a masked
    position's id is never read, so an id >= N there is accepted and the bag
    is that of the unmasked ids (docs/export.md, Limits)."""
    from pkm_serve import tflite
    _inverted_where_sum(tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                tflite=str(tmp_path / "m.tflite"))
    assert [s.status for s in result.sites] == ["fused"]
    ids = RNG.integers(0, N, (2, K)).astype(np.int64)
    lengths = np.array([2, K], np.int32)
    want = _call_lengths(tmp_path / "m", ids, lengths)
    ids[0, 3] = N + 5
    got = tflite.run_tflite(str(tmp_path / "m.tflite"), {"ids": ids, "lengths": lengths}, interpreter="litert")[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
