"""A request whose input shape does not fit the .tflite's signature (another rank, or another
fixed dimension) is resized into the interpreter as upstream's TfLiteSession resizes it; where
the kernels then refuse it, the refusal was XNNPack's "failed to reshape runtime", naming no
input. The INVALID_ARGUMENT now also names the input, its shape and the signature's."""
import grpc
import numpy as np
import pytest

from pkm_serve.serving.errors import ServingError

TABLE = np.random.default_rng(36).standard_normal((20, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory, tf_with_ops):
    """The stock gather * weights -> reduce_sum bag over [-1, 4] ids and weights, as a
    SavedModel with model.tflite beside it."""
    tf = tf_with_ops
    module = tf.Module()
    module.serve = tf.function(
        lambda ids, w: {"out": tf.reduce_sum(tf.gather(tf.constant(TABLE), ids) * w[..., None], axis=-2)},
        input_signature=[tf.TensorSpec([None, 4], tf.int32, name="ids"),
                         tf.TensorSpec([None, 4], tf.float32, name="w")])
    path = str(tmp_path_factory.mktemp("shape_notes") / "1")
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    with open(f"{path}/model.tflite", "wb") as f:
        f.write(tf.lite.TFLiteConverter.from_saved_model(path).convert())
    return path


@pytest.fixture(scope="module")
def signature(version_dir):
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("m", 1, version_dir)
    loader.load()
    assert loader.servable().runtime == "TFLite"
    yield loader.servable().signature("serving_default")
    loader.unload()


@pytest.mark.parametrize("shape, note", [
    ((1, 2, 2), "input 'ids' has rank 3, shape [1, 2, 2]; the signature takes [-1, 4]"),
    ((2, 2), "input 'ids' has shape [2, 2]; the signature takes [-1, 4]"),
])
def test_a_refused_shape_names_the_input_and_the_signatures_shape(signature, shape, note):
    with pytest.raises(ServingError) as err:
        signature.run({"ids": np.zeros(shape, np.int32), "w": np.ones(shape, np.float32)})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.endswith(f"({note})"), err.value.message
