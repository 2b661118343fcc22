"""A Predict of 0 rows on a version served from its model.tflite: the SavedModel answers
outputs of 0 rows, while LiteRT's XNNPack delegate refused the interpreter's resize to 0
rows wherever a reshape infers a -1 (the PKM read's [B, 1, 2, -1] query): INVALID_ARGUMENT
"XNNPack delegate failed to reshape". Now a refused request of 0 rows is answered with
empty outputs of the signature's dtypes and other dimensions. Reference: the same
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
