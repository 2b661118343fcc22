"""A Predict of 0 rows on a version served from its model.tflite: the SavedModel answers
outputs of 0 rows, while LiteRT's XNNPack delegate refused the interpreter's resize to 0
rows wherever a reshape infers a -1 (the PKM read's [B, 1, 2, -1] query): INVALID_ARGUMENT
"XNNPack delegate failed to reshape". Now a refused request of 0 rows is answered with
empty outputs of the dtypes and other dimensions a one-row run of the same shapes gives, and
refused where that run is refused too (weights unlike the ids). Reference: the same
version's SavedModel."""
import grpc
import numpy as np
import pytest

from pkm_serve.serving.errors import ServingError

D_MODEL = 32


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory, tf_with_ops):
    """A fused PKM SavedModel with its serving_default converted beside it to model.tflite."""
    from pkm_serve.serving.demo_model import save_pkm_model
    path = str(tmp_path_factory.mktemp("empty") / "1")
    save_pkm_model(path, seed=5)
    converter = tf_with_ops.lite.TFLiteConverter.from_saved_model(path, signature_keys=["serving_default"])
    converter.allow_custom_ops = True
    with open(f"{path}/model.tflite", "wb") as f:
        f.write(converter.convert())
    return path


def _servable(path, prefer_tflite, **kwargs):
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=prefer_tflite, **kwargs)("m", 1, path)
    loader.load()
    return loader


@pytest.mark.parametrize("per_pool", [1, 2])
def test_zero_rows_are_answered_like_the_saved_model(version_dir, per_pool):
    saved = _servable(version_dir, False)
    lite = _servable(version_dir, True, num_tflite_interpreters=2,
                     tflite_interpreters_per_pool=per_pool)
    try:
        assert lite.servable().runtime == "TFLite"
        for rows in (0, 3, 0):   # (the pool's interpreters still run rows after a 0-row request)
            query = np.random.default_rng(rows).standard_normal((rows, D_MODEL)).astype(np.float32)
            want = saved.servable().signature("serving_default").run({"query": query})
            got = lite.servable().signature("serving_default").run({"query": query})
            assert sorted(got) == sorted(want) == ["output", "slots"]
            for key in want:
                assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
            np.testing.assert_array_equal(got["slots"], want["slots"])
            np.testing.assert_allclose(got["output"], want["output"], rtol=1e-5, atol=1e-6)
    finally:
        lite.unload()
        saved.unload()


def test_a_refused_request_with_rows_is_still_refused(version_dir):
    """Only a request of 0 rows is answered without the interpreter: one of the wrong width
    keeps LiteRT's refusal."""
    lite = _servable(version_dir, True)
    try:
        with pytest.raises(ServingError) as err:
            lite.servable().signature("serving_default").run({"query": np.ones((2, D_MODEL + 1), np.float32)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ServingError) as err:
            lite.servable().signature("serving_default").run({"query": np.ones((0, D_MODEL + 1), np.float32)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        lite.unload()


@pytest.fixture(scope="module")
def bag_version_dir(tmp_path_factory, tf_with_ops):
    """ids [-1, -1] and weights [-1, -1] -> a mean bag reshaped [B, 2, -1] (0 rows: XNNPack refuses
    the -1) and back to [-1, 6] (an output whose other dimension is declared), as a SavedModel
    with model.tflite beside it."""
    tf = tf_with_ops
    from pkm_serve import ops
    table = np.random.default_rng(6).standard_normal((30, 6)).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="ids"),
                                  tf.TensorSpec([None, None], tf.float32, name="w")])
    def serve(ids, w):
        bags = ops.embedding_bag(tf.constant(table), ids, w, combiner="mean")
        return {"out": tf.reshape(tf.reshape(bags, [tf.shape(ids)[0], 2, -1]), [-1, 6])}
    path = str(tmp_path_factory.mktemp("bags") / "1")
    tf.saved_model.save(tf.Module(), path, signatures={"serving_default": serve})
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()])
    converter.allow_custom_ops = True
    with open(f"{path}/model.tflite", "wb") as f:
        f.write(converter.convert())
    return path


def test_zero_rows_of_mismatched_inputs_are_refused_as_the_saved_model_refuses_them(bag_version_dir):
    saved, lite = _servable(bag_version_dir, False), _servable(bag_version_dir, True)
    try:
        ids, weights = np.zeros((0, 3), np.int32), np.zeros((0, 3), np.float32)
        for runtime in (saved, lite):
            (got,) = runtime.servable().signature("serving_default").run({"ids": ids, "w": weights}).values()
            assert got.shape == (0, 6) and got.dtype == np.float32, runtime.servable().runtime
        for runtime in (saved, lite):
            with pytest.raises(ServingError) as err:
                runtime.servable().signature("serving_default").run({"ids": ids, "w": np.zeros((0, 4), np.float32)})
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "weights must have the shape of indices [0, 3], got [0, 4]" in err.value.message
    finally:
        lite.unload()
        saved.unload()
