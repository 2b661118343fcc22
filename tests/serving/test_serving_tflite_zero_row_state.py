"""A 0-row Predict that the interpreter refuses (XNNPack cannot infer the PKM query's -1 from 0
elements) is answered from a one-row probe of the same shapes. That probe ran on the
request's own interpreter: for a model that assigns resource variables (here a count of the
rows it has read) the probe's row entered the state every later request reads, so a TFLite
version drifted from the SavedModel it was converted from at each empty request. The probe
of such a model now runs on an interpreter of its own. Reference: the same version's
SavedModel, request by request."""
import numpy as np
import pytest

D_MODEL = 32


@pytest.fixture(scope="module")
def counting_version_dir(tmp_path_factory, tf_with_ops):
    """The demo PKM read whose output also adds the number of rows read so far (a resource
    variable), as a SavedModel with its serving_default converted beside it."""
    tf = tf_with_ops
    from pkm_serve.serving.demo_model import PkmModel

    class RowCounting(PkmModel):
        def __init__(self):
            super().__init__(seed=36)
            self.rows_read = tf.Variable(0.0)

        def _serve(self, query):
            out = super()._serve(query)
            rows_read = self.rows_read.assign_add(tf.cast(tf.shape(query)[0], tf.float32))
            return {"output": out["output"] + rows_read, "slots": out["slots"]}

    path = str(tmp_path_factory.mktemp("counting") / "1")
    model = RowCounting()
    tf.saved_model.save(model, path, signatures={"serving_default": model.serve.get_concrete_function()})
    converter = tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=["serving_default"])
    converter.allow_custom_ops = True
    with open(f"{path}/model.tflite", "wb") as f:
        f.write(converter.convert())
    return path


def _servable(path, prefer_tflite):
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=prefer_tflite)("m", 1, path)
    loader.load()
    return loader


def test_empty_requests_leave_the_model_state_as_the_saved_model_leaves_it(counting_version_dir):
    saved, lite = _servable(counting_version_dir, False), _servable(counting_version_dir, True)
    try:
        assert lite.servable().runtime == "TFLite"
        query = np.random.default_rng(36).standard_normal((2, D_MODEL)).astype(np.float32)
        for rows in (1, 0, 2, 0, 0, 1):
            want = saved.servable().signature("serving_default").run({"query": query[:rows]})
            got = lite.servable().signature("serving_default").run({"query": query[:rows]})
            assert got["output"].shape == want["output"].shape == (rows, 64)
            np.testing.assert_array_equal(got["slots"], want["slots"])
            np.testing.assert_allclose(got["output"], want["output"], rtol=1e-5, atol=1e-5)
    finally:
        lite.unload()
        saved.unload()


def test_only_a_model_that_assigns_variables_gets_a_probe_interpreter(counting_version_dir, tmp_path):
    from pkm_serve.serving.demo_model import save_pkm_model
    from pkm_serve.serving.tflite_pool import assigns_resource_variables
    import tensorflow as tf
    with open(f"{counting_version_dir}/model.tflite", "rb") as f:
        assert assigns_resource_variables(f.read())
    plain = save_pkm_model(str(tmp_path / "plain"), seed=36)
    converter = tf.lite.TFLiteConverter.from_saved_model(plain, signature_keys=["serving_default"])
    converter.allow_custom_ops = True
    assert not assigns_resource_variables(converter.convert())
