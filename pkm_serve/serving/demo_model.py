"""Small Product-Key-Memory SavedModels for the serving tests, benchmark and docs.

`save_pkm_model(path, ...)` writes a SavedModel with two signatures:
  serving_default: query [B, d_model] float32 -> output [B, v_dim], slots [B, knn]
      the PKM read (Lample et al. 2019): two sub-key searches, product top-k,
      softmax weights, then one EmbeddingBag over the value table;
  lookup: indices [B, K] int64, weights [B, K] float32 -> output [B, v_dim]
      the bare weighted EmbeddingBag over the same table.
With fused=True the bag is pkm_serve.ops.embedding_bag (the PkmEmbeddingBag op:
serving it needs the op library loaded); otherwise the stock-TF composite.
"""
import numpy as np
import tensorflow as tf

from pkm_serve.product_keys import product_key_search


def _composite_bag(table, indices, weights):
    rows = tf.gather(table, tf.maximum(indices, 0))
    w = tf.where(indices >= 0, weights, tf.zeros_like(weights))
    return tf.reduce_sum(rows * w[..., None], axis=-2)


class PkmModel(tf.Module):
    def __init__(self, d_model=32, k_dim=16, n_keys=64, knn=8, v_dim=64, seed=0, fused=True):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.n_keys, self.knn, self.fused = n_keys, knn, fused
        if fused:  # register the op outside of tracing
            from pkm_serve import ops
            ops.load_library()
        half = k_dim // 2
        self.query_proj = tf.Variable(rng.normal(0, d_model ** -0.5, (d_model, k_dim)).astype(np.float32))
        self.sub_keys = tf.Variable(rng.uniform(-half ** -0.5, half ** -0.5, (2, n_keys, half)).astype(np.float32))
        self.values = tf.Variable(rng.normal(0, v_dim ** -0.5, (n_keys * n_keys, v_dim)).astype(np.float32))
        self.serve = tf.function(self._serve, input_signature=[
            tf.TensorSpec([None, d_model], tf.float32, name="query")])
        self.lookup = tf.function(self._lookup, input_signature=[
            tf.TensorSpec([None, None], tf.int64, name="indices"),
            tf.TensorSpec([None, None], tf.float32, name="weights")])

    def _bag(self, indices, weights):
        if self.fused:
            from pkm_serve import ops
            return ops.embedding_bag(self.values, indices, weights, combiner="sum")
        return _composite_bag(self.values, indices, weights)

    def _serve(self, query):
        # One head: the projected query's two halves against the two sub-key sets.
        q = tf.reshape(tf.matmul(query, self.query_proj), [tf.shape(query)[0], 1, 2, -1])
        chosen, weights = product_key_search(q, self.sub_keys[None], self.knn)
        return {"output": self._bag(chosen, weights), "slots": chosen}

    def _lookup(self, indices, weights):
        return {"output": self._bag(indices, weights)}


def save_pkm_model(path, seed=0, fused=True, **kwargs):
    model = PkmModel(seed=seed, fused=fused, **kwargs)
    tf.saved_model.save(model, path, signatures={
        "serving_default": model.serve.get_concrete_function(),
        "lookup": model.lookup.get_concrete_function()})
    return path
