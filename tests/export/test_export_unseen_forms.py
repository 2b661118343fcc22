"""Composite forms from outside the project's corpus (round 25's bug hunt): each
is either fused and computes what the original does, or reported and left as
written; never fused into something else. The original SavedModel (TF's own
composite) is the reference, beside numpy where the form is simple."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import ExportError, export_saved_model
from pkm_serve.export.exporter import _error_line
from pkm_serve.export.verify import VerificationError, compare_outputs
from round34_forms import loaded_signature

ops.load_library()

N, D = 30, 4
RNG = np.random.default_rng(25)


def _save(path, signature, table=None, extra=None):
    module = tf.Module()
    module.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32) if table is None else table)
    for key, value in (extra or {}).items():
        setattr(module, key, tf.Variable(value))
    module.f = signature(module)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})
    return module


def _export(tmp_path, **kw):
    return export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True, **kw)


def _both(tmp_path, result, **inputs):
    original, fused = loaded_signature(tmp_path / "m"), loaded_signature(result.dst)
    return ({k: v.numpy() for k, v in original(**inputs).items()},
            {k: v.numpy() for k, v in fused(**inputs).items()})


RAGGED_SPEC = tf.RaggedTensorSpec([None, None], tf.int64, row_splits_dtype=tf.int64)
BAGS = tf.ragged.constant([[1, 2], [], [3, 4, 5]], dtype=tf.int64)


def _ragged_module(reduce):
    def signature(module):
        @tf.function(input_signature=[RAGGED_SPEC])
        def f(rt):
            return {"out": reduce(tf.gather(module.t, rt.values), rt)}
        return f
    return signature


def test_a_ragged_segment_sum_on_the_partition_is_fused(tmp_path):
    module = _save(tmp_path / "m", _ragged_module(
        lambda rows, rt: tf.math.unsorted_segment_sum(rows, rt.value_rowids(), rt.nrows())))
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"]
    want, got = _both(tmp_path, result, rt=BAGS.values, rt_1=BAGS.row_splits)
    table = module.t.numpy().astype(np.float64)
    reference = np.stack([table[list(bag)].sum(0) if len(bag) else np.zeros(D)
                          for bag in BAGS.to_list()])
    np.testing.assert_allclose(got["out"], reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(want["out"], reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["fixed_num_segments", "more_segments", "reversed_bags",
                                  "reversed_bags_max"])
def test_segment_reductions_that_are_not_the_partition_are_other_bags(tmp_path, form):
    """Segment ids computed from the row partition that are not its rows: fused as segment sums (max) of ids in
    any order (unsorted_segments.py); the max of an empty bag is float32's lowest value, as the original's."""
    reduce = {
        # A padded batch: 8 output rows whatever the number of bags.
        "fixed_num_segments": lambda rows, rt: tf.math.unsorted_segment_sum(
            rows, rt.value_rowids(), 8),
        "more_segments": lambda rows, rt: tf.math.unsorted_segment_sum(
            rows, rt.value_rowids(), rt.nrows() + 2),
        # Bag b written to row nrows - 1 - b: computed from the splits alone, yet not the rows.
        "reversed_bags": lambda rows, rt: tf.math.unsorted_segment_sum(
            rows, rt.nrows() - 1 - rt.value_rowids(), rt.nrows()),
        "reversed_bags_max": lambda rows, rt: tf.math.unsorted_segment_max(
            rows, rt.nrows() - 1 - rt.value_rowids(), rt.nrows()),
    }[form]
    _save(tmp_path / "m", _ragged_module(reduce))
    result = _export(tmp_path)
    [site] = result.sites
    want, got = _both(tmp_path, result, rt=BAGS.values, rt_1=BAGS.row_splits)
    assert site.status == "fused", site.reason
    table = tf.saved_model.load(str(tmp_path / "m")).t.numpy().astype(np.float64)
    if form == "reversed_bags_max":
        bags = [table[list(bag)].max(0) if len(bag) else np.full(D, np.finfo(np.float32).min)
                for bag in BAGS.to_list()]
        form = "reversed_bags"
    else:
        bags = [table[list(bag)].sum(0) if len(bag) else np.zeros(D) for bag in BAGS.to_list()]
    reference = np.zeros((len(want["out"]), D))
    reference[:len(bags)] = bags[::-1] if form == "reversed_bags" else bags
    np.testing.assert_allclose(want["out"], reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["out"], reference, rtol=1e-6, atol=1e-6)


def test_a_float16_table_weighted_in_float32_stays_composite(tmp_path):
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32),
                                      tf.TensorSpec([None, 3], tf.float32)])
        def f(ids, w):
            rows = tf.cast(tf.gather(module.t, ids), tf.float32)
            return {"out": tf.reduce_sum(rows * w[..., None], axis=1)}
        return f
    table = RNG.uniform(1, 2, (N, D)).astype(np.float16)
    _save(tmp_path / "m", signature, table=table)
    result = _export(tmp_path)
    [site] = result.sites
    assert site.status == "skipped" and "65504" in site.reason
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    w = np.array([[1e5, 1.0, 1.0], [3e4, 3e4, 3e4]], np.float32)  # sums far past float16's range
    want, got = _both(tmp_path, result, ids=ids, w=w)
    reference = np.einsum("bk,bkd->bd", w.astype(np.float64), table.astype(np.float64)[ids])
    assert np.all(np.isfinite(got["out"]))
    np.testing.assert_allclose(got["out"], reference, rtol=1e-6)
    np.testing.assert_array_equal(got["out"], want["out"])


def _weighted_bag_of_any_shapes(module):
    """reduce_sum(gather(t, ids) * w[..., None], 1) with ids and w both [None, None]."""
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.float32)])
    def f(ids, w):
        return {"out": tf.reduce_sum(tf.gather(module.t, ids) * w[..., None], axis=1)}
    return f


def test_weights_and_ids_that_broadcast_like_the_composite(tmp_path):
    module = _save(tmp_path / "m", _weighted_bag_of_any_shapes)
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"]
    table = module.t.numpy().astype(np.float64)
    ids = RNG.integers(0, N, (4, 5)).astype(np.int32)
    w = RNG.uniform(0.5, 2, (4, 5)).astype(np.float32)
    # Per-index weights, per-bag weights [B, 1], and one row of ids for every bag's weights.
    for feed_ids, feed_w in ((ids, w), (ids, w[:, :1]), (ids[:1], w)):
        want, got = _both(tmp_path, result, ids=feed_ids, w=feed_w)
        b_ids, b_w = np.broadcast_arrays(feed_ids, feed_w)
        reference = np.einsum("bk,bkd->bd", b_w.astype(np.float64), table[b_ids])
        np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)


_RUN_MISMATCHED_IN_LITERT = """
import sys, numpy as np
from pkm_serve import tflite
runner = tflite.make_interpreter(sys.argv[1], interpreter="litert").get_signature_runner("serving_default")
ids = np.array([[1, 2, 3, 4]], np.int32)
for w in (np.ones((1, 4), np.float32), np.ones((1, 1), np.float32), np.ones((1, 3), np.float32)):
    try:
        out = runner(ids=ids, w=w)["out"]
        print("ok", float(out.sum()))
    except RuntimeError as e:
        print("error", str(e).splitlines()[0])
"""


def test_broadcast_weights_in_tflite_error_where_they_do_not_broadcast(tmp_path):
    """In the .tflite, ids [1, 4] against weights [1, 3] must be an error: the broadcast the
    export added (BROADCAST_ARGS then) aborted the process, a model server's included."""
    import subprocess
    import sys

    module = _save(tmp_path / "m", _weighted_bag_of_any_shapes)
    _export(tmp_path, tflite=str(tmp_path / "m.tflite"))
    proc = subprocess.run([sys.executable, "-c", _RUN_MISMATCHED_IN_LITERT, str(tmp_path / "m.tflite")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    row_sum = module.t.numpy()[[1, 2, 3, 4]].sum()
    assert lines[0].startswith("ok") and abs(float(lines[0].split()[1]) - row_sum) < 1e-4, lines
    assert lines[1].startswith("ok") and abs(float(lines[1].split()[1]) - row_sum) < 1e-4, lines  # one per bag
    assert lines[2].startswith("error") and "[1,4] and [1,3], are not broadcastable" in lines[2], lines


def test_a_segment_sum_scaled_by_one_broadcast_value(tmp_path):
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.int32),
                                      tf.TensorSpec([None], tf.int32)])
        def f(ids, seg):
            return {"out": tf.math.segment_sum(tf.gather(module.t, ids) * module.scale, seg)}
        return f
    module = _save(tmp_path / "m", signature, extra={"scale": np.array([[0.5]], np.float32)})
    ids = np.array([1, 2, 3, 4, 5, 6], np.int32)
    seg = np.array([0, 0, 1, 2, 2, 2], np.int32)
    np.savez(tmp_path / "samples.npz", ids=ids, seg=seg)
    result = _export(tmp_path, sample_inputs=str(tmp_path / "samples.npz"))
    assert [s.status for s in result.sites] == ["fused"]
    want, got = _both(tmp_path, result, ids=ids, seg=seg)
    table = module.t.numpy().astype(np.float64)
    reference = np.stack([0.5 * table[ids[seg == s]].sum(0) for s in range(3)])
    np.testing.assert_allclose(got["out"], reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-6, atol=1e-6)


def test_verification_holds_values_at_the_dtype_extremes_exactly():
    lowest = np.finfo(np.float32).min  # reduce_max of an empty bag
    want = {"o": np.array([[1.0, 2.0], [lowest, lowest]], np.float32)}
    assert compare_outputs("s", want, {"o": want["o"].copy()})[0]["atol"] < 1e-3
    with pytest.raises(VerificationError, match="differs"):  # a wrong bag beside an empty one
        compare_outputs("s", want, {"o": np.array([[3.5, 2.0], [lowest, lowest]], np.float32)})
    with pytest.raises(VerificationError, match="differs"):  # an empty bag that is not
        compare_outputs("s", want, {"o": np.array([[1.0, 2.0], [0.0, lowest]], np.float32)})


def test_tf_errors_are_reported_by_their_one_line():
    table = tf.Variable(tf.ones((30, 2)))

    @tf.function
    def lookup(ids):
        return tf.gather(table, ids)

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        lookup(tf.constant([40]))
    assert "\n" in caught.value.message  # TF's frames and node name around it
    assert _error_line(caught.value.message) == "indices[0] = 40 is not in [0, 30)"


@pytest.mark.parametrize("rtol", [-1.0, float("inf"), float("nan")])
def test_a_negative_or_infinite_rtol_is_refused(tmp_path, rtol):
    """inf (and NaN) accepted every output: verification silently off."""
    _save(tmp_path / "m", _ragged_module(
        lambda rows, rt: tf.math.unsorted_segment_sum(rows, rt.value_rowids(), rt.nrows())))
    with pytest.raises(ExportError, match=r"--rtol must be a finite number >= 0, got"):
        _export(tmp_path, rtol=rtol)


@pytest.mark.parametrize("combine", ["sum", "mean"])
def test_masked_rows_filled_by_zeros_like(tmp_path, combine):
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32)])
        def f(ids):
            mask = ids >= 0
            rows = tf.gather(module.t, tf.maximum(ids, 0))
            masked = tf.where(mask[..., None], rows, tf.zeros_like(rows))
            total = tf.reduce_sum(masked, axis=1)
            if combine == "mean":
                total = total / tf.maximum(tf.reduce_sum(tf.cast(mask, tf.float32), 1, keepdims=True), 1.0)
            return {"out": total}
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    ids = RNG.integers(-1, N, (6, 5)).astype(np.int32)
    ids[2] = -1  # an all-padding bag
    want, got = _both(tmp_path, result, ids=ids)
    table = module.t.numpy().astype(np.float64)
    reference = np.stack([table[row[row >= 0]].sum(0) / (max(1, (row >= 0).sum()) if combine == "mean" else 1)
                          for row in ids])
    np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["ones_like", "shape_of_product"])
def test_a_multiplier_that_broadcasts_the_bag_at_run_time(tmp_path, form):
    """ids [B, 1] against a multiplier [B, 4] (both [None, None] in the signature): the product
    repeats each row 4 times. Multiplying by tf.ones_like(w) was fused as the bag of the ids alone
    (a quarter of the sum); a Shape of the weighted product was rebuilt from the ids' shape (a
    mean dividing by 1 instead of 4). Both passed verification, which fed equal shapes."""
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64),
                                      tf.TensorSpec([None, None], tf.float32)])
        def f(ids, w):
            rows = tf.gather(module.t, ids)
            if form == "ones_like":
                return {"out": tf.reduce_sum(rows * tf.ones_like(w)[..., None], axis=1)}
            x = rows * w[..., None]
            return {"out": tf.reduce_sum(x, 1) / tf.cast(tf.shape(x)[1], tf.float32)}
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"]
    table = module.t.numpy().astype(np.float64)
    for ids, w in ((RNG.integers(0, N, (3, 1)), RNG.uniform(0.5, 2, (3, 4))),
                   (RNG.integers(0, N, (3, 4)), RNG.uniform(0.5, 2, (3, 4))),
                   (RNG.integers(0, N, (2, 5)), RNG.uniform(0.5, 2, (2, 1)))):
        want, got = _both(tmp_path, result, ids=ids, w=w.astype(np.float32))
        b_ids, b_w = np.broadcast_arrays(ids, w.astype(np.float32).astype(np.float64))
        if form == "ones_like":
            reference = table[b_ids].sum(axis=1)
        else:
            reference = np.einsum("bk,bkd->bd", b_w, table[b_ids]) / b_ids.shape[1]
        np.testing.assert_allclose(want["out"], reference, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)


def test_attention_pooled_weights_convert_to_tflite(tmp_path):
    """Weights from a softmax over the bag axis of a [N, 1] table's gather (attention pooling,
    Keras' Softmax(axis=1) of an Embedding(N, 1)): the export squeezed them with a Squeeze, which
    the converter folded into the softmax's TRANSPOSE as a permutation LiteRT aborts on (run in a
    subprocess: the abort took the process down)."""
    import subprocess
    import sys

    scores = RNG.standard_normal((N, 1)).astype(np.float32)

    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.int64)])
        def f(ids):
            attention = tf.nn.softmax(tf.gather(module.s, ids), axis=1)  # [B, 6, 1]
            return {"out": tf.reduce_sum(tf.gather(module.t, ids) * attention, axis=1)}
        return f
    module = _save(tmp_path / "m", signature, extra={"s": scores})
    proc = subprocess.run([sys.executable, "-m", "pkm_serve.cli", "export", str(tmp_path / "m"), str(tmp_path / "out"),
                           "--tflite", str(tmp_path / "m.tflite")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verified tflite serving_default:out" in proc.stdout + proc.stderr
    from pkm_serve import tflite
    ids = RNG.integers(0, N, (5, 6))
    (got,) = tflite.run_tflite(str(tmp_path / "m.tflite"), [ids])
    s = scores[ids][..., 0].astype(np.float64)
    a = np.exp(s - s.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("bk,bkd->bd", a, module.t.numpy()[ids]), rtol=1e-5, atol=1e-6)


def test_a_signature_the_converter_leaves_out_is_refused(tmp_path):
    """TF's converter, asked for two signatures of this module, writes one and raises nothing;
    the export reported success and the model server then answered 'signature not found'."""
    class TwoSignatures(tf.Module):
        def __init__(self):
            super().__init__()
            self.t = tf.Variable(RNG.standard_normal((N, D)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int64), tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, ids, w):
            return {"output": tf.reduce_sum(tf.gather(self.t, ids) * w[..., None], axis=-2)}

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int32)])
        def unweighted(self, ids):
            return {"sum": tf.reduce_sum(tf.gather(self.t, ids), axis=-2), "count": tf.shape(ids)[0:1]}

    module = TwoSignatures()
    tf.saved_model.save(module, str(tmp_path / "m"),
                        signatures={"serving_default": module.serve, "unweighted": module.unweighted})
    with pytest.raises(ExportError, match=r"left signature\(s\) 'unweighted' out of the \.tflite \(it kept "
                                          r"'serving_default'\); convert them in a \.tflite of their own"):
        _export(tmp_path, tflite=str(tmp_path / "both.tflite"))
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out2"), quiet=True, signatures=["unweighted"],
                                tflite=str(tmp_path / "unweighted.tflite"))
    assert result.tflite["signatures"] == ["unweighted"]


def test_quantize_tables_on_the_projects_own_layers_names_the_tflite_route(tmp_path):
    import keras

    from pkm_serve.export import quantize_tables
    from pkm_serve.layers import EmbeddingBag

    ids = keras.Input((4,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(2)(EmbeddingBag(N, D)(ids)))
    with pytest.raises(ExportError, match=r"already run the pkm_serve op .* convert the model to \.tflite and "
                                          r"quantize that \(pkm_serve\.tflite\.quantize_table_int8\)"):
        quantize_tables(model, str(tmp_path / "q"))


@pytest.mark.parametrize("form", ["unweighted_segment_sum", "einsum_with_gathered_weights"])
def test_forms_that_were_left_composite(tmp_path, form):
    """An unweighted tf.math.segment_sum of gathered rows was not even reported (only the weighted
    spelling was matched); an einsum whose weights are a gather of a 1-D per-id table was skipped
    ("table is not known to be 2-D") before the [N, D] operand was tried."""
    idf = RNG.uniform(0.1, 2.0, N).astype(np.float32)

    def signature(module):
        if form == "unweighted_segment_sum":
            @tf.function(input_signature=[tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)])
            def f(values, segments):
                return {"out": tf.math.segment_sum(tf.gather(module.t, values), segments)}
        else:
            @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64)])
            def f(ids):
                return {"out": tf.einsum("bk,bkd->bd", tf.gather(module.idf, ids), tf.gather(module.t, ids))}
        return f
    module = _save(tmp_path / "m", signature, extra={"idf": idf})
    samples = {}
    if form == "unweighted_segment_sum":  # raw segment ids: the generated inputs are not sorted
        np.savez(tmp_path / "samples.npz", values=np.array([2, 7, 7, 0], np.int64),
                 segments=np.array([0, 1, 1, 3], np.int64))
        samples = {"sample_inputs": str(tmp_path / "samples.npz")}
    result = _export(tmp_path, **samples)
    assert [s.status for s in result.sites] == ["fused"], [(s.status, s.reason) for s in result.sites]
    table = module.t.numpy().astype(np.float64)
    if form == "unweighted_segment_sum":
        values, segments = np.array([3, 1, 4, 1, 5], np.int64), np.array([0, 0, 2, 2, 3], np.int64)
        want, got = _both(tmp_path, result, values=values, segments=segments)
        reference = np.zeros((4, D))
        np.add.at(reference, segments, table[values])
    else:
        ids = RNG.integers(0, N, (3, 5))
        want, got = _both(tmp_path, result, ids=ids)
        reference = np.einsum("bk,bkd->bd", idf[ids].astype(np.float64), table[ids])
    np.testing.assert_allclose(want["out"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)


def _on_device_embedding_module(reduce, scale_factor=None):
    """tf-models-official's OnDeviceEmbedding (a gather of the flattened ids,
    reshaped back to [B, L, D]) pooled over L by `reduce(rows, w)`."""
    from official.nlp.modeling.layers import OnDeviceEmbedding
    layer = OnDeviceEmbedding(N, D, scale_factor=scale_factor)
    layer.build([None, 5])
    layer.embeddings.assign(RNG.standard_normal((N, D)).astype(np.float32))
    module = tf.Module()
    module.layer = layer

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32), tf.TensorSpec([None, 5], tf.float32)])
    def f(ids, w):
        return {"out": reduce(layer(ids), w)}
    module.f = f
    return module, layer.embeddings.numpy().astype(np.float64)


@pytest.mark.parametrize("form", ["sum", "mean", "weighted_sum", "weighted_mean"])
def test_on_device_embedding_pooled_over_the_sequence_is_fused(tmp_path, form):
    reduce = {"sum": lambda rows, w: tf.reduce_sum(rows, axis=1),
              "mean": lambda rows, w: tf.reduce_mean(rows, axis=1),
              "weighted_sum": lambda rows, w: tf.reduce_sum(rows * w[:, :, None], axis=1),
              "weighted_mean": lambda rows, w: tf.reduce_mean(rows * tf.expand_dims(w, -1), axis=1)}[form]
    module, table = _on_device_embedding_module(reduce)
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"], [s.reason for s in result.sites]
    assert result.sites[0].gathered_shape == [None, 5, D]
    ids = RNG.integers(0, N, (3, 5)).astype(np.int32)
    w = RNG.uniform(0.5, 1.5, (3, 5)).astype(np.float32)
    want, got = _both(tmp_path, result, ids=ids, w=w)
    weights = w.astype(np.float64) if form.startswith("weighted") else np.ones((3, 5))
    reference = np.einsum("bl,bld->bd", weights, table[ids]) / (5 if form.endswith("mean") else 1)
    np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want["out"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["static", "regrouped"])
def test_flattened_gathers_reshaped_by_a_constant(tmp_path, form):
    # [-1, 4, D] undoes the flattening of [B, 4] ids; [-1, 2, D] regroups them into other bags.
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int64)])
        def f(ids):
            rows = tf.gather(module.t, tf.reshape(ids, [-1]))
            return {"out": tf.reduce_sum(tf.reshape(rows, [-1, 4 if form == "static" else 2, D]), axis=1)}
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    ids = RNG.integers(0, N, (3, 4)).astype(np.int64)
    want, got = _both(tmp_path, result, ids=ids)
    table = module.t.numpy().astype(np.float64)
    if form == "static":
        assert [s.status for s in result.sites] == ["fused"]
        np.testing.assert_allclose(got["out"], table[ids].sum(1), rtol=1e-6, atol=1e-6)
    else:
        assert [(s.status, s.reason) for s in result.sites] == [
            ("skipped", "gathered rows of flattened ids are reshaped to a shape not proven to be the ids' shape + [D]")]
        np.testing.assert_allclose(got["out"], table[ids.reshape(-1, 2)].sum(1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-6, atol=1e-6)


SPARSE = tf.SparseTensor([[0, 0], [0, 2], [2, 1], [3, 0], [3, 1], [3, 3]],
                         tf.constant([4, 7, 7, 0, 29, 11], tf.int64), [5, 4])


def _np_sparse_bags(table, combiner, default=None):
    """One bag per row of SPARSE (row 1 and 4 empty: zeros, or table[default])."""
    out = np.zeros((5, D)) if default is None else np.tile(table[default], (5, 1))
    indices, values = SPARSE.indices.numpy(), SPARSE.values.numpy()
    for b in set(indices[:, 0]):
        rows = table[values[indices[:, 0] == b]]
        out[b] = rows.sum(0) / {"sum": 1, "mean": len(rows), "sqrtn": np.sqrt(len(rows))}[combiner]
    return out


def test_a_sparse_lookup_on_the_table_tensor_is_fused(tmp_path):
    # embedding_lookup_sparse on a Tensor (not a variable) is SparseSegment*(table, ids, seg): no gather op.
    def signature(module):
        @tf.function(input_signature=[tf.SparseTensorSpec([None, None], tf.int64)])
        def f(sp):
            table = module.t.read_value()
            out = {c: tf.nn.embedding_lookup_sparse(table, sp, None, combiner=c) for c in ("sum", "mean", "sqrtn")}
            out["safe"] = tf.nn.safe_embedding_lookup_sparse(table, sp, None, combiner="mean")
            out["safe_default"] = tf.nn.safe_embedding_lookup_sparse(table, sp, None, combiner="sqrtn", default_id=3)
            return out
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    assert [s.status for s in result.sites] == ["fused"] * 5, [s.reason for s in result.sites]
    want, got = _both(tmp_path, result, sp=SPARSE.indices, sp_1=SPARSE.values, sp_2=SPARSE.dense_shape)
    table = module.t.numpy().astype(np.float64)
    for key, reference in (("sum", _np_sparse_bags(table, "sum")[:4]), ("mean", _np_sparse_bags(table, "mean")[:4]),
                           ("sqrtn", _np_sparse_bags(table, "sqrtn")[:4]), ("safe", _np_sparse_bags(table, "mean")),
                           ("safe_default", _np_sparse_bags(table, "sqrtn", default=3))):
        np.testing.assert_allclose(got[key], reference, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(want[key], reference, rtol=1e-5, atol=1e-6, err_msg=key)


def test_keras_embedding_on_a_sparse_tensor(tmp_path):
    # Keras 3 looks up each position as a bag of one id (an empty position gets row 0):
    # fused as that; keras-rs EmbedReduce pools those rows over the positions: one bag.
    import keras
    import keras_rs
    emb, bag = keras.layers.Embedding(N, D), keras_rs.layers.EmbedReduce(N, D, combiner="sum")
    emb.build((None, None))
    bag.build((None, None))
    table = RNG.standard_normal((N, D)).astype(np.float32)
    emb.embeddings.assign(table)
    bag.embeddings.assign(table)
    module = tf.Module()
    module.layers = [emb, bag]

    @tf.function(input_signature=[tf.SparseTensorSpec([None, None], tf.int64)])
    def f(sp):
        return {"rows": emb(sp), "bag": bag(sp)}
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    result = _export(tmp_path)
    assert [(s.pattern, s.status) for s in result.sites] == [
        ("pooled-sparse-lookup", "fused"), ("safe_embedding_lookup_sparse", "fused")], [s.reason for s in result.sites]
    want, got = _both(tmp_path, result, sp=SPARSE.indices, sp_1=SPARSE.values, sp_2=SPARSE.dense_shape)
    dense_ids = tf.sparse.to_dense(SPARSE).numpy()
    np.testing.assert_allclose(got["rows"], table[dense_ids], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["bag"], _np_sparse_bags(table.astype(np.float64), "sum"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want["rows"], got["rows"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(want["bag"], got["bag"], rtol=1e-5, atol=1e-6)


def _sparse_segment_ops(version_dir):
    from pkm_serve.export import read_saved_model
    graph = read_saved_model(str(version_dir)).meta_graphs[0].graph_def
    return [n.op for f in graph.library.function for n in f.node_def if n.op.startswith("SparseSegment")]


def test_keras_rs_embed_reduce_on_sparse_ids_is_one_bag(tmp_path):
    # EmbedReduce on a SparseTensor [B, L]: Keras' per-position lookup (an empty position is
    # row 0) times the densified weights (the ids' mask without weights), summed over L,
    # then divided by sum(w) (mean) or sqrt(sum(w^2)) (sqrtn). Dense weights also weigh the
    # row 0 of empty positions; sparse weights are 0 there. Dense ids beside them.
    import keras
    import keras_rs
    ids = keras.Input(shape=(4,), dtype="int64", sparse=True, name="ids")
    w_dense = keras.Input(shape=(4,), dtype="float32", name="w_dense")
    w_sparse = keras.Input(shape=(4,), dtype="float32", sparse=True, name="w_sparse")
    dense_ids = keras.Input(shape=(4,), dtype="int64", name="dense_ids")
    layers = {c: keras_rs.layers.EmbedReduce(N, D, combiner=c, name="bag_" + c) for c in ("sum", "mean", "sqrtn")}
    outputs = {}
    for c, layer in layers.items():
        outputs[c] = layer(ids)
        outputs[c + "_dense_w"] = layer(ids, w_dense)
        outputs[c + "_sparse_w"] = layer(ids, w_sparse)
        outputs[c + "_dense_ids"] = layer(dense_ids)
    model = keras.Model([ids, w_dense, w_sparse, dense_ids], outputs)
    for layer in layers.values():
        layer.embeddings.assign(RNG.standard_normal((N, D)).astype(np.float32))

    @tf.function(input_signature=[tf.SparseTensorSpec([None, 4], tf.int64), tf.TensorSpec([None, 4], tf.float32),
                                  tf.SparseTensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 4], tf.int64)])
    def serve(ids, w_dense, w_sparse, dense_ids):
        return model([ids, w_dense, w_sparse, dense_ids])
    tf.saved_model.save(model, str(tmp_path / "m"), signatures={"serving_default": serve})
    w_values = RNG.uniform(0.2, 2.0, 6).astype(np.float32)
    dense_w = RNG.uniform(0.2, 2.0, (5, 4)).astype(np.float32)
    feed = {"ids": SPARSE.indices.numpy(), "ids_1": SPARSE.values.numpy(), "ids_2": SPARSE.dense_shape.numpy(),
            "w_dense": dense_w, "w_sparse": SPARSE.indices.numpy(), "w_sparse_1": w_values,
            "w_sparse_2": SPARSE.dense_shape.numpy(), "dense_ids": tf.sparse.to_dense(SPARSE).numpy()}
    np.savez(tmp_path / "inputs.npz", **feed)
    result = _export(tmp_path, sample_inputs=str(tmp_path / "inputs.npz"))
    pooled = [s for s in result.sites if s.pattern == "pooled-sparse-lookup"]
    assert len(pooled) == 9, [(s.root, s.reason) for s in result.sites]
    # Every site fused (the model's own saved call functions hold dense traces of it too).
    assert all(s.status == "fused" for s in result.sites), [(s.root, s.reason) for s in result.sites]
    assert sorted(s.computes for s in pooled) == ["masked mean", "sqrtn", "sqrtn", "sqrtn", "sum", "sum", "sum",
                                                  "weighted mean", "weighted mean"]
    assert _sparse_segment_ops(tmp_path / "m") and not _sparse_segment_ops(result.dst)  # no [B, L, D] rows
    want, got = _both(tmp_path, result, **feed)
    present = tf.sparse.to_dense(tf.SparseTensor(SPARSE.indices, tf.ones(6), SPARSE.dense_shape)).numpy()
    dense_ids = tf.sparse.to_dense(SPARSE).numpy()
    weights = {"": present, "_dense_w": dense_w.astype(np.float64),
               "_sparse_w": tf.sparse.to_dense(tf.SparseTensor(SPARSE.indices, w_values, SPARSE.dense_shape)).numpy()}
    for c, layer in layers.items():
        rows = layer.embeddings.numpy().astype(np.float64)[dense_ids]  # [B, L, D]; empty positions: row 0
        for suffix, w in weights.items():
            w = w.astype(np.float64)
            bag = (rows * w[..., None]).sum(1)
            den = {"sum": np.ones(5), "mean": w.sum(1), "sqrtn": np.sqrt((w * w).sum(1))}[c]
            reference = np.divide(bag, den[:, None], out=np.zeros_like(bag), where=den[:, None] != 0)
            np.testing.assert_allclose(got[c + suffix], reference, rtol=1e-5, atol=1e-6, err_msg=c + suffix)
            np.testing.assert_allclose(want[c + suffix], reference, rtol=1e-5, atol=1e-6, err_msg=c + suffix)
        # The same ids dense: every position holds an id.
        reference = rows.sum(1) / {"sum": 1, "mean": 4, "sqrtn": 2}[c]
        np.testing.assert_allclose(got[c + "_dense_ids"], reference, rtol=1e-5, atol=1e-6, err_msg=c)
        np.testing.assert_allclose(want[c + "_dense_ids"], reference, rtol=1e-5, atol=1e-6, err_msg=c)


@pytest.mark.parametrize("default_id", [None, 3])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_lookup_of_several_ids_per_position(tmp_path, default_id, combiner):
    # safe_embedding_lookup_sparse on ids [B, L, K] (a bag at each position, combined by
    # `combiner`; an empty one is table[default_id] or zeros), weighted and summed over L.
    def signature(module):
        @tf.function(input_signature=[tf.SparseTensorSpec([None, 3, None], tf.int64), tf.TensorSpec([None, 3], tf.float32)])
        def f(sp, w):
            def rows():
                return tf.nn.safe_embedding_lookup_sparse(module.t, sp, None, combiner=combiner, default_id=default_id)
            return {"out": tf.reduce_sum(rows() * w[..., None], axis=1), "plain": tf.reduce_sum(rows(), axis=1)}
        return f
    module = _save(tmp_path / "m", signature)
    # bag 0: positions of 2, 0 (empty) and 3 ids; bag 1: nothing; bag 2: one id at position 1.
    sp = tf.SparseTensor([[0, 0, 0], [0, 0, 1], [0, 2, 0], [0, 2, 1], [0, 2, 2], [2, 1, 0]],
                         tf.constant([4, 9, 7, 7, 29, 11], tf.int64), [3, 3, 3])
    w = RNG.uniform(0.2, 2.0, (3, 3)).astype(np.float32)
    feed = {"sp": sp.indices.numpy(), "sp_1": sp.values.numpy(), "sp_2": sp.dense_shape.numpy(), "w": w}
    np.savez(tmp_path / "inputs.npz", **feed)
    result = _export(tmp_path, sample_inputs=str(tmp_path / "inputs.npz"))
    assert [(s.pattern, s.status, s.reason) for s in result.sites] == [("pooled-sparse-lookup", "fused", "")] * 2
    assert not _sparse_segment_ops(result.dst)
    want, got = _both(tmp_path, result, **feed)
    table = module.t.numpy().astype(np.float64)
    rows = np.zeros((3, 3, D)) if default_id is None else np.tile(table[default_id], (3, 3, 1))
    for b, l in {(int(i[0]), int(i[1])) for i in sp.indices.numpy()}:
        ids = [v for i, v in zip(sp.indices.numpy(), sp.values.numpy()) if (i[0], i[1]) == (b, l)]
        rows[b, l] = table[ids].sum(0) / {"sum": 1, "mean": len(ids), "sqrtn": np.sqrt(len(ids))}[combiner]
    for key, reference in (("out", (rows * w[..., None]).sum(1)), ("plain", rows.sum(1))):
        np.testing.assert_allclose(got[key], reference, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(want[key], reference, rtol=1e-5, atol=1e-6, err_msg=key)


def test_pooled_lookup_weighted_per_feature_is_reported(tmp_path):
    # A multiplier [B, L, D] weighs each feature, not each position: no bag; reported, and
    # the per-position lookup is fused on its own.
    def signature(module):
        @tf.function(input_signature=[tf.SparseTensorSpec([None, 4], tf.int64), tf.TensorSpec([None, 4, D], tf.float32)])
        def f(sp, w):
            rows = tf.nn.safe_embedding_lookup_sparse(module.t, tf.sparse.expand_dims(sp, -1), None, default_id=0)
            return {"out": tf.reduce_sum(rows * w, axis=1)}
        return f
    module = _save(tmp_path / "m", signature)
    w = RNG.uniform(0.2, 2.0, (5, 4, D)).astype(np.float32)
    feed = {"sp": SPARSE.indices.numpy(), "sp_1": SPARSE.values.numpy(), "sp_2": SPARSE.dense_shape.numpy(), "w": w}
    np.savez(tmp_path / "inputs.npz", **feed)
    result = _export(tmp_path, sample_inputs=str(tmp_path / "inputs.npz"))
    assert [(s.pattern, s.status, s.reason) for s in result.sites] == [
        ("pooled-sparse-lookup", "skipped", "multiplier is not per-index (broadcast on the last axis of the rows)"),
        ("safe_embedding_lookup_sparse", "fused", "")]
    want, got = _both(tmp_path, result, **feed)
    rows = module.t.numpy().astype(np.float64)[tf.sparse.to_dense(SPARSE).numpy()]
    np.testing.assert_allclose(got["out"], (rows * w).sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want["out"], got["out"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_ragged_unsorted_segment_mean_and_sqrt_n_are_labelled_as_such(tmp_path, combiner):
    segment_op = tf.math.unsorted_segment_mean if combiner == "mean" else tf.math.unsorted_segment_sqrt_n
    module = _save(tmp_path / "m", _ragged_module(
        lambda rows, rt: segment_op(rows, rt.value_rowids(), rt.nrows())))
    result = _export(tmp_path)
    assert [(s.status, s.computes) for s in result.sites] == [("fused", combiner)]
    want, got = _both(tmp_path, result, rt=BAGS.values, rt_1=BAGS.row_splits)
    table = module.t.numpy().astype(np.float64)
    scale = (lambda n: n) if combiner == "mean" else np.sqrt
    reference = np.stack([table[list(bag)].sum(0) / scale(len(bag)) if len(bag) else np.zeros(D)
                          for bag in BAGS.to_list()])
    np.testing.assert_allclose(got["out"], reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(want["out"], reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["sum", "scaled_sum"])
def test_a_max_norm_lookup_then_a_sum_is_reported(tmp_path, form):
    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32)])
        def f(ids):
            rows = tf.nn.embedding_lookup(module.t, ids, max_norm=1.0)
            return {"out": tf.reduce_sum(rows if form == "sum" else rows * 2.0, axis=1)}
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    assert [(s.status, s.reason) for s in result.sites] == [(
        "skipped", "each gathered row is clipped to max_norm (embedding_lookup max_norm=, i.e. clip_by_norm) "
        "before the reduction: PkmEmbeddingBag has no row-norm clip, so the site stays composite")]
    ids = RNG.integers(0, N, (4, 3)).astype(np.int32)
    want, got = _both(tmp_path, result, ids=ids)
    rows = module.t.numpy().astype(np.float64)[ids]
    rows *= 1.0 / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1.0)
    np.testing.assert_allclose(got["out"], rows.sum(1) * (1 if form == "sum" else 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["slice", "expand_dims", "reshape", "batch_of_two_axes"])
def test_a_matmul_weighted_sum_is_fused(tmp_path, form):
    spec = [None, 2, 3] if form == "batch_of_two_axes" else [None, 3]
    expand = {"slice": lambda w: w[:, None, :], "expand_dims": lambda w: tf.expand_dims(w, 1),
              "reshape": lambda w: tf.reshape(w, [-1, 1, 3]),
              "batch_of_two_axes": lambda w: w[..., None, :]}[form]

    def signature(module):
        @tf.function(input_signature=[tf.TensorSpec(spec, tf.int64), tf.TensorSpec(spec, tf.float32)])
        def f(ids, w):
            return {"out": tf.matmul(expand(w), tf.gather(module.t, ids))}
        return f
    module = _save(tmp_path / "m", signature)
    result = _export(tmp_path)
    assert [(s.status, s.pattern, s.weighted) for s in result.sites] == [("fused", "matmul", True)]
    ids = RNG.integers(0, N, [4] + spec[1:]).astype(np.int64)
    w = RNG.uniform(0.5, 1.5, ids.shape).astype(np.float32)
    want, got = _both(tmp_path, result, ids=ids, w=w)
    table = module.t.numpy().astype(np.float64)
    reference = np.einsum("...k,...kd->...d", w.astype(np.float64), table[ids])[..., None, :]
    assert got["out"].shape == reference.shape
    np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want["out"], reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["constant", "variable_mean", "unit_axes", "on_device_scale"])
def test_a_scalar_multiplier_is_fused_as_broadcast_weights(tmp_path, form):
    if form == "on_device_scale":
        module, table = _on_device_embedding_module(lambda rows, w: tf.reduce_sum(rows, axis=1), scale_factor=0.5)
        tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
        scale, divisor = 0.5, 1
    else:
        def signature(module):
            @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32), tf.TensorSpec([None, 5], tf.float32)])
            def f(ids, w):
                rows = tf.gather(module.t, ids)
                if form == "constant":
                    return {"out": tf.reduce_sum(rows * 3.0, axis=1)}
                if form == "unit_axes":
                    return {"out": tf.reduce_sum(tf.constant([[[3.0]]]) * rows, axis=1)}
                return {"out": tf.reduce_mean(rows * module.scale, axis=1)}
            return f
        module = _save(tmp_path / "m", signature, extra={"scale": np.float32(0.25)})
        table = module.t.numpy().astype(np.float64)
        scale, divisor = (0.25, 5) if form == "variable_mean" else (3.0, 1)
    result = _export(tmp_path)
    assert [(s.status, s.weighted) for s in result.sites] == [("fused", True)], [s.reason for s in result.sites]
    ids = RNG.integers(0, N, (4, 5)).astype(np.int32)
    w = np.ones((4, 5), np.float32)
    want, got = _both(tmp_path, result, ids=ids, w=w)
    reference = table[ids].sum(1) * scale / divisor
    np.testing.assert_allclose(got["out"], reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want["out"], reference, rtol=1e-5, atol=1e-6)
