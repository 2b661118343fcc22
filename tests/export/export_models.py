"""SavedModels written with the composite forms users already have, for the
export tests. Each builder saves to `path` and returns (table(s), reference fn)
where reference(inputs) computes the expected outputs in numpy."""
from __future__ import annotations

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402

N, D, K = 50, 8, 6


def run_as_a_server(saved_model, signature, feed, output="out"):
    """A signature's `output` run as TF Serving runs it: feeds of any shape, unchecked against
    the signature (a TF1 session over the SavedModel)."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        holders = {k: tf.compat.v1.placeholder(tf.as_dtype(v.dtype), None) for k, v in feed.items()}
        meta = tf.compat.v1.saved_model.loader.load(
            sess, ["serve"], str(saved_model), input_map={f"{signature}_{k}:0": v for k, v in holders.items()})
        out = graph.get_tensor_by_name(meta.signature_def[signature].outputs[output].name)
        return sess.run(out, {holders[k]: v for k, v in feed.items()})


def warmup_request(export_dir, version="1"):
    """The one request of an export's warmup file (tf_serving_warmup_requests), a PredictRequest."""
    from tensorflow_serving.apis import prediction_log_pb2

    from pkm_serve.export.warmup import WARMUP_FILE
    [record] = [prediction_log_pb2.PredictionLog.FromString(r.numpy())
                for r in tf.data.TFRecordDataset(os.path.join(str(export_dir), version, WARMUP_FILE))]
    return record.predict_log.request


def _table(seed=0, n=N, d=D, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


def _save(module, path, signatures):
    tf.saved_model.save(module, path, signatures=signatures)


def save_bag_module(path, table, body, k=K, index_dtype=tf.int32, weight_dtype=None):
    """Saves a tf.Module holding `table` as a variable, whose serving_default
    takes ids and weights [None, k] and returns body(table variable, ids,
    weights) (a dict, or one tensor named 'out')."""
    weight_dtype = weight_dtype or tf.as_dtype(table.dtype)

    class Bag(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, k], index_dtype),
                                      tf.TensorSpec([None, k], weight_dtype)])
        def serve(self, idx, w):
            out = body(self.table, idx, w)
            return out if isinstance(out, dict) else {"out": out}

    module = Bag()
    _save(module, str(path), {"serving_default": module.serve})


def np_bag(table, idx, w=None, combiner="sum"):
    """Reference: combine_k w * table[idx] over the last index axis (float64),
    tests/reference.py's dense bags."""
    return reference.embedding_bag(table, idx, w, combiner)


def np_sparse_bag(table, indices, values, dense_shape, weights=None, combiner="sum"):
    """Reference for embedding_lookup_sparse: rows up to the last non-empty
    one (tests/reference.py's ragged bags on the ids' row order)."""
    rows = int(indices[:, 0].max()) + 1 if len(indices) else 0
    splits = np.searchsorted(np.asarray(indices)[:, 0], np.arange(rows + 1), side="left")
    return reference.ragged_embedding_bag(table, values, splits, weights, combiner)


def gather_weighted_sum(path, index_dtype=tf.int32, expand="slice", table_dtype=np.float32):
    """tf.gather(variable) * w[..., None] -> reduce_sum(axis=1)  (ResourceGather)."""
    table = _table(1, dtype=table_dtype)

    def body(t, idx, w):
        w_last = w[..., None] if expand == "slice" else tf.expand_dims(w, -1)
        return tf.reduce_sum(tf.gather(t, idx) * w_last, axis=1)
    save_bag_module(path, table, body, index_dtype=index_dtype)
    return table, lambda x: {"out": np_bag(table, x["idx"], x["w"])}


def gather_mean_3d(path):
    """tf.reduce_mean(tf.gather(read(variable), idx[B, S, K]), axis=-2)  (GatherV2)."""
    table = _table(2)

    class M(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, 3, K], tf.int64)])
        def serve(self, idx):
            rows = tf.gather(tf.convert_to_tensor(self.table), idx, axis=0)
            return {"pooled": tf.reduce_mean(rows, axis=-2)}

    m = M()
    _save(m, path, {"serving_default": m.serve})
    return table, lambda x: {"pooled": np_bag(table, x["idx"], combiner="mean")}


def einsum_forms(path):
    """Three einsum spellings of the weighted bag sum, one signature each."""
    table = _table(3)

    class M(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                      tf.TensorSpec([None, K], tf.float32)])
        def ellipsis(self, idx, w):
            return {"out": tf.einsum("...k,...kd->...d", w, tf.gather(self.table, idx))}

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                      tf.TensorSpec([None, K], tf.float32)])
        def named(self, idx, w):
            return {"out": tf.einsum("bkd,bk->bd", tf.gather(self.table, idx), w)}

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def unweighted(self, idx):
            return {"out": tf.einsum("bkd->bd", tf.gather(self.table, idx))}

    m = M()
    _save(m, path, {"ellipsis": m.ellipsis, "named": m.named, "unweighted": m.unweighted})
    return table, None


def sparse_lookup(path, weighted=True, combiner="sum", safe=False):
    """tf.nn.(safe_)embedding_lookup_sparse on SparseTensor ids (and weights)."""
    table = _table(4)
    ids_spec = tf.SparseTensorSpec([None, None], tf.int64)
    w_spec = tf.SparseTensorSpec([None, None], tf.float32)
    lookup = tf.nn.safe_embedding_lookup_sparse if safe else tf.nn.embedding_lookup_sparse

    class M(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

    m = M()
    if weighted:
        @tf.function(input_signature=[ids_spec, w_spec])
        def serve(ids, w):
            return {"out": lookup(m.table, ids, w, combiner=combiner)}
    else:
        @tf.function(input_signature=[ids_spec])
        def serve(ids):
            return {"out": lookup(m.table, ids, None, combiner=combiner)}
    m.serve = serve
    _save(m, path, {"serving_default": serve})
    return table, None


def keras_embedding_pooling(path):
    """Keras Embedding -> GlobalAveragePooling1D -> Dense, exported by Keras."""
    import keras
    table = _table(5)
    inp = keras.Input(shape=(K,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(N, D, name="emb")
    x = emb(inp)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inp, out)
    emb.embeddings.assign(table)
    model.export(path, format="tf_saved_model", verbose=False)
    kernel, bias = [v.numpy() for v in model.get_layer("head").weights]

    def reference(x):
        return np_bag(table, x["ids"], combiner="mean") @ kernel + bias
    return table, reference


def two_sites_one_blocked(path):
    """Two fusable sites (weighted sum, unweighted mean) and one whose gathered
    rows are also used by a max-pool, which must be left alone."""
    t1, t2, t3 = _table(6), _table(7, n=30), _table(8, n=40)

    class M(tf.Module):
        def __init__(self):
            self.t1, self.t2, self.t3 = tf.Variable(t1), tf.Variable(t2), tf.Variable(t3)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                      tf.TensorSpec([None, K], tf.float32),
                                      tf.TensorSpec([None, 4], tf.int32)])
        def serve(self, a, w, b):
            s1 = tf.reduce_sum(tf.gather(self.t1, a) * w[..., None], axis=1)
            s2 = tf.reduce_mean(tf.gather(self.t2, b), axis=1)
            rows3 = tf.gather(self.t3, b)
            s3 = tf.reduce_sum(rows3, axis=1) + tf.reduce_max(rows3, axis=1)
            return {"s1": s1, "s2": s2, "s3": s3}

    m = M()
    _save(m, path, {"serving_default": m.serve})

    def reference(x):
        rows3 = t3.astype(np.float64)[x["b"]]
        return {"s1": np_bag(t1, x["a"], x["w"]),
                "s2": np_bag(t2, x["b"], combiner="mean"),
                "s3": rows3.sum(1) + rows3.max(1)}
    return (t1, t2, t3), reference


def no_sites(path):
    """A dense layer only: nothing to fuse."""
    kernel = _table(9, n=D, d=3)

    class M(tf.Module):
        def __init__(self):
            self.kernel = tf.Variable(kernel)

        @tf.function(input_signature=[tf.TensorSpec([None, D], tf.float32)])
        def serve(self, x):
            return {"y": tf.matmul(x, self.kernel)}

    m = M()
    _save(m, path, {"serving_default": m.serve})
    return kernel, lambda x: {"y": x["x"] @ kernel}


def project_composite(path, combiner="mean"):
    """A model written with pkm_serve.ops.embedding_bag_composite (the pure-TF
    reference users deploy where the op is missing): padding -1 ids and all."""
    from pkm_serve.ops import embedding_bag_composite
    table = _table(10)
    save_bag_module(path, table, lambda t, idx, w: embedding_bag_composite(
        t, idx, w, combiner=combiner), index_dtype=tf.int64)
    return table, None


# ---- the forms real models are written in (issue #13) -----------------------

def _masked_ids(rng, batch, k=K, n=N):
    """ids in [1, n) with trailing 0 padding (at least one real id per row)."""
    ids = rng.integers(1, n, (batch, k)).astype(np.int32)
    for b in range(batch):
        ids[b, rng.integers(1, k + 1):] = 0
    return ids


def np_masked_mean(table, ids):
    keep = (ids != 0).astype(np.float64)
    return np_bag(table, ids, keep) / keep.sum(-1, keepdims=True)


def keras_masked_mean(path, head=True):
    """Keras Embedding(mask_zero=True) -> GlobalAveragePooling1D [-> Dense]:
    the masked mean of a bag-of-words text model."""
    import keras
    table = _table(11)
    inp = keras.Input(shape=(K,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(N, D, mask_zero=True, name="emb")
    x = keras.layers.GlobalAveragePooling1D()(emb(inp))
    out = keras.layers.Dense(3, name="head")(x) if head else x
    model = keras.Model(inp, out)
    emb.embeddings.assign(table)
    model.export(path, format="tf_saved_model", verbose=False)
    if not head:
        return table, lambda x: np_masked_mean(table, x["ids"])
    kernel, bias = [v.numpy() for v in model.get_layer("head").weights]
    return table, lambda x: np_masked_mean(table, x["ids"]) @ kernel + bias


def masked_forms(path):
    """Hand-written masks: multiply by a 0/1 float mask and divide by its sum;
    tf.where on a boolean mask; both in one signature (two tables)."""
    t1, t2 = _table(12), _table(13)

    class Mod(tf.Module):
        def __init__(self):
            self.t1, self.t2 = tf.Variable(t1), tf.Variable(t2)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32)])
        def serve(self, ids):
            mask = tf.cast(tf.not_equal(ids, 0), tf.float32)
            total = tf.reduce_sum(tf.gather(self.t1, ids) * mask[:, :, None], axis=1)
            mean = total / tf.reduce_sum(mask, axis=1, keepdims=True)
            keep = tf.not_equal(ids, 0)[..., None]
            where_sum = tf.reduce_sum(tf.where(keep, tf.gather(self.t2, ids), 0.0), axis=1)
            return {"mean": mean, "where_sum": where_sum}

    m = Mod()
    _save(m, path, {"serving_default": m.serve})

    def reference(x):
        keep = (x["ids"] != 0).astype(np.float64)
        return {"mean": np_masked_mean(t1, x["ids"]), "where_sum": np_bag(t2, x["ids"], keep)}
    return (t1, t2), reference


def mean_of_weighted(path):
    """tf.reduce_mean(tf.gather(t, ids) * w[..., None], axis=1): a sum with w / K."""
    table = _table(14)
    save_bag_module(path, table,
                    lambda t, idx, w: tf.reduce_mean(tf.gather(t, idx) * w[..., None], axis=1))
    return table, lambda x: {"out": np_bag(table, x["idx"], x["w"]) / K}


def cast_forms(path):
    """Casts between gather and reduction: a float32 table read in float16
    (what mixed_float16 layers do) and a float16 table summed in float32."""
    t32, t16 = _table(15), _table(16, dtype=np.float16)

    class Mod(tf.Module):
        def __init__(self):
            self.t32, self.t16 = tf.Variable(t32), tf.Variable(t16)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                      tf.TensorSpec([None, K], tf.float16)])
        def serve(self, idx, w):
            rows16 = tf.cast(tf.gather(self.t32, idx), tf.float16)
            half = tf.reduce_sum(rows16 * w[..., None], axis=1)
            wide = tf.reduce_mean(tf.cast(tf.gather(self.t16, idx), tf.float32), axis=1)
            return {"half": tf.cast(half, tf.float32), "wide": wide}

    m = Mod()
    _save(m, path, {"serving_default": m.serve})
    return (t32, t16), lambda x: {"half": np_bag(t32, x["idx"], x["w"]),
                                  "wide": np_bag(t16, x["idx"], combiner="mean")}


def keras_mixed_precision(path):
    """A Keras model under mixed_float16: Embedding -> weighted sum -> Dense."""
    import keras
    table = _table(17)
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ids = keras.Input(shape=(K,), dtype="int32", name="ids")
        emb = keras.layers.Embedding(N, D, name="emb")
        x = keras.ops.sum(emb(ids), axis=1)
        out = keras.layers.Activation("linear", dtype="float32")(x)
        model = keras.Model(ids, out)
    finally:
        keras.mixed_precision.set_global_policy(old)
    emb.embeddings.assign(table)
    model.export(path, format="tf_saved_model", verbose=False)
    return table, lambda x: np_bag(table, x["ids"])


def keras_ops_forms(path):
    """keras.ops.take / keras.ops.sum inside a Keras layer's call, and a
    tf.function nested in the layer (a StatefulPartitionedCall in the SavedModel)."""
    import keras
    table = _table(18)

    class Bag(keras.layers.Layer):
        def build(self, _):
            self.table = self.add_weight(shape=(N, D), name="table")

        def call(self, inputs):
            idx, w = inputs
            return keras.ops.sum(keras.ops.take(self.table, idx, axis=0) * w[..., None], axis=1)

    class Nested(tf.Module):
        def __init__(self, var):
            self.var = var

        @tf.function
        def __call__(self, idx):
            return tf.reduce_mean(tf.gather(self.var, idx), axis=1)

    idx_in = keras.Input(shape=(K,), dtype="int32", name="idx")
    w_in = keras.Input(shape=(K,), dtype="float32", name="w")
    bag = Bag(name="bag")
    model = keras.Model([idx_in, w_in], bag([idx_in, w_in]))
    bag.table.assign(table)

    class Mod(tf.Module):
        def __init__(self):
            self.model = model
            self.nested = Nested(bag.table.value if hasattr(bag.table, "value") else bag.table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                      tf.TensorSpec([None, K], tf.float32)])
        def serve(self, idx, w):
            return {"keras_ops": self.model([idx, w]), "nested": self.nested(idx)}

    m = Mod()
    _save(m, path, {"serving_default": m.serve})
    return table, lambda x: {"keras_ops": np_bag(table, x["idx"], x["w"]),
                             "nested": np_bag(table, x["idx"], combiner="mean")}


def np_safe_sparse_bag(table, indices, values, dense_shape, weights=None, combiner="sum",
                       default_id=None):
    """Reference for safe_embedding_lookup_sparse on 2-D ids: ids < 0 pruned
    (and weights <= 0 unless sum), dense_shape[0] rows; a row left empty is
    zeros, or table[default_id]."""
    keep = values >= 0
    if weights is not None and combiner != "sum":
        keep &= weights > 0
    rows = int(dense_shape[0])
    out = np.zeros((rows, table.shape[1]))
    if keep.any():
        got = np_sparse_bag(table, indices[keep], values[keep], dense_shape,
                            None if weights is None else weights[keep], combiner)
        out[:len(got)] = got
    if default_id is not None:
        empty = ~np.isin(np.arange(rows), indices[keep][:, 0])
        out[empty] = table[default_id]
    return out


def sparse_all_combiners(path, safe=False):
    """One signature per weighting, one output per combiner, all from the same
    (safe_)embedding_lookup_sparse call shape: 6 sites in one model."""
    table = _table(19)
    lookup = tf.nn.safe_embedding_lookup_sparse if safe else tf.nn.embedding_lookup_sparse
    ids_spec = tf.SparseTensorSpec([None, None], tf.int64)
    w_spec = tf.SparseTensorSpec([None, None], tf.float32)

    class Mod(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[ids_spec, w_spec])
        def weighted(self, ids, w):
            return {c: lookup(self.table, ids, w, combiner=c) for c in ("sum", "mean", "sqrtn")}

        @tf.function(input_signature=[ids_spec])
        def unweighted(self, ids):
            return {c: lookup(self.table, ids, None, combiner=c)
                    for c in ("sum", "mean", "sqrtn")}

        if safe:  # embedding_lookup_sparse has no default_id
            @tf.function(input_signature=[ids_spec, w_spec])
            def default_id(self, ids, w):
                return {c: lookup(self.table, ids, w, combiner=c, default_id=DEFAULT_ID)
                        for c in ("sum", "mean", "sqrtn")}

    m = Mod()
    signatures = {"weighted": m.weighted, "unweighted": m.unweighted}
    if safe:
        signatures["default_id"] = m.default_id
    _save(m, path, signatures)

    def reference(x, signature=None):
        w = x.get("w_1")
        if not safe:
            return {c: np_sparse_bag(table, x["ids"], x["ids_1"], x["ids_2"], w, c)
                    for c in ("sum", "mean", "sqrtn")}
        default = DEFAULT_ID if signature == "default_id" else None
        return {c: np_safe_sparse_bag(table, x["ids"], x["ids_1"], x["ids_2"], w, c, default)
                for c in ("sum", "mean", "sqrtn")}
    return table, reference


DEFAULT_ID = 7


def sparse_inputs(rng, weighted, safe, batch=6):
    """A SparseTensor of ids (and weights): bags of 0-3 ids, an empty bag in the
    middle and a trailing one; safe_ inputs also hold a -1 id, a zero and a
    negative weight (pruned by safe_ for mean/sqrtn)."""
    indices, values = [], []
    for b in range(batch - 1):
        count = 0 if b == 2 else int(rng.integers(1, 4))
        for j in range(count):
            indices.append([b, j])
            values.append(int(rng.integers(0, N)))
    values = np.array(values, np.int64)
    weights = rng.uniform(0.2, 2.0, len(values)).astype(np.float32)
    if safe:
        values[1] = -1
        weights[3] = 0.0
        weights[4] = -0.5
    x = {"ids": np.array(indices, np.int64), "ids_1": values,
         "ids_2": np.array([batch, 4], np.int64)}
    if weighted:
        x.update(w=x["ids"], w_1=weights, w_2=x["ids_2"])
    return x


def unfusable_reductions(path):
    """Gathered rows reduced in ways that cannot be fused, one per reason;
    nothing in this model is fused."""
    table = np.arange(20 * 4, dtype=np.float32).reshape(20, 4)

    def body(t, idx, w):
        rows = lambda: tf.gather(t, idx)  # noqa: E731 - a fresh gather each
        keep = tf.not_equal(idx, 0)[..., None]
        return {"over_batch": tf.reduce_sum(rows(), axis=0),
                "two_axes": tf.reduce_sum(rows(), axis=[1, 2]),
                "per_feature_weight": tf.reduce_sum(rows() * tf.constant([1.0, 2.0, 3.0, 4.0]), axis=1),
                "exp": tf.reduce_sum(tf.exp(rows()), axis=1),
                "where_one": tf.reduce_sum(tf.where(keep, rows(), 1.0), axis=1)}
    save_bag_module(path, table, body, k=3)
    return table, None


def op_counts(saved_model_dir):
    """{op: count} over every function body of the SavedModel."""
    from pkm_serve.export.exporter import read_saved_model
    counts = {}
    for mg in read_saved_model(str(saved_model_dir)).meta_graphs:
        for fdef in mg.graph_def.library.function:
            for node in fdef.node_def:
                counts[node.op] = counts.get(node.op, 0) + 1
    return counts
