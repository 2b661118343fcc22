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


@pytest.fixture(scope="module")
def read_and_update_tflite(tf_with_ops, tmp_path_factory):
    """A .tflite of 'serving_default' (x * v[0] + v[1], subgraph 0) and 'update' (assigns v, in
    a loop): besides 'update', only the session initialiser (CALL_ONCE's subgraph, run once)
    assigns v."""
    tf = tf_with_ops

    class ReadAndUpdate(tf.Module):
        def __init__(self):
            self.v = tf.Variable(np.arange(8, dtype=np.float32).reshape(2, 4))

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def read(self, x):
            return {"y": x * self.v[0] + self.v[1]}

        @tf.function(input_signature=[tf.TensorSpec([2, 4], tf.float32, name="new")])
        def update(self, new):   # (the assignment in a WHILE's body: a subgraph 'update' calls)
            def assign_once(i):
                self.v.assign(new)
                return i + 1
            (done,) = tf.while_loop(lambda i: i < 1, assign_once, [tf.constant(0)])
            return {"done": done}

    module, path = ReadAndUpdate(), str(tmp_path_factory.mktemp("read_and_update") / "saved")
    tf.saved_model.save(module, path, signatures={"serving_default": module.read, "update": module.update})
    return tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=["serving_default", "update"]).convert()


def test_a_model_whose_requests_assign_nothing_gets_no_probe_interpreter(read_and_update_tflite, tmp_path):
    """Served from its signature_defs_metadata (the primary subgraph alone, as upstream), the
    model's requests assign nothing: only the initialiser and the unserved 'update' do. It got
    a probe interpreter all the same (a second copy of the activations and the CALL_ONCE run).
    Served from the converter's signatures, 'update' is a request: it keeps its probe."""
    from tensorflow.core.protobuf import meta_graph_pb2
    from pkm_serve import tflite
    from tests.serving.test_serving_tflite_signatures import _with_signature_defs_metadata
    interp = tflite.make_interpreter(read_and_update_tflite)
    (x,), (y,) = interp.get_input_details(), interp.get_output_details()
    sdef = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    sdef.inputs["x"].name, sdef.outputs["y"].name = x["name"], y["name"]
    with_metadata = _with_signature_defs_metadata(read_and_update_tflite, {"serving_default": sdef.SerializeToString()})
    for name, blob, wants_probe in (("signatures", read_and_update_tflite, True), ("metadata", with_metadata, False)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.tflite").write_bytes(blob)
        loader = _servable(str(tmp_path / name / "1"), True)
        try:
            assert (loader.servable()._pool._make_probe is not None) == wants_probe, name
            signature = loader.servable().signature("serving_default")
            for rows in (2, 0, 1):
                value = np.arange(4 * rows, dtype=np.float32).reshape(rows, 4)
                want = value.astype(np.float64) * np.arange(4) + np.arange(4, 8)
                np.testing.assert_array_equal(signature.run({"x": value})["y"], want)
        finally:
            loader.unload()
