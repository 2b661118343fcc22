"""Raw text split into words and looked up in a table of its own (two text inputs, two vocabularies): the
verification fed every text input words of one pooled vocabulary, the first 2000 sorted string constants of
the whole model, so text_b (looked up in a 100-word table whose words sort after table A's 2100) was all
out-of-vocabulary words, and its bag read only the default row. Each text input now gets the words of the
tables its tokens are looked up in."""
import numpy as np
import tensorflow as tf

from pkm_serve.export.feeds import signature_feeds
from pkm_serve.export.saved_model_io import read_saved_model
from pkm_serve.export.verify import generate_inputs, signature_input_specs

WORDS_A = [b"a%04d" % i for i in range(2100)]
WORDS_B = [b"zb%d" % i for i in range(100)]


def _table(words):
    return tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(words), tf.range(len(words), dtype=tf.int64)), -1)


def _bag(text, table, rows):
    ids = table.lookup(tf.strings.split(text))
    return tf.reduce_sum(tf.gather(rows, tf.maximum(ids, 0)) * tf.cast(ids >= 0, tf.float32)[..., None], axis=1)


def test_each_text_input_gets_the_words_of_its_own_table(tmp_path):
    module = tf.Module()
    module.a, module.b = _table(WORDS_A), _table(WORDS_B)
    module.ta, module.tb = tf.Variable(tf.ones([len(WORDS_A), 4])), tf.Variable(tf.ones([len(WORDS_B), 4]))
    f = tf.function(input_signature=[tf.TensorSpec([None], tf.string)] * 2)(
        lambda text_a, text_b: {"y": _bag(text_a, module.a, module.ta) + _bag(text_b, module.b, module.tb)})
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    feeds = signature_feeds(read_saved_model(str(tmp_path / "m")), "serving_default")
    specs = signature_input_specs(tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"])
    inputs = generate_inputs(specs, 100, 64, feeds=feeds)
    for name, known in (("text_a", WORDS_A), ("text_b", WORDS_B)):
        words = [w for text in inputs[name] for w in text.split()]
        hits = np.mean([w in set(known) for w in words])
        assert hits > 0.6, (name, hits, words[:5])
