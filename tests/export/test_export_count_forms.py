"""A bag written as counts of the ids times the table (round 31): Keras
CategoryEncoding(output_mode="count") + Dense(use_bias=False), tf.math.bincount
or a sum of tf.one_hot, then a matmul. Fused, equal to numpy in the SavedModel
and the .tflite, ids past the table counted nowhere as in the original; a
multi-hot encoding (distinct ids) is reported, never fused as a sum."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import export_saved_model

ops.load_library()

N, D, K = 30, 4, 5
RNG = np.random.default_rng(31)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)


def _keras_model(output_mode, weighted=False):
    ids = keras.Input((K,), dtype="int64", name="ids")
    w = keras.Input((K,), dtype="float32", name="w")
    counts = keras.layers.CategoryEncoding(N, output_mode=output_mode)(ids, count_weights=w if weighted else None)
    dense = keras.layers.Dense(D, use_bias=False)
    out = dense(counts)
    dense.set_weights([TABLE])
    return keras.Model([ids, w] if weighted else ids, out)


def _module(counts_of):
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(lambda ids: {"out": tf.matmul(counts_of(ids), module.t)},
                           input_signature=[tf.TensorSpec([None, K], tf.int64, name="ids")])
    return module


def _save(form, path):
    if form.startswith("keras"):
        _keras_model("multi_hot" if form == "keras_multi_hot" else "count",
                     weighted=form == "keras_count_weights").export(str(path), verbose=False)
        return
    counts_of = {
        "bincount": lambda ids: tf.math.bincount(tf.cast(ids, tf.int32), minlength=N, maxlength=N, axis=-1,
                                                 dtype=tf.float32),
        "one_hot": lambda ids: tf.reduce_sum(tf.one_hot(ids, N), axis=1),
        "one_hot_int_counts": lambda ids: tf.cast(tf.reduce_sum(tf.one_hot(ids, N, dtype=tf.int32), 1), tf.float32),
    }[form]
    module = _module(counts_of)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.f})


def _inputs(form):
    """Duplicates, ids past the table (30, 45: counted nowhere) and, where the
    encoding counts them nowhere too (one_hot), negative ids."""
    ids = RNG.integers(0, N, (6, K))
    ids[0] = 7
    ids[1, :2] = [N, N + 15]
    if form.startswith("one_hot"):
        ids[2, 1:3] = [-1, -4]
    inputs = {"ids": ids.astype(np.int64)}
    if form == "keras_count_weights":
        inputs["w"] = RNG.uniform(-1.0, 2.0, (6, K)).astype(np.float32)
    return inputs


def _numpy_bag(inputs, distinct=False):
    table = TABLE.astype(np.float64)
    out = np.zeros((len(inputs["ids"]), D))
    for b, bag in enumerate(inputs["ids"]):
        weights = inputs["w"][b] if "w" in inputs else np.ones(K)
        seen = set()
        for i, w in zip(bag, weights):
            if 0 <= i < N and not (distinct and i in seen):
                out[b] += w * table[i]
                seen.add(i)
    return out


def _serve(path, inputs):
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    return list(signature(**{k: tf.constant(v) for k, v in inputs.items()}).values())[0].numpy()


@pytest.mark.parametrize("form", ["keras_count", "keras_count_weights", "bincount", "one_hot",
                                  "one_hot_int_counts"])
def test_id_counts_times_a_table_are_fused(tmp_path, form):
    _save(form, tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), tflite=str(tmp_path / "m.tflite"),
                                quiet=True)
    assert [(s.status, s.pattern, s.weighted) for s in result.sites] == [
        ("fused", "counts-matmul", form == "keras_count_weights")], [s.reason for s in result.sites]
    assert result.tflite["custom_ops"] == ["PkmEmbeddingBag"]
    inputs = _inputs(form)
    reference = _numpy_bag(inputs)
    np.testing.assert_allclose(_serve(tmp_path / "m", inputs), reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_serve(result.dst, inputs), reference, rtol=1e-5, atol=1e-5)
    runner = tflite.make_interpreter(str(tmp_path / "m.tflite")).get_signature_runner("serving_default")
    lite = list(runner(**inputs).values())[0]
    np.testing.assert_allclose(lite, reference, rtol=1e-5, atol=1e-5)


def test_bincount_refuses_a_negative_id_fused_as_the_original_does(tmp_path):
    _save("keras_count", tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [s.status for s in result.sites] == ["fused"]
    inputs = {"ids": np.array([[1, -1, 2, 2, 3]], np.int64)}
    for path in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
            _serve(path, inputs)


def test_a_multi_hot_encoding_is_reported_not_summed(tmp_path):
    """multi_hot counts each distinct id once: a sum over the ids would count
    the duplicates of the first bag five times."""
    _save("keras_multi_hot", tmp_path / "m")
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("skipped", "counts-matmul")]
    assert "multi-hot" in result.sites[0].reason and "distinct id" in result.sites[0].reason
    inputs = _inputs("keras_multi_hot")
    np.testing.assert_allclose(_serve(result.dst, inputs), _numpy_bag(inputs, distinct=True), rtol=1e-5, atol=1e-5)


def test_counts_times_a_computed_table_check_the_tables_rows(tmp_path):
    """A table whose rows are unknown at export (computed: the variable and a
    [None, D] input's rows): N comes from the counts, and the original matmul
    refuses a table of other than N rows. The fused site took N from the counts
    and never checked: with 2 extra rows it returned a bag."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(
        lambda ids, extra: {"out": tf.matmul(tf.reduce_sum(tf.one_hot(ids, N), 1), tf.concat([module.t, extra], 0))},
        input_signature=[tf.TensorSpec([None, K], tf.int64, "ids"), tf.TensorSpec([None, D], tf.float32, "extra")])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    ids = RNG.integers(0, N, (3, K)).astype(np.int64)
    np.savez(tmp_path / "samples.npz", ids=ids, extra=np.zeros((0, D), np.float32))
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                sample_inputs=str(tmp_path / "samples.npz"))
    assert [(s.status, s.pattern) for s in result.sites] == [("fused", "counts-matmul")]
    original = tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"]
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    good = {"ids": tf.constant(ids), "extra": tf.zeros((0, D))}
    np.testing.assert_allclose(fused(**good)["out"].numpy(), original(**good)["out"].numpy(), rtol=1e-5, atol=1e-6)
    bad = {"ids": tf.constant(ids), "extra": tf.ones((2, D))}
    with pytest.raises(tf.errors.InvalidArgumentError):
        original(**bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"not the {N} the id counts have"):
        fused(**bad)


def _ragged_counts_module():
    """tf.math.bincount of ragged ids (RaggedBincount; TF infers no shape, so
    tf.matmul is a BatchMatMulV2), unweighted and weighted."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    ragged = [tf.RaggedTensorSpec([None, None], tf.int64), tf.RaggedTensorSpec([None, None], tf.float32)]

    def serve(ids, w):
        counts = tf.cast(tf.math.bincount(ids, minlength=N, maxlength=N, axis=-1), tf.float32)
        weighted = tf.math.bincount(ids, weights=w, minlength=N, maxlength=N, axis=-1)
        return {"count": tf.matmul(counts, module.t), "weighted": tf.matmul(weighted, module.t)}
    module.f = tf.function(serve, input_signature=ragged)
    return module


def test_counts_of_ragged_ids_are_fused_as_ragged_bags(tmp_path):
    """Before, a RaggedBincount's counts times the table were no site at all:
    the export copied the model and the .tflite was refused for RaggedBincount."""
    module = _ragged_counts_module()
    result = _export_with_both_sites_fused(module, tmp_path)
    splits = np.array([0, 3, 3, 7], np.int64)  # an empty bag; ids past the table (30, 45) count nowhere
    values = np.array([7, 7, 2, N, 1, N + 15, 29], np.int64)
    w = RNG.uniform(-1.0, 2.0, len(values)).astype(np.float32)
    rows = np.repeat(np.arange(len(splits) - 1), np.diff(splits))
    want = {"count": np.zeros((3, D)), "weighted": np.zeros((3, D))}
    for row, i, weight in zip(rows, values, w):
        if i < N:
            want["count"][row] += TABLE[i]
            want["weighted"][row] += weight * TABLE[i].astype(np.float64)
    feeds = {"ids": values, "ids_1": splits, "w": w, "w_1": splits}
    _assert_every_runtime_gives(want, feeds, tmp_path / "m", result.dst, tmp_path / "m.tflite")
    negative = {**feeds, "ids": np.where(values == 1, -1, values)}
    for path in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
            tf.saved_model.load(str(path)).signatures["serving_default"](
                **{k: tf.constant(v) for k, v in negative.items()})


def test_keras_text_vectorization_counts_times_dense_are_fused(tmp_path):
    """Keras' bag-of-words model: TextVectorization(output_mode="count") then
    Dense(use_bias=False), exported with model.export (raw strings in)."""
    words = ["the", "cat", "sat", "on", "mat", "dog"]
    text = keras.Input((1,), dtype="string", name="text")
    dense = keras.layers.Dense(D, use_bias=False)
    model = keras.Model(text, dense(keras.layers.TextVectorization(vocabulary=words, output_mode="count")(text)))
    model.export(str(tmp_path / "m"), verbose=False)
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("fused", "counts-matmul")], \
        [s.reason for s in result.sites]
    sentences = ["the cat sat on the mat", "", "zebra dog dog"]
    vocabulary = ["[UNK]"] + words  # index 0 is the OOV token in count mode
    table = dense.get_weights()[0].astype(np.float64)
    want = np.array([sum((table[vocabulary.index(t) if t in vocabulary else 0] for t in s.split()),
                         np.zeros(D)) for s in sentences])
    feed = tf.constant([[s] for s in sentences])
    for path in (tmp_path / "m", result.dst):
        got = list(tf.saved_model.load(str(path)).signatures["serving_default"](text=feed).values())[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_feature_column_indicator_times_dense_is_fused(tmp_path):
    """tf.feature_column's indicator_column (the wide part of a wide-and-deep model) sums a one-hot of
    the densified sparse ids (-1 padding), reshapes the counts to [batch, N] and passes them through
    DenseFeatures' Identity into Dense(use_bias=False). Before, the Reshape and Identity hid the
    counts from the matmul: no site, the [B, K, N] one-hot built on every request."""
    import tf_keras
    fc = tf.feature_column
    column = fc.indicator_column(fc.categorical_column_with_vocabulary_list("word", ["a", "b", "c", "d"]))
    features, dense = tf_keras.layers.DenseFeatures([column]), tf_keras.layers.Dense(D, use_bias=False)
    module = tf.Module()
    module.features, module.dense = features, dense
    module.f = tf.function(lambda word: {"out": dense(features({"word": word}))},
                           input_signature=[tf.SparseTensorSpec([None, None], tf.string)])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), tflite=str(tmp_path / "m.tflite"),
                                quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("fused", "counts-matmul")], \
        [s.reason for s in result.sites]
    words = [[b"b", b"b", b"d"], [], [b"zebra", b"a"]]  # an empty row; an unknown word counts nowhere
    table = dense.get_weights()[0].astype(np.float64)
    vocabulary = [b"a", b"b", b"c", b"d"]
    want = np.array([sum((table[vocabulary.index(w)] for w in row if w in vocabulary), np.zeros(D))
                     for row in words])
    feed = tf.ragged.constant(words, dtype=tf.string).to_sparse()
    for path in (tmp_path / "m", result.dst):
        got = tf.saved_model.load(str(path)).signatures["serving_default"](
            word=feed.indices, word_1=feed.values, word_2=feed.dense_shape)["out"]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_tf_idf_counts_times_dense_are_reported(tmp_path):
    """TextVectorization(output_mode="tf_idf") + Dense: the counts times the idf weights, then the
    matmul. Before, the export listed no site at all; now it says why it stays composite."""
    words = ["the", "cat", "sat"]
    text = keras.Input((1,), dtype="string", name="text")
    vectorize = keras.layers.TextVectorization(vocabulary=words, output_mode="tf_idf", idf_weights=[0.5, 1.0, 2.0])
    keras.Model(text, keras.layers.Dense(D, use_bias=False)(vectorize(text))).export(str(tmp_path / "m"),
                                                                                    verbose=False)
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("skipped", "counts-matmul")]
    assert "tf_idf" in result.sites[0].reason and "multiplied" in result.sites[0].reason


def test_counts_of_sparse_ids_are_fused_as_ragged_bags(tmp_path):
    """tf.math.bincount of a SparseTensor (SparseBincount) times the table: before, no site and the
    .tflite refused for SparseBincount. Unlike the dense and ragged bincounts, SparseBincount counts a
    negative id nowhere (no error): the fused bag reads it as padding too."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    def serve(ids, w):
        counts = tf.cast(tf.math.bincount(ids, minlength=N, maxlength=N, axis=-1), tf.float32)
        weighted = tf.math.bincount(ids, weights=w, minlength=N, maxlength=N, axis=-1)
        return {"count": tf.matmul(counts, module.t), "weighted": tf.matmul(weighted, module.t)}
    module.f = tf.function(serve, input_signature=[tf.SparseTensorSpec([None, None], tf.int64),
                                                   tf.SparseTensorSpec([None, None], tf.float32)])
    result = _export_with_both_sites_fused(module, tmp_path)
    indices = np.array([[0, 0], [0, 1], [0, 2], [2, 0], [2, 1], [2, 3]], np.int64)  # rows 1 and 3 empty
    values = np.array([7, 7, N + 2, 1, -3, 29], np.int64)
    w = np.array([0.5, 2.0, np.nan, -1.0, np.inf, 1.5], np.float32)  # on ids counted nowhere: no NaN
    want = {"count": np.zeros((4, D)), "weighted": np.zeros((4, D))}
    for (row, _), i, weight in zip(indices, values, w):
        if 0 <= i < N:
            want["count"][row] += TABLE[i]
            want["weighted"][row] += weight * TABLE[i].astype(np.float64)
    shape = np.array([4, 4], np.int64)
    feeds = {"ids": indices, "ids_1": values, "ids_2": shape, "w": indices, "w_1": w, "w_2": shape}
    _assert_every_runtime_gives(want, feeds, tmp_path / "m", result.dst, tmp_path / "m.tflite")
    # Out of canonical order, as SparseBincount takes them: the fused site puts the entries (ids and
    # weights with them) in row order. Before, the SavedModel refused them and the .tflite, which drops
    # Asserts, summed the wrong bags.
    order = np.array([3, 0, 5, 1, 4, 2])
    unsorted = {**feeds, "ids": indices[order], "ids_1": values[order], "w": indices[order], "w_1": w[order]}
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    got = fused(**{k: tf.constant(v) for k, v in unsorted.items()})
    lite = tflite.make_interpreter(str(tmp_path / "m.tflite")).get_signature_runner("serving_default")(**unsorted)
    for key in want:
        np.testing.assert_allclose(got[key].numpy(), want[key], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lite[key], want[key], rtol=1e-5, atol=1e-5)
    # A negative row index, which SparseBincount refuses as out of bounds: the fused Assert names this
    # site (the message named embedding_lookup_sparse for every sparse site)
    bad = indices.copy()
    bad[0, 0] = -1
    negative_row = {**feeds, "ids": bad, "w": bad}
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"fused counts-matmul in MatMul\S*\): the sparse ids"
                                                             r"\S* row indices must be >= 0 and sorted"):
        fused(**{k: tf.constant(v) for k, v in negative_row.items()})
    # A column past dense_shape[1], which SparseBincount refuses too (the fused op reads no column)
    bad = indices.copy()
    bad[2, 1] = 4
    for path in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError, match="out of bounds"):
            tf.saved_model.load(str(path)).signatures["serving_default"](
                **{k: tf.constant(v) for k, v in {**feeds, "ids": bad, "w": bad}.items()})


def test_counts_times_a_batch_matmul_v3_are_fused(tmp_path):
    """A BatchMatMulV3 (of operands and output alike here; tf.matmul writes one where output_type differs)
    has Ta / Tb / Tout, no T: the counts site read its table's dtype as none ("table dtype unknown")."""
    from tensorflow.python.ops import gen_math_ops
    module = tf.Module()
    module.t = tf.Variable(TABLE)
    module.f = tf.function(lambda ids: {"out": gen_math_ops.batch_mat_mul_v3(
        tf.math.bincount(ids, minlength=N, maxlength=N, axis=-1, dtype=tf.float32), module.t, Tout=tf.float32)},
        input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True)
    assert [(s.status, s.pattern) for s in result.sites] == [("fused", "counts-matmul")], \
        [s.reason for s in result.sites]
    feeds = {"ids": tf.constant([7, 7, 2, N, 29], tf.int64), "ids_1": tf.constant([0, 3, 3, 5], tf.int64)}
    want = np.stack([2 * TABLE[7] + TABLE[2], np.zeros(D), TABLE[29]])
    got = tf.saved_model.load(result.dst).signatures["serving_default"](**feeds)["out"]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_counts_reshaped_to_a_batch_of_n_rows_are_not_passed_through(tmp_path):
    """A reshape of [B, N] counts to [shape(counts)[1], shape(counts)[1]] infers [N, N], whose last axis
    is the counts' N, yet it refuses every batch but N. It was taken for a reshape that changes nothing:
    the fused model answered a batch of 3 that the original refuses."""
    module = tf.Module()
    module.t = tf.Variable(TABLE)

    def serve(ids):
        counts = tf.reduce_sum(tf.one_hot(ids, N), 1)
        width = tf.shape(counts)[1]
        return {"out": tf.matmul(tf.reshape(counts, tf.stack([width, width])), module.t)}
    module.f = tf.function(serve, input_signature=[tf.TensorSpec([None, K], tf.int64, name="ids")])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    np.savez(tmp_path / "samples.npz", ids=RNG.integers(0, N, (N, K)))
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), quiet=True,
                                sample_inputs=str(tmp_path / "samples.npz"))
    assert "fused" not in [s.status for s in result.sites]
    for path in (tmp_path / "m", result.dst):
        with pytest.raises(tf.errors.InvalidArgumentError):
            _serve(path, {"ids": RNG.integers(0, N, (3, K))})


def _assert_every_runtime_gives(want, feeds, original, fused, fused_tflite):
    """The original and fused SavedModels' and the fused .tflite's outputs are `want` for `feeds`."""
    for path in (original, fused):
        got = tf.saved_model.load(str(path)).signatures["serving_default"](**{k: tf.constant(v) for k, v in feeds.items()})
        for key in want:
            np.testing.assert_allclose(got[key].numpy(), want[key], rtol=1e-5, atol=1e-5)
    lite = tflite.make_interpreter(str(fused_tflite)).get_signature_runner("serving_default")(**feeds)
    for key in want:
        np.testing.assert_allclose(lite[key], want[key], rtol=1e-5, atol=1e-5)


def _export_with_both_sites_fused(module, tmp_path):
    """`module.f` saved and exported with --tflite: its unweighted and weighted counts sites
    fused as ragged bags."""
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": module.f})
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "out"), tflite=str(tmp_path / "m.tflite"),
                                quiet=True)
    assert sorted((s.status, s.pattern, s.weighted) for s in result.sites) == [
        ("fused", "counts-matmul", False), ("fused", "counts-matmul", True)], [s.reason for s in result.sites]
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    return result
