"""`pkm-serve export --tflite DST/<v>/model.tflite --warmup-requests N` of a Keras model,
served with `--prefer_tflite_model`: what a TF Serving user of that version sees.

Keras' export writes one function under two signature keys, `serve` and `serving_default`;
the TFLite converter writes one signature per function (`serving_default`). The references are the
SavedModel's own signatures and numpy float64."""
import numpy as np
import pytest

N, D, K, CLASSES = 40, 8, 5, 3


@pytest.fixture(scope="module")
def keras_export(tmp_path_factory, tf_with_ops):
    """(version directory, SavedModel source, numpy reference, ExportResult) of a Keras
    Embedding -> mean pooling -> Dense model exported with a .tflite and warmup records."""
    import keras
    from pkm_serve.export.exporter import export_saved_model
    root = tmp_path_factory.mktemp("keras_tflite")
    rng = np.random.default_rng(3)
    table = rng.standard_normal((N, D)).astype(np.float32)
    ids = keras.Input(shape=(K,), dtype="int32", name="ids")
    emb = keras.layers.Embedding(N, D)
    head = keras.layers.Dense(CLASSES)
    model = keras.Model(ids, head(keras.layers.GlobalAveragePooling1D()(emb(ids))))
    emb.embeddings.assign(table)
    src = str(root / "src")
    model.export(src, format="tf_saved_model", verbose=False)
    kernel, bias = (w.numpy().astype(np.float64) for w in head.weights)
    dst = root / "model"
    result = export_saved_model(src, str(dst), version=1, tflite=str(dst / "1" / "model.tflite"),
                                warmup_requests=2, quiet=True)

    def reference(x):
        return table.astype(np.float64)[x].mean(axis=1) @ kernel + bias
    return str(dst / "1"), src, reference, result


def _warmup_keys(path):
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2
    keys = []
    for record in tf.data.TFRecordDataset(f"{path}/assets.extra/tf_serving_warmup_requests"):
        log = prediction_log_pb2.PredictionLog.FromString(record.numpy())
        keys.append(log.predict_log.request.model_spec.signature_name)
    return keys


def _misaligned_buffers(model):
    """Indices of the constant tensors' buffers of 16 bytes or more whose data does not start
    on the 16 bytes the converter aligns them to (tables are read in place)."""
    from pkm_serve import tflite
    m = tflite.flatbuffer_schema().Model.GetRootAsModel(model, 0)
    constants = {m.Subgraphs(s).Tensors(t).Buffer() for s in range(m.SubgraphsLength())
                 for t in range(m.Subgraphs(s).TensorsLength())}
    out = []
    for i in sorted(constants):
        buf = m.Buffers(i)
        if buf.DataLength() >= 16 and buf._tab.Vector(buf._tab.Offset(4)) % 16:   # noqa: SLF001
            out.append(i)
    return out


def test_keras_export_with_warmup_serves_from_the_tflite(keras_export, tf_with_ops):
    """The .tflite holds `serving_default` only (the converter writes Keras' `serve`, the same
    function, once) while the warmup file held records for `serve` too: the TFLite version
    failed its load (`Serving signature name: "serve" not found`). Now the export writes
    records only for keys the .tflite holds, and the .tflite keeps the converter's one
    signature (a device's get_signature_runner() without a key runs it)."""
    from pkm_serve import tflite
    from pkm_serve.serving.loader import make_loader_factory
    from pkm_serve.export.exporter import format_report
    path, src, reference, result = keras_export
    assert _warmup_keys(path) == ["serving_default"] * 2
    assert "warmup: no requests for signature 'serve': the .tflite does not hold it" in format_report(result)
    x = np.random.default_rng(4).integers(0, N, size=(6, K)).astype(np.int32)
    model = open(f"{path}/model.tflite", "rb").read()
    interp = tflite.make_interpreter(model)
    assert list(interp.get_signature_list()) == ["serving_default"]
    assert _misaligned_buffers(model) == []   # (a re-pack of the converter's file lost this)
    device = next(iter(interp.get_signature_runner()(ids=x).values()))
    np.testing.assert_allclose(device, reference(x), rtol=1e-5, atol=1e-5)
    saved = tf_with_ops.saved_model.load(src)
    for prefer_tflite, runtime in ((True, "TFLite"), (False, "TF")):
        loader = make_loader_factory(warmup=True, prefer_tflite_model=prefer_tflite)("keras", 1, path)
        loader.load()
        try:
            servable = loader.servable()
            assert servable.runtime == runtime
            (out_key,) = servable.signature_defs["serving_default"].outputs
            got = servable.signature("serving_default").run({"ids": x})[out_key]
            want = next(iter(saved.signatures["serving_default"](ids=x).values())).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got, reference(x), rtol=1e-5, atol=1e-5)
        finally:
            loader.unload()
