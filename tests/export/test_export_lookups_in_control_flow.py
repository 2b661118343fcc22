"""[batch, K] item-id strings looked up in a StaticHashTable inside tf.cond or tf.map_fn (a While): the
verification followed the input only through function calls, never into an If's branches or a While's
body, so it found no lookup and fed text (1-6 words per cell: every multi-word cell one unknown key).
Now If/Case branches and While bodies are followed, for the input and for the table handle, and each
cell is one of the table's words (or padding, or an out-of-vocabulary word). Items normalised inside
tf.cond / tf.map_fn and looked up after it are followed out of the If / While too (following the branches
alone, that lookup was lost and they got text again, as they had not before the branches were followed),
and so are items normalised by a nested tf.function (a call was followed only into its function)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export.feeds import signature_feeds
from pkm_serve.export.saved_model_io import read_saved_model
from pkm_serve.export.verify import generate_inputs, signature_input_specs

WORDS = [b"item%d" % i for i in range(50)]
_strip = tf.function(tf.strings.strip)  # saved as a call (StatefulPartitionedCall) of its own function
LOOKUPS = {
    "cond": lambda table, items: tf.cond(tf.size(items) > 0, lambda: table.lookup(items),
                                         lambda: tf.fill(tf.shape(items), tf.constant(-1, tf.int64))),
    "map_fn": lambda table, items: tf.map_fn(table.lookup, items, fn_output_signature=tf.int64),
    "lookup_after_cond": lambda table, items: table.lookup(
        tf.cond(tf.size(items) > 0, lambda: tf.strings.strip(items), lambda: items)),
    "lookup_after_map_fn": lambda table, items: table.lookup(tf.map_fn(tf.strings.strip, items)),
    "lookup_after_nested_function": lambda table, items: table.lookup(_strip(items)),
}


@pytest.mark.parametrize("form", sorted(LOOKUPS))
def test_items_looked_up_inside_control_flow_are_fed_the_table_words(tmp_path, form):
    module = tf.Module()
    module.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(WORDS), tf.range(len(WORDS), dtype=tf.int64)), -1)
    module.rows = tf.Variable(tf.ones([len(WORDS), 4]))

    def bag(items):
        ids = LOOKUPS[form](module.table, items)
        return {"y": tf.reduce_sum(tf.gather(module.rows, tf.maximum(ids, 0)) * tf.cast(
            ids >= 0, tf.float32)[..., None], axis=1)}
    f = tf.function(input_signature=[tf.TensorSpec([None, 4], tf.string)])(bag)
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": f})
    feeds = signature_feeds(read_saved_model(str(tmp_path / "m")), "serving_default")
    specs = signature_input_specs(tf.saved_model.load(str(tmp_path / "m")).signatures["serving_default"])
    cells = [c for c in generate_inputs(specs, 50, 64, feeds=feeds)["items"].ravel() if c]
    hits = np.mean([c in set(WORDS) for c in cells])
    assert 0.6 < hits < 1.0, (hits, cells[:5])  # mostly the table's words, some out of vocabulary
