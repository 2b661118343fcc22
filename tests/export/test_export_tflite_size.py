"""`--tflite`'s 2 GB check counts the variables the converted signatures read, each once.

Keras 3's `model.export` saves every variable twice in the checkpoint (under `variables/` and
`_all_variables/`), and a checkpoint can hold variables no signature reads (optimizer slots):
the converter makes constants of neither. Counting the whole checkpoint refused a Keras model
whose 1.07 GiB table converts to a 1.07 GiB `.tflite` ("the model's variables take 2.14 GiB")."""
import os
import sys

import numpy as np
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import export_saved_model, tflite_export

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

ops.load_library()


def test_keras_export_counts_each_variable_once(tmp_path):
    M.keras_embedding_pooling(str(tmp_path / "m"))
    head_bytes = (M.D * 3 + 3) * 4
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "dst"),
                                tflite=str(tmp_path / "m.tflite"), quiet=True)
    assert result.tflite["table_bytes_in_savedmodel"] == M.N * M.D * 4 + head_bytes
    assert result.tflite["table_bytes_in_savedmodel"] <= os.path.getsize(tmp_path / "m.tflite")


def test_variables_no_converted_signature_reads_are_not_counted(tmp_path):
    module = tf.Module()
    module.table = tf.Variable(np.ones((M.N, M.D), np.float32))
    module.unread = tf.Variable(np.ones((1000, M.D), np.float32))  # e.g. an optimizer slot
    spec = tf.TensorSpec([None, M.K], tf.int32)
    module.bag = tf.function(lambda ids: tf.reduce_sum(tf.gather(module.table, ids), axis=1),
                             input_signature=[spec])
    module.other = tf.function(lambda ids: tf.reduce_sum(tf.gather(module.unread, ids), axis=1),
                               input_signature=[spec])
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"bag": module.bag, "other": module.other})
    path = str(tmp_path / "m")
    assert tflite_export.variable_bytes(path, ["bag"]) == M.N * M.D * 4
    assert tflite_export.variable_bytes(path, ["bag", "other"]) == (M.N + 1000) * M.D * 4


def test_a_tf1_saved_model_counts_every_variable(tmp_path):
    # No object graph says what a TF1 signature captures (read_saved_model refuses it as unfusable).
    path = str(tmp_path / "tf1")
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        ids = tf.compat.v1.placeholder(tf.int32, [None, M.K])
        table = tf.compat.v1.get_variable("table", initializer=np.ones((M.N, M.D), np.float32))
        tf.compat.v1.get_variable("unread", initializer=np.ones((7, M.D), np.float32))
        session.run(tf.compat.v1.global_variables_initializer())
        builder = tf.compat.v1.saved_model.Builder(path)
        signature = tf.compat.v1.saved_model.predict_signature_def(
            {"ids": ids}, {"out": tf.reduce_sum(tf.gather(table, ids), 1)})
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={"serving_default": signature})
        builder.save()
    assert tflite_export.variable_bytes(path, ["serving_default"]) == (M.N + 7) * M.D * 4
