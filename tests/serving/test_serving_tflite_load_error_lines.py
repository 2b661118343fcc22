"""A .tflite version whose kernels refuse the converter's own shapes (a [-1] input reshaped to
[-1, 4]: one element at the converter's batch of 1) fails its load when the tensors are
allocated. The runtime's messages of that refusal came glued in the load error (GetModelStatus'
error_message, the log): "XNNPack delegate failed to reshape runtimeNode number 2 ...". Each
message is now its own, as a request's refusal reports them (tflite.runtime_messages)."""
import re

import grpc
import pytest

from pkm_serve.serving.errors import ServingError


@pytest.fixture(scope="module")
def refused_version_dir(tmp_path_factory, tf_with_ops):
    tf = tf_with_ops
    module = tf.Module()
    module.serve = tf.function(lambda x: {"r": tf.reshape(x, [-1, 4])},
                               input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    path = str(tmp_path_factory.mktemp("refused_load") / "1")
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    with open(f"{path}/model.tflite", "wb") as f:
        f.write(tf.lite.TFLiteConverter.from_saved_model(path).convert())
    return path


def test_a_refused_load_reports_each_runtime_message_on_its_own(refused_version_dir):
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("m", 1, refused_version_dir)
    with pytest.raises(ServingError) as err:
        loader.load()
    message = err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert "cannot load" in message and "Node number" in message, message
    # Every runtime message starts the reason or follows the separator, none runs into another.
    assert not re.search(r"[^ ]Node number \d+ \(", message), message
    assert "\n" not in message, message
