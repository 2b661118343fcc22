"""tf_keras models of composite inputs, exported: `Input(ragged=True)` / `Input(sparse=True)` are
saved with each RaggedTensor / SparseTensor flattened into numbered signature inputs (ragged ids and
ragged weights: `args_0, args_0_1, args_0_2, args_0_3`). The verification read only `NAME, NAME_1`
with no `NAME_2` as a ragged pair, so these three models got random integers as row_splits or sparse
indices and the export failed ("the original model fails on the generated inputs"). The parts are
now read off the saved function the signature calls (pkm_serve/export/composites.py)."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import main
from pkm_serve.export.composites import signature_composites
from pkm_serve.export.saved_model_io import read_saved_model
import export_models

tf_keras = pytest.importorskip("tf_keras")
ops.load_library()
N, D = 40, 4


def _table_layer(call):
    class Bag(tf_keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight("table", shape=[N, D], initializer="glorot_uniform")

        def call(self, *args):
            return call(self.table, *args)
    return Bag()


def _weighted_ragged(path):
    ids = tf_keras.Input((None,), dtype="int64", ragged=True, name="ids")
    w = tf_keras.Input((None,), dtype="float32", ragged=True, name="w")
    bag = _table_layer(lambda t, i, v: tf.reduce_sum(tf.gather(t, i) * tf.expand_dims(v, -1), axis=1))
    model = tf_keras.Model([ids, w], bag(ids, w))
    model.save(path)
    return bag.table.numpy().astype(np.float64)


def _ragged_and_dense(path):
    ids = tf_keras.Input((None,), dtype="int64", ragged=True, name="ids")
    x = tf_keras.Input((2,), dtype="float32", name="x")
    bag = _table_layer(lambda t, i: tf.reduce_sum(tf.gather(t, i), axis=1))
    model = tf_keras.Model([ids, x], tf_keras.layers.Concatenate()([bag(ids), x]))
    model.save(path)
    return bag.table.numpy().astype(np.float64)


def _dense_ids_and_ragged(path):
    """Dense int64 [batch, 2] ids first: args_0, args_0_1, args_0_2 read by name as one SparseTensor."""
    pair = tf_keras.Input((2,), dtype="int64", name="pair")
    ids = tf_keras.Input((None,), dtype="int64", ragged=True, name="ids")
    bag = _table_layer(lambda t, p, i: tf.reduce_sum(tf.gather(t, p), axis=1) + tf.reduce_sum(tf.gather(t, i), axis=1))
    tf_keras.Model([pair, ids], bag(pair, ids)).save(path)
    return bag.table.numpy().astype(np.float64)


def _weighted_sparse(path):
    ids = tf_keras.Input((None,), dtype="int64", sparse=True, name="ids")
    w = tf_keras.Input((None,), dtype="float32", sparse=True, name="w")
    bag = _table_layer(lambda t, i, v: tf.nn.embedding_lookup_sparse(t, i, v, combiner="mean"))
    model = tf_keras.Model([ids, w], bag(ids, w))
    model.save(path)
    return bag.table.numpy().astype(np.float64)


def _bags(values, splits):
    return [values[a:b] for a, b in zip(splits[:-1], splits[1:])]


def _ragged_reference(table, f):
    assert f["args_0_1"][0] == 0 and np.all(np.diff(f["args_0_1"]) >= 0) and f["args_0_1"][-1] == len(f["args_0"])
    return np.stack([table[i].sum(0) for i in _bags(f["args_0"], f["args_0_1"])])


def _weighted_ragged_reference(table, f):
    _ragged_reference(table, f)  # valid splits
    np.testing.assert_array_equal(f["args_0_1"], f["args_0_3"])
    bags = zip(_bags(f["args_0"], f["args_0_1"]), _bags(f["args_0_2"], f["args_0_3"]))
    return np.stack([(table[i] * w[:, None]).sum(0) for i, w in bags])


def _ragged_and_dense_reference(table, f):
    return np.concatenate([_ragged_reference(table, f), f["args_0_2"]], axis=1)


def _dense_ids_and_ragged_reference(table, f):
    ragged = {"args_0": f["args_0_1"], "args_0_1": f["args_0_2"]}
    return table[f["args_0"]].sum(1) + _ragged_reference(table, ragged)


def _weighted_sparse_reference(table, f):
    np.testing.assert_array_equal(f["args_0"], f["args_0_3"])
    rows = f["args_0"][:, 0]
    out = np.zeros((int(f["args_0_2"][0]), D))
    for r in np.unique(rows):
        ids, w = f["args_0_1"][rows == r], f["args_0_4"][rows == r]
        out[r] = (table[ids] * w[:, None]).sum(0) / w.sum()
    return out


CASES = {"weighted_ragged": (_weighted_ragged, _weighted_ragged_reference),
         "ragged_and_dense": (_ragged_and_dense, _ragged_and_dense_reference),
         "dense_ids_and_ragged": (_dense_ids_and_ragged, _dense_ids_and_ragged_reference),
         "weighted_sparse": (_weighted_sparse, _weighted_sparse_reference)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tf_keras_composite_inputs_export_and_equal_numpy(case, tmp_path):
    build, reference = CASES[case]
    src = str(tmp_path / "src")
    table = build(src)
    dst = tmp_path / "models"
    assert main([src, str(dst), "--warmup-requests", "1", "--quiet"]) == 0
    request = export_models.warmup_request(dst)
    feed = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
    [got] = tf.saved_model.load(str(dst / "1")).signatures["serving_default"](
        **{k: tf.constant(v) for k, v in feed.items()}).values()
    np.testing.assert_allclose(got.numpy(), reference(table, feed), rtol=1e-5, atol=1e-6)


def test_the_parts_are_named_from_the_saved_function(tmp_path):
    src = str(tmp_path / "src")
    _weighted_ragged(src)
    groups = signature_composites(read_saved_model(src).meta_graphs[0], "serving_default")
    assert groups == [("ragged", "args_0", "args_0_1"), ("ragged", "args_0_2", "args_0_3")]
