"""Models written with the libraries people deploy, saved as those libraries
document for TF Serving, for tests/export/test_export_library_models.py.

Run as a script (`python library_models.py OUT`) in a process with
TF_USE_LEGACY_KERAS=1, so that tensorflow-recommenders gets tf_keras as
`tf.keras`; Keras 3 models (keras-rs, the Keras 3 text classifier) import
`keras` directly. Each builder saves OUT/<name>/ and returns its metadata:
the signatures, how many pooled sites are reachable from each, whether the
.tflite can convert (and if not, which op the converter is expected to
name), and real-looking inputs (written to OUT/<name>.inputs.npz as
SIGNATURE/NAME) with numpy float64 references (tests/reference.py) where the
model's mathematics is simple enough to restate.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far", "away", "home"]
RNG = np.random.default_rng(7)


def _example(features):
    import tensorflow as tf
    feature = {}
    for key, values in features.items():
        if isinstance(values[0], bytes):
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        elif isinstance(values[0], float):
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        else:
            feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def fc_examples(path):
    """tf_keras DenseFeatures over feature columns, serving parsed tf.Examples:
    hashed (mean), vocabulary (sqrtn) and weighted identity (sum) columns."""
    import tensorflow as tf
    import tf_keras
    fc = tf.feature_column
    cols = [
        fc.embedding_column(fc.categorical_column_with_hash_bucket("query", 40), 8,
                            combiner="mean"),
        fc.embedding_column(fc.categorical_column_with_vocabulary_list(
            "country", ["us", "fr", "de", "jp"]), 4, combiner="sqrtn"),
        fc.embedding_column(fc.weighted_categorical_column(
            fc.categorical_column_with_identity("item", 30), "item_weight"), 4,
            combiner="sum"),
        fc.numeric_column("price", shape=(1,)),
    ]
    spec = fc.make_parse_example_spec(cols)
    model = tf_keras.Sequential([tf_keras.layers.DenseFeatures(cols),
                                 tf_keras.layers.Dense(3)])
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
    def serve(examples):
        return {"scores": model(tf.io.parse_example(examples, spec))}
    module.serve = serve
    real = np.array([
        _example({"query": [b"red", b"shoes"], "country": [b"fr"], "item": [3, 17],
                  "item_weight": [1.0, 0.5], "price": [9.5]}),
        _example({"query": [b"tv"], "country": [b"jp", b"us"], "item": [29],
                  "item_weight": [2.0], "price": [300.0]}),
        _example({"price": [1.0]}),  # every bag empty
    ], dtype=object)
    serve(real)
    tf.saved_model.save(module, path, signatures={"serving_default": serve})
    return {"pooled": {"serving_default": 3}, "tflite": "refused",
            "refused_op": "ParseExampleV2",
            "inputs": {"serving_default/examples": real}}


def fc_sparse_ids(path):
    """The same kind of columns on already-parsed SparseTensor ids (what a
    device gets): identity columns, every combiner, one weighted."""
    import tensorflow as tf
    import tf_keras
    fc = tf.feature_column
    ids = fc.categorical_column_with_identity("ids", 30)
    # One layer per combiner: a DenseFeatures takes each base feature once.
    layers = [tf_keras.layers.DenseFeatures([fc.embedding_column(ids, 4, combiner=c)])
              for c in ("sum", "mean", "sqrtn")]
    layers.append(tf_keras.layers.DenseFeatures([fc.embedding_column(
        fc.weighted_categorical_column(fc.categorical_column_with_identity("tags", 20),
                                       "tag_weight"), 4, combiner="mean")]))
    module = tf.Module()
    module.layers = layers
    sp_i = tf.SparseTensorSpec([None, None], tf.int64)
    sp_w = tf.SparseTensorSpec([None, None], tf.float32)

    @tf.function(input_signature=[sp_i, sp_i, sp_w])
    def serve(ids, tags, tag_weight):
        features = {"ids": ids, "tags": tags, "tag_weight": tag_weight}
        return {"features": tf.concat([layer(features) for layer in layers], axis=1)}
    module.serve = serve
    indices = np.array([[0, 0], [0, 1], [1, 0], [3, 0], [3, 1], [3, 2]], np.int64)
    shape = np.array([4, 3], np.int64)
    real = {"serving_default/ids": indices, "serving_default/ids_1":
            np.array([1, 5, 29, 0, 7, 7], np.int64), "serving_default/ids_2": shape,
            "serving_default/tags": indices,
            "serving_default/tags_1": np.array([2, 3, 19, 4, 4, 0], np.int64),
            "serving_default/tags_2": shape,
            "serving_default/tag_weight": indices,
            "serving_default/tag_weight_1": np.array([1, .5, 2, .25, 1, 3], np.float32),
            "serving_default/tag_weight_2": shape}
    tf.saved_model.save(module, path, signatures={"serving_default": serve})
    return {"pooled": {"serving_default": 4}, "tflite": "ok", "inputs": real}


def _masked_ids(batch, k, n):
    ids = RNG.integers(1, n, (batch, k)).astype(np.int32)
    for b in range(batch):
        ids[b, RNG.integers(1, k + 1):] = 0
    return ids


def tf_keras_masked_mean(path):
    """tf_keras Embedding(mask_zero=True) -> GlobalAveragePooling1D -> Dense,
    saved with tf.saved_model.save (its mask is cast with the rows' dtype)."""
    import tensorflow as tf
    import tf_keras
    emb = tf_keras.layers.Embedding(50, 8, mask_zero=True)
    head = tf_keras.layers.Dense(2)
    model = tf_keras.Sequential([tf_keras.Input((6,), dtype="int32"), emb,
                                 tf_keras.layers.GlobalAveragePooling1D(), head])
    tf.saved_model.save(model, path)
    ids = _masked_ids(5, 6, 50)
    table = emb.embeddings.numpy()
    kernel, bias = (v.numpy() for v in head.weights)
    keep = (ids != 0).astype(np.float64)
    mean = reference.embedding_bag(table, ids, keep, "mean")
    sig = _only_signature(path)
    name = _only_input(path, sig)
    return {"pooled": {sig: 1}, "tflite": "ok", "inputs": {name: ids},
            "reference": {sig: mean @ kernel + bias}, "computes": ["masked mean"]}


def keras3_text_classifier(path):
    """Keras 3: TextVectorization -> Embedding(mask_zero=True) ->
    GlobalAveragePooling1D -> Dense, exported with model.export (raw strings in)."""
    import keras
    vectorize = keras.layers.TextVectorization(vocabulary=WORDS, output_sequence_length=8)
    emb = keras.layers.Embedding(len(WORDS) + 2, 8, mask_zero=True)
    text = keras.Input(shape=(1,), dtype="string", name="text")
    x = keras.layers.GlobalAveragePooling1D()(emb(vectorize(text)))
    model = keras.Model(text, keras.layers.Dense(2)(x))
    model.export(path, format="tf_saved_model", verbose=False)
    real = np.array([["the cat sat on the mat"], ["dog ran far away home"],
                     ["unknown words only"]], dtype=object)
    return {"pooled": {"serving_default": 1}, "tflite": "refused",
            "refused_op": "StringSplit", "inputs": {"text": real},
            "computes": ["masked mean"]}


def tfrs_ranking(path):
    """tensorflow-recommenders ranking model (tf_keras): user id
    StringLookup+Embedding (no bag), title TextVectorization+Embedding(mask_zero)
    +GlobalAveragePooling1D (a masked mean), Dense rating head."""
    import tensorflow as tf
    import tensorflow_recommenders as tfrs

    users = ["u1", "u2", "u3"]

    class Ranking(tfrs.models.Model):
        def __init__(self):
            super().__init__()
            self.user = tf.keras.Sequential([tf.keras.layers.StringLookup(vocabulary=users),
                                             tf.keras.layers.Embedding(len(users) + 1, 4)])
            self.title_vec = tf.keras.layers.TextVectorization(
                vocabulary=WORDS, output_sequence_length=6)
            self.title = tf.keras.Sequential([
                self.title_vec, tf.keras.layers.Embedding(len(WORDS) + 2, 4, mask_zero=True),
                tf.keras.layers.GlobalAveragePooling1D()])
            self.rating = tf.keras.layers.Dense(1)
            self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError())

        def call(self, features):
            return self.rating(tf.concat([self.user(features["user_id"]),
                                          self.title(features["title"])], axis=1))

        def compute_loss(self, features, training=False):
            return self.task(labels=features["rating"], predictions=self(features))

    model = Ranking()
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None], tf.string, name="title")])
    def serve(user_id, title):
        return {"rating": model({"user_id": user_id, "title": title})}
    module.serve = serve
    real = {"serving_default/user_id": np.array([b"u1", b"u3", b"nobody"], dtype=object),
            "serving_default/title": np.array([b"the cat sat", b"home", b"zzz"], dtype=object)}
    serve(real["serving_default/user_id"], real["serving_default/title"])
    tf.saved_model.save(module, path, signatures={"serving_default": serve})
    return {"pooled": {"serving_default": 1}, "tflite": "refused",
            "refused_op": "StringSplit", "inputs": real, "computes": ["masked mean"]}


def tfrs_tpu_embedding(path, weighted=True):
    """tfrs.layers.embedding.TPUEmbedding on CPU (the serving path of
    tf-models-official's DLRM ranking model): ragged ids (and ragged
    weights) -> embedding_lookup -> reduce_sum(axis=1) [-> div_no_nan]."""
    import tensorflow as tf
    import tensorflow_recommenders as tfrs
    emb = tf.tpu.experimental.embedding
    tables = {c: emb.TableConfig(vocabulary_size=30, dim=4, combiner=c, name="t_" + c)
              for c in ("sum", "mean", "sqrtn")}
    features = {c: emb.FeatureConfig(table=t, name=c) for c, t in tables.items()}
    layer = tfrs.layers.embedding.TPUEmbedding(features, optimizer=emb.SGD(0.1))
    module = tf.Module()
    module.layer = layer
    spec_i = tf.RaggedTensorSpec([None, None], tf.int64)
    spec_w = tf.RaggedTensorSpec([None, None], tf.float32)
    if weighted:
        @tf.function(input_signature=[spec_i, spec_w])
        def serve(ids, w):
            return layer({c: ids for c in tables}, weights={"sum": w, "mean": w, "sqrtn": w})
    else:
        @tf.function(input_signature=[spec_i])
        def serve(ids):
            return layer({c: ids for c in tables})
    module.serve = serve
    splits = np.array([0, 2, 2, 5, 6], np.int64)
    values = np.array([3, 29, 0, 0, 11, 7], np.int64)
    weights = np.array([1.0, 0.5, 2.0, 1.0, 0.25, 3.0], np.float32)
    real = {"serving_default/ids": values, "serving_default/ids_1": splits}
    if weighted:
        real.update({"serving_default/w": weights, "serving_default/w_1": splits})
        serve(tf.RaggedTensor.from_row_splits(values, splits),
              tf.RaggedTensor.from_row_splits(weights, splits))
    else:
        serve(tf.RaggedTensor.from_row_splits(values, splits))
    tf.saved_model.save(module, path, signatures={"serving_default": serve})
    w = weights if weighted else None
    want = {c: reference.ragged_embedding_bag(layer.embedding_tables[tables[c]].numpy(),
                                              values, splits, w, c) for c in tables}
    # Weighted: ragged broadcasting of ids x weights re-gathers both by
    # RaggedRange positions, rebuilt from builtins after fusion.
    return {"pooled": {"serving_default": 3}, "inputs": real, "tflite": "ok",
            "reference": {"serving_default": want},
            "computes": ["sum", "weighted mean" if weighted else "mean", "sqrtn"]}


def keras_rs_embed_reduce(path):
    """keras-rs EmbedReduce (Keras 3), every combiner, weighted and not."""
    import keras
    import keras_rs
    ids = keras.Input(shape=(5,), dtype="int32", name="ids")
    w = keras.Input(shape=(5,), dtype="float32", name="w")
    layers = {c: keras_rs.layers.EmbedReduce(40, 4, combiner=c, name="bag_" + c)
              for c in ("sum", "mean", "sqrtn")}
    outputs = {"sum_w": layers["sum"](ids, w), "mean_w": layers["mean"](ids, w),
               "sqrtn": layers["sqrtn"](ids), "mean": layers["mean"](ids)}
    model = keras.Model([ids, w], outputs)
    model.export(path, format="tf_saved_model", verbose=False)
    x_ids = RNG.integers(0, 40, (4, 5)).astype(np.int32)
    x_w = RNG.uniform(0.2, 2.0, (4, 5)).astype(np.float32)
    tables = {c: layers[c].embeddings.numpy() for c in layers}
    want = {"sum_w": reference.embedding_bag(tables["sum"], x_ids, x_w, "sum"),
            "mean_w": reference.embedding_bag(tables["mean"], x_ids, x_w, "mean"),
            "sqrtn": reference.embedding_bag(tables["sqrtn"], x_ids, None, "sqrtn"),
            "mean": reference.embedding_bag(tables["mean"], x_ids, None, "mean")}
    return {"pooled": {"serving_default": 4}, "tflite": "ok",
            "inputs": {"ids": x_ids, "w": x_w},
            "reference": {"serving_default": want},
            "computes": ["sum", "weighted mean", "sqrtn", "mean"]}


def tf1_modules(path):
    """TF1-era code in a tf.Module: embedding_lookup_sparse (weighted mean),
    safe_embedding_lookup_sparse (sqrtn, default_id), and two sites that are
    reported, not fused: max_norm clipping and (without the op's max
    combiner) a reduce_max bag."""
    import tensorflow as tf
    table = RNG.normal(size=(30, 4)).astype(np.float32)
    module = tf.Module()
    module.table = tf.Variable(table)
    sp_i = tf.SparseTensorSpec([None, None], tf.int64)
    sp_w = tf.SparseTensorSpec([None, None], tf.float32)

    @tf.function(input_signature=[sp_i, sp_w])
    def lookups(ids, w):
        return {"mean": tf.nn.embedding_lookup_sparse(module.table, ids, w, combiner="mean"),
                "safe": tf.nn.safe_embedding_lookup_sparse(module.table, ids, None,
                                                           combiner="sqrtn", default_id=2)}

    @tf.function(input_signature=[sp_i])
    def clipped(ids):
        return {"clipped": tf.nn.embedding_lookup_sparse(module.table, ids, None,
                                                         combiner="mean", max_norm=1.0)}

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int32)])
    def bag_max(ids):
        return {"max": tf.reduce_max(tf.gather(module.table, ids), axis=1)}
    module.lookups, module.clipped, module.bag_max = lookups, clipped, bag_max
    tf.saved_model.save(module, path, signatures={"lookups": lookups, "clipped": clipped,
                                                  "bag_max": bag_max})
    indices = np.array([[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]], np.int64)
    values = np.array([4, 9, 0, 29, 4], np.int64)
    w = np.array([0.5, 2.0, 1.0, 1.0, 0.25], np.float32)
    shape = np.array([3, 3], np.int64)
    splits = np.array([0, 2, 2, 5])
    max_ids = RNG.integers(0, 30, (3, 4)).astype(np.int32)
    safe = reference.ragged_embedding_bag(table, values, splits, None, "sqrtn")
    safe[1] = table[2]  # the empty bag gets table[default_id]
    return {"pooled": {"lookups": 2, "clipped": 0, "bag_max": 1},
            "skipped": {"clipped": "max_norm"}, "computes": ["max"],
            "tflite": "ok", "tflite_signatures": ["lookups", "bag_max"],
            "inputs": {"lookups/ids": indices, "lookups/ids_1": values, "lookups/ids_2": shape,
                       "lookups/w": indices, "lookups/w_1": w, "lookups/w_2": shape,
                       "clipped/ids": indices, "clipped/ids_1": values,
                       "clipped/ids_2": shape, "bag_max/ids": max_ids},
            "reference": {"lookups": {
                "mean": reference.ragged_embedding_bag(table, values, splits, w, "mean")[:3],
                "safe": safe},
                "bag_max": {"max": table.astype(np.float64)[max_ids].max(axis=1)}}}


def tfm_dlrm_ranking(path):
    """tf-models-official's ranking task (official.recommendation.ranking):
    RankingTask.build_model() with its own config (multi-hot, DLRM dot
    interaction, every table through tfrs TPUEmbedding with the library's
    'mean' combiner), built on CPU and saved with tf.saved_model.save and a
    serving signature, as tfrs' TPUEmbedding documents: serving_default
    parses tf.Examples (ragged categorical features), `ragged` takes them
    already parsed (what a device is fed; this one converts to .tflite)."""
    import tensorflow as tf
    from official.recommendation.ranking import task as ranking_task
    from official.recommendation.ranking.configs import config as ranking_config
    vocab = [40, 30, 50]
    params = ranking_config.Task(model=ranking_config.ModelConfig(
        num_dense_features=3, vocab_sizes=vocab, embedding_dim=4, bottom_mlp=[8, 4],
        top_mlp=[8, 1], interaction="dot", use_multi_hot=True, multi_hot_sizes=[3, 3, 3],
        use_partial_tpu_embedding=False))
    model = ranking_task.RankingTask(params, trainer_config=ranking_config.TrainerConfig()
                                     ).build_model()
    keys = [f"cat_{i}" for i in range(len(vocab))]
    spec = {"dense": tf.io.FixedLenFeature([3], tf.float32)}
    spec.update({k: tf.io.RaggedFeature(tf.int64) for k in keys})

    def predict(dense, cats):
        return {"ctr": model({"dense_features": dense,
                              "sparse_features": {str(i): c for i, c in enumerate(cats)}})}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
    def serve(examples):
        parsed = tf.io.parse_example(examples, spec)
        return predict(parsed["dense"], [parsed[k] for k in keys])

    ragged_spec = tf.RaggedTensorSpec([None, None], tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="dense")] +
                 [ragged_spec] * len(vocab))
    def serve_ragged(dense, cat_0, cat_1, cat_2):
        return predict(dense, [cat_0, cat_1, cat_2])

    # No id 0 and no 0.0: a serialized Example ending in a NUL byte would lose it
    # in the .npz's bytes array (numpy strips trailing NULs of |S values).
    rows = [([0.1, 2.0, 3.0], [[1, 2], [3], [4, 5, 49]]),
            ([1.0, 1.0, 1.0], [[], [29], [1]]),      # one empty bag
            ([-0.5, 0.25, 7.0], [[39, 39, 2], [1, 2], [7]])]
    real_examples = np.array([_example(dict(
        {"dense": [float(v) for v in d]}, **{k: c for k, c in zip(keys, cats) if c}))
        for d, cats in rows], dtype=object)
    real = {"serving_default/examples": real_examples,
            "ragged/dense": np.array([d for d, _ in rows], np.float32)}
    for i, key in enumerate(keys):
        lists = [cats[i] for _, cats in rows]
        real[f"ragged/{key}"] = np.array([v for lst in lists for v in lst], np.int64)
        real[f"ragged/{key}_1"] = np.cumsum([0] + [len(lst) for lst in lists]).astype(np.int64)
    serve(real_examples)
    tf.saved_model.save(model, path, signatures={"serving_default": serve,
                                                 "ragged": serve_ragged})
    return {"pooled": {"serving_default": 3, "ragged": 3}, "tflite": "ok",
            "tflite_signatures": ["ragged"], "inputs": real, "computes": ["mean"]}


def _only_signature(path):
    import tensorflow as tf
    return sorted(k for k in tf.saved_model.load(path).signatures)[0]


def _only_input(path, sig):
    import tensorflow as tf
    fn = tf.saved_model.load(path).signatures[sig]
    return list(fn.structured_input_signature[1])[0]


BUILDERS = {
    "fc_examples": fc_examples, "fc_sparse_ids": fc_sparse_ids,
    "tf_keras_masked_mean": tf_keras_masked_mean,
    "keras3_text_classifier": keras3_text_classifier, "tfrs_ranking": tfrs_ranking,
    "tfrs_tpu_embedding": tfrs_tpu_embedding,
    "tfrs_tpu_embedding_unweighted": lambda p: tfrs_tpu_embedding(p, weighted=False),
    "keras_rs_embed_reduce": keras_rs_embed_reduce, "tf1_modules": tf1_modules,
    "tfm_dlrm_ranking": tfm_dlrm_ranking,
}


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def main(out_dir, names):
    meta = {}
    for name in names:
        info = BUILDERS[name](os.path.join(out_dir, name))
        inputs = info.pop("inputs")
        for key, value in inputs.items():
            if value.dtype == object and any(isinstance(v, bytes) and v.endswith(b"\0")
                                             for v in value.ravel()):
                raise ValueError(f"{name} {key}: a value ends in a NUL byte, which a bytes "
                                 "array in the .npz would drop")
        np.savez(os.path.join(out_dir, name + ".inputs.npz"),
                 **{k: (v.astype(bytes) if v.dtype == object else v) for k, v in inputs.items()})
        meta[name] = _jsonable(info)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(BUILDERS))
