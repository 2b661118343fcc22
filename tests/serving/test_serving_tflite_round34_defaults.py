"""SignatureDef defaults (tf.function default arguments) and `pkm-serve export --tflite`: a
TFLite SignatureDef has no defaults (the converter drops them; TF Serving's TFLite servable
has none), so the .tflite version needs every input where the SavedModel version of the same
export feeds the defaults. The export now says so in its report. References: the SavedModel
version's answers and numpy float64."""
import grpc
import numpy as np
import pytest

from pkm_serve.serving.errors import ServingError

SCALE = 2.5
TABLE = np.random.default_rng(34).standard_normal((20, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tf_with_ops):
    import tensorflow as tf
    from pkm_serve.export.exporter import export_saved_model

    class Model(tf.Module):
        def __init__(self):
            self.table = tf.Variable(TABLE)

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([], tf.float32)])
        def serve(self, ids, scale=tf.constant(SCALE)):
            return {"y": tf.reduce_sum(tf.gather(self.table, ids), axis=1) * scale}
    root = tmp_path_factory.mktemp("tflite_defaults")
    model = Model()
    tf.saved_model.save(model, str(root / "src"), signatures={"serving_default": model.serve})
    result = export_saved_model(str(root / "src"), str(root / "dst"), version=1,
                                tflite=str(root / "dst" / "1" / "model.tflite"), quiet=True)
    return result


def test_export_report_says_the_tflite_drops_the_defaults(exported):
    from pkm_serve.export.exporter import format_report
    assert "signature 'serving_default' input(s) ['scale'] have defaults, which a .tflite cannot hold" \
        in exported.tflite["status"]
    assert "needs them in every request" in format_report(exported)


def test_tflite_version_needs_the_input_the_savedmodel_defaults(exported):
    from pkm_serve.serving.servable import Servable
    from pkm_serve.serving.tflite_servable import TfLiteServable
    ids = np.array([[1, 2, 3], [0, 0, 19]], np.int32)
    want = TABLE.astype(np.float64)[ids].sum(axis=1)
    saved, lite = Servable("m", 1, exported.dst, warmup=False), TfLiteServable("m", 1, exported.dst, warmup=False)
    try:
        sig = saved.signature("")
        np.testing.assert_allclose(sig.run(sig.with_defaults({"ids": ids}))["y"], want * SCALE, rtol=1e-5, atol=1e-5)
        sig = lite.signature("")
        with pytest.raises(ServingError) as err:
            sig.validate(sig.with_defaults({"ids": ids}))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "missing input(s) ['scale']" in err.value.message
        got = sig.run({"ids": ids, "scale": np.float32(-1.0)})["y"]
        np.testing.assert_allclose(got, -want, rtol=1e-5, atol=1e-5)
    finally:
        saved.release()
        lite.release()
