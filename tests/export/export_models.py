"""SavedModels written with the composite forms users already have, for the
export tests. Each builder saves to `path` and returns (table(s), reference fn)
where reference(inputs) computes the expected outputs in numpy."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

N, D, K = 50, 8, 6


def _table(seed=0, n=N, d=D, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(dtype)


def _save(module, path, signatures):
    tf.saved_model.save(module, path, signatures=signatures)


def np_bag(table, idx, w=None, combiner="sum"):
    """Reference: combine_k w * table[idx] over the last index axis (float64)."""
    rows = table.astype(np.float64)[idx]
    w = np.ones(idx.shape) if w is None else w.astype(np.float64)
    total = (rows * w[..., None]).sum(-2)
    if combiner == "mean":
        total = total / w.sum(-1)[..., None]
    elif combiner == "sqrtn":
        total = total / np.sqrt((w ** 2).sum(-1))[..., None]
    return total


def np_sparse_bag(table, indices, values, dense_shape, weights=None, combiner="sum"):
    """Reference for embedding_lookup_sparse: rows up to the last non-empty one."""
    rows = int(indices[:, 0].max()) + 1 if len(indices) else 0
    out = np.zeros((rows, table.shape[1]))
    wsum = np.zeros(rows)
    w2sum = np.zeros(rows)
    w = np.ones(len(values)) if weights is None else weights.astype(np.float64)
    for (b, *_), v, wi in zip(indices, values, w):
        out[b] += wi * table[v]
        wsum[b] += wi
        w2sum[b] += wi * wi
    if combiner == "mean":
        out = np.divide(out, wsum[:, None], out=np.zeros_like(out), where=wsum[:, None] != 0)
    elif combiner == "sqrtn":
        den = np.sqrt(w2sum)[:, None]
        out = np.divide(out, den, out=np.zeros_like(out), where=den != 0)
    return out


def gather_weighted_sum(path, index_dtype=tf.int32, expand="slice", table_dtype=np.float32):
    """tf.gather(variable) * w[..., None] -> reduce_sum(axis=1)  (ResourceGather)."""
    table = _table(1, dtype=table_dtype)

    class M(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], index_dtype),
                                      tf.TensorSpec([None, K], table_dtype)])
        def serve(self, idx, w):
            rows = tf.gather(self.table, idx)
            w_last = w[..., None] if expand == "slice" else tf.expand_dims(w, -1)
            return {"out": tf.reduce_sum(rows * w_last, axis=1)}

    m = M()
    _save(m, path, {"serving_default": m.serve})
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

    class M(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64),
                                      tf.TensorSpec([None, K], tf.float32)])
        def serve(self, idx, w):
            return {"out": embedding_bag_composite(self.table, idx, w, combiner=combiner)}

    m = M()
    _save(m, path, {"serving_default": m.serve})
    return table, None
