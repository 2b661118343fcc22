"""`--tflite` of a model with nothing to fuse (its bags already pkm_serve's op) that refuses the
generated verification inputs (row splits fed apart from their values): the SavedModel is copied
unchanged and not run, so the .tflite's verification was the first to run it, and TF's error came
out as "pkm-serve export: error: Graph execution error:" (an InvalidArgumentError, not an
ExportError). It is the one-line refusal the signature verification gives, naming --sample-inputs."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve.export import ExportError, export_saved_model

ops.load_library()


def _ragged_parts_model(path):
    module = tf.Module()
    module.table = tf.Variable(np.arange(40, dtype=np.float32).reshape(10, 4))
    specs = [tf.TensorSpec([None], tf.int32, name="ids"), tf.TensorSpec([None], tf.int64, name="splits")]
    module.bag = tf.function(lambda ids, splits: {"out": ops.embedding_bag(
        module.table, tf.RaggedTensor.from_row_splits(ids, splits), None)}, input_signature=specs)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.bag})


def test_generated_inputs_the_model_refuses_are_a_one_line_export_error(tmp_path):
    _ragged_parts_model(tmp_path / "m")
    with pytest.raises(ExportError) as err:
        export_saved_model(str(tmp_path / "m"), str(tmp_path / "dst"), tflite=str(tmp_path / "m.tflite"),
                           quiet=True)
    message = str(err.value)
    assert "--sample-inputs" in message and "'serving_default'" in message, message
    assert "valid RaggedTensor" in message and "\n" not in message, message   # TF's own words, one line
    np.savez(tmp_path / "in.npz", ids=np.array([1, 2, 3], np.int32), splits=np.array([0, 1, 3], np.int64))
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "dst"), tflite=str(tmp_path / "m.tflite"),
                                sample_inputs=str(tmp_path / "in.npz"), quiet=True)
    assert result.tflite["status"] == "verified with the pkm delegate"
