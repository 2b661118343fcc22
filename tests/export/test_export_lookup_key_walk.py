"""Which integer inputs get lookup-table keys as verification ids. The walk from an input to a
table's keys followed every op, so ids that pick embedding rows were found "reaching" a lookup
through their float rows and a top_k over the scores (an inverted StringLookup mapping indices
to titles), or through a gather they index (ids -> codes -> StaticHashTable): they were drawn from
the keys instead of [0, rows) and the export of a model that exported before failed ("the original
model fails on the generated inputs": indices[0,0] = 269 is not in [0, 10)). The walk now follows
an input's values only: outputs of its own dtype, never a gather's row ids."""
import os

import keras
import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import feeds as F
from pkm_serve.export import main
from pkm_serve.export import verify as V
from pkm_serve.export.saved_model_io import read_saved_model

ops.load_library()
GENRES, TITLES, K = 10, 300, 5


def _exports_and_generated_ids(src, signature, name, tmp_path):
    feed = F.signature_feeds(read_saved_model(src), signature).get(name, F.Feed())
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures[signature])
    ids = V.generate_inputs(specs, index_limit=GENRES, batch_size=16, feeds={name: feed})[name]
    rc = main([src, str(tmp_path / "out"), "--signatures", signature, "--quiet"])
    return feed, ids, rc


def test_ids_whose_scores_reach_an_inverted_lookup_are_row_ids(tmp_path):
    """Genre ids -> mean genre embedding -> scores over titles -> top 3 -> StringLookup(invert=True)."""
    genres = keras.Input((K,), dtype="int64", name="genres")
    query = keras.ops.mean(keras.layers.Embedding(GENRES, 8)(genres), axis=1)
    titles = keras.layers.Embedding(TITLES, 8)
    titles.build((None,))
    _, top = keras.ops.top_k(keras.ops.matmul(query, keras.ops.transpose(titles.embeddings)), 3)
    names = keras.layers.StringLookup(vocabulary=[f"t{i}" for i in range(TITLES - 1)], invert=True)(top)
    src = str(tmp_path / "sm")
    keras.Model(genres, names).export(src, verbose=False)
    feed, ids, rc = _exports_and_generated_ids(src, "serve", "genres", tmp_path)
    assert feed.int_keys == []
    assert ids.min() >= 0 and ids.max() < GENRES, ids
    assert rc == 0


class CodedBag(tf.Module):
    """Row ids -> int64 codes (a constant the ids index) -> StaticHashTable of codes -> bag."""

    def __init__(self):
        self.codes = tf.constant(np.arange(GENRES, dtype=np.int64) * 7 + 1001)
        init = tf.lookup.KeyValueTensorInitializer(self.codes, tf.range(GENRES, dtype=tf.int64))
        self.lookup = tf.lookup.StaticHashTable(init, default_value=0)
        self.table = tf.Variable(np.random.default_rng(0).standard_normal((GENRES, 4)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64)])
    def __call__(self, ids):
        rows = self.lookup.lookup(tf.gather(self.codes, ids))
        return {"bag": tf.reduce_sum(tf.gather(self.table, rows), axis=1)}


def test_ids_that_index_the_codes_a_table_looks_up_are_row_ids(tmp_path):
    module = CodedBag()
    src = str(tmp_path / "sm")
    tf.saved_model.save(module, src, signatures={"serving_default": module.__call__})
    feed, ids, rc = _exports_and_generated_ids(src, "serving_default", "ids", tmp_path)
    assert feed.int_keys == []
    assert ids.min() >= 0 and ids.max() < GENRES, ids
    assert rc == 0


def test_each_input_gets_the_keys_of_its_own_table(tmp_path):
    """Raw ids of two IntegerLookups, one of 3000 keys: the keys of every table were pooled and the
    first table past 2000 keys cut the pool, so the small table's ids were drawn from the big one's
    keys: the [0, rows) fifth alone hit it."""
    big_keys, small_keys = np.arange(5_000_000, 5_003_000), np.arange(1, 51)
    big, small = keras.Input((K,), dtype="int64", name="big"), keras.Input((K,), dtype="int64", name="small")
    bags = [keras.ops.sum(keras.layers.Embedding(len(keys) + 1, 4)(keras.layers.IntegerLookup(vocabulary=keys)(x)), 1)
            for x, keys in ((big, big_keys), (small, small_keys))]
    src = str(tmp_path / "sm")
    keras.Model([big, small], bags[0] + bags[1]).export(src, verbose=False)
    feeds = F.signature_feeds(read_saved_model(src), "serve")
    assert feeds["small"].int_keys == small_keys.tolist()
    assert set(feeds["big"].int_keys) <= set(big_keys.tolist()) and len(feeds["big"].int_keys) >= 1000
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures["serve"])
    ids = V.generate_inputs(specs, index_limit=51, batch_size=16, feeds=feeds)
    assert np.isin(ids["small"], small_keys).mean() >= 0.6 and np.isin(ids["big"], big_keys).mean() >= 0.6, ids


def test_each_string_input_gets_the_words_of_its_own_table(tmp_path):
    """User and movie ids of two StringLookups, 3000 users: the words of every string constant were
    pooled and cut at 2000, all of them user ids, so every movie id generated was out of vocabulary."""
    users, movies = [f"user_{i:04d}" for i in range(3000)], [f"movie_{i}" for i in range(40)]
    user, history = keras.Input((), dtype="string", name="user"), keras.Input((K,), dtype="string", name="history")
    parts = [keras.layers.Embedding(3001, 4)(keras.layers.StringLookup(vocabulary=users)(user)),
             keras.ops.sum(keras.layers.Embedding(41, 4)(keras.layers.StringLookup(vocabulary=movies)(history)), 1)]
    src = str(tmp_path / "sm")
    keras.Model([user, history], parts[0] + parts[1]).export(src, verbose=False)
    feeds = F.signature_feeds(read_saved_model(src), "serve")
    assert [w.decode() for w in feeds["history"].vocabulary] == sorted(movies)
    assert {w.decode() for w in feeds["user"].vocabulary} <= set(users)
    specs = V.signature_input_specs(tf.saved_model.load(src).signatures["serve"])
    cells = V.generate_inputs(specs, index_limit=41, batch_size=16, feeds=feeds)["history"]
    words = [c.decode() for c in cells.ravel() if c]
    assert np.isin(words, movies).mean() >= 0.6, cells


class SharedLookup(tf.Module):
    """One nested tf.function looking words up in the table handle it is passed, called with the user table
    for one input and the item table for the other (one concrete function, two call sites)."""

    def __init__(self, users, items):
        def table(words):
            keys = tf.constant(words)
            return tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
                keys, tf.range(1, len(words) + 1, dtype=tf.int64)), default_value=0)
        self.users, self.items = table(users), table(items)
        self.t = tf.Variable(np.random.default_rng(1).standard_normal((len(users) + len(items) + 1, 4))
                             .astype(np.float32))

    @tf.function
    def bag(self, handle, words):
        ids = tf.raw_ops.LookupTableFindV2(table_handle=handle, keys=words, default_value=tf.constant(0, tf.int64))
        return tf.reduce_sum(tf.gather(self.t, ids), axis=1)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.string)] * 2)
    def __call__(self, user, item):
        return {"out": self.bag(self.users.resource_handle, user) + self.bag(self.items.resource_handle, item)}


def test_each_call_site_of_a_shared_nested_function_gets_its_own_table_words(tmp_path):
    """The tables a nested function's arg is passed were pooled over its call sites: both inputs were fed
    user and item words alike. Each input now gets the words of the table its own call site passes."""
    users, items = [f"user_{i}" for i in range(6)], [f"item_{i}" for i in range(9)]
    module = SharedLookup(users, items)
    src = str(tmp_path / "sm")
    tf.saved_model.save(module, src, signatures={"serving_default": module.__call__})
    feeds = F.signature_feeds(read_saved_model(src), "serving_default")
    assert [w.decode() for w in feeds["user"].vocabulary] == sorted(users)
    assert [w.decode() for w in feeds["item"].vocabulary] == sorted(items)
