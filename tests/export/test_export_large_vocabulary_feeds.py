"""A StaticHashTable of many item ids: working out the verification feeds decoded every word of its key
constant into Python bytes and sorted them all (1M words: 1.7 s and 76 MB, every export, for the 2000 words
kept). Now only the first words are decoded, and the feed is the table's first 2000 distinct words, in
table order. Checked by the memory the feeds take, which grows with the words decoded (no clock)."""
import tracemalloc

import numpy as np
import tensorflow as tf

from pkm_serve.export.feeds import signature_feeds
from pkm_serve.export.saved_model_io import read_saved_model

WORDS = np.char.add(b"item", np.arange(250_000).astype(bytes))
# Decoded whole, the words take ~40 bytes each as Python bytes (~10 MB here, 19 MB peak measured); the
# feeds of the first 2000 words took under 2 MB.
PEAK_BYTES = 5_000_000


def test_feeds_of_a_large_table_decode_only_its_first_words(tmp_path):
    module = tf.Module()
    module.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(WORDS), tf.range(len(WORDS), dtype=tf.int64)), -1)
    module.rows = tf.Variable(tf.ones([1000, 4]))
    f = tf.function(input_signature=[tf.TensorSpec([None, 4], tf.string)])(
        lambda items: {"y": tf.reduce_sum(tf.gather(module.rows, module.table.lookup(items) % 1000), axis=1)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    proto = read_saved_model(str(tmp_path / "m"))
    tracemalloc.start()
    try:
        feed = signature_feeds(proto, "serving_default")["items"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{peak / 1e6:.1f} MB: the table's words were decoded whole"
    assert feed.tokens and feed.vocabulary == sorted(WORDS[:2000].tolist())
