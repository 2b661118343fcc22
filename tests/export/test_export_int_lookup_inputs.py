"""Verification inputs for integer inputs that are raw ids looked up in a table (Keras
IntegerLookup, a tf.lookup.StaticHashTable of int64 ids: item ids 1001..1040 into rows). The
export drew integers in [0, rows), none of them a key: every looked-up id was the one
out-of-vocabulary row, so verification compared bags of one repeated row. Inputs that reach a
lookup's keys are now drawn mostly from the tables' own keys."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import feeds as F
from pkm_serve.export import main
from pkm_serve.export import verify as V
from pkm_serve.export.saved_model_io import read_saved_model
import export_models

ops.load_library()
KEYS = np.arange(1001, 1041)
K = 4


@pytest.fixture(scope="module")
def integer_lookup_model(tmp_path_factory):
    """IntegerLookup(mask_token=0) -> Embedding(mask_zero=True) -> masked mean."""
    inp = keras.Input((K,), dtype="int64", name="movies")
    ids = keras.layers.IntegerLookup(vocabulary=KEYS, mask_token=0)(inp)
    embedding = keras.layers.Embedding(len(KEYS) + 2, 4, mask_zero=True)
    path = str(tmp_path_factory.mktemp("int_lookup") / "sm")
    keras.Model(inp, keras.layers.GlobalAveragePooling1D()(embedding(ids))).export(path, verbose=False)
    return path, embedding.embeddings.numpy().astype(np.float64)


class HashTableBag(tf.Module):
    """A StaticHashTable of int64 ids (unknown: -1) in front of a masked-mean bag."""

    def __init__(self):
        self.table = tf.Variable(np.random.default_rng(0).standard_normal((len(KEYS), 4)).astype(np.float32))
        init = tf.lookup.KeyValueTensorInitializer(tf.constant(KEYS), tf.range(len(KEYS), dtype=tf.int64))
        self.lookup = tf.lookup.StaticHashTable(init, default_value=-1)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64)])
    def __call__(self, raw):
        ids = self.lookup.lookup(raw)
        mask = tf.cast(ids >= 0, tf.float32)
        rows = tf.gather(self.table, tf.maximum(ids, 0)) * mask[..., None]
        return {"emb": tf.math.divide_no_nan(tf.reduce_sum(rows, 1), tf.reduce_sum(mask, 1, keepdims=True))}


def _generated(src, signature, name, batch_size=8):
    feed = F.signature_feeds(read_saved_model(src), signature)[name]
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures[signature])
    return feed, V.generate_inputs(specs, index_limit=len(KEYS), batch_size=batch_size, feeds={name: feed})[name]


def test_integer_lookup_ids_are_drawn_from_its_keys(integer_lookup_model):
    src, _ = integer_lookup_model
    feed, ids = _generated(src, "serve", "movies")
    assert feed.int_keys == KEYS.tolist()
    assert np.isin(ids, KEYS).mean() >= 0.6, ids


def test_static_hash_table_ids_are_drawn_from_its_keys(tmp_path):
    module = HashTableBag()
    src = str(tmp_path / "sm")
    tf.saved_model.save(module, src, signatures={"serving_default": module.__call__})
    feed, ids = _generated(src, "serving_default", "raw")
    assert feed.int_keys == KEYS.tolist()
    assert np.isin(ids, KEYS).mean() >= 0.6, ids


def test_exported_integer_lookup_model_on_its_warmup_ids_equals_numpy(integer_lookup_model, tmp_path):
    src, table = integer_lookup_model
    dst = tmp_path / "models"
    assert main([src, str(dst), "--warmup-requests", "1", "--signatures", "serve", "--quiet"]) == 0
    request = export_models.warmup_request(dst)
    raw = tf.make_ndarray(request.inputs["movies"])
    [got] = tf.saved_model.load(str(dst / "1")).signatures["serve"](movies=tf.constant(raw)).values()
    index = {int(k): i + 2 for i, k in enumerate(KEYS)}  # 0: the mask token, 1: out of vocabulary
    rows = np.array([[0 if r == 0 else index.get(int(r), 1) for r in bag] for bag in raw])
    assert (rows >= 2).mean() >= 0.6
    mask = rows > 0
    with np.errstate(invalid="ignore"):
        want = (table[rows] * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
