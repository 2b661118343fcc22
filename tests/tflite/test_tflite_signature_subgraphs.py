"""A .tflite of several signatures keeps each in a subgraph of its own, and allocate_tensors()
prepares the primary one only. A custom op no runtime has a kernel for in another signature
(here the second signature's bag op renamed BogusOp) went unnoticed: `pkm-serve tflite` printed
the plan and exited 0, and the server loaded the version and refused every request to that
signature as INVALID_ARGUMENT "rejected the inputs". Both now prepare every signature's
subgraph: the CLI exits 1 and the load fails, naming the signature. The same model with the
op's own name still loads and runs that signature, although its kernel refuses the shapes the
subgraph is prepared at (ids [-1, -1] and weights [-1, 3] are [1, 1] and [1, 3]): only a node
without a kernel fails the load (numpy float64 reference)."""
import grpc
import numpy as np
import pytest

from pkm_serve import tflite, tflite_cli

TABLE = np.random.default_rng(36).standard_normal((40, 6)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"good", "bogus"}: version dirs holding a two-signature model.tflite, 'aaa' (x * 2 + 1)
    in subgraph 0 and 'zzz' (a weighted mean bag through the PkmEmbeddingBag custom op) in
    subgraph 1."""
    import flatbuffers
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    module = tf.Module()
    module.aaa = tf.function(lambda x: {"y": x * 2.0 + 1.0},
                             input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    module.zzz = tf.function(
        lambda ids, w: {"out": ops.embedding_bag(tf.constant(TABLE), ids, w, combiner="mean")},
        input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids"),
                         tf.TensorSpec([None, 3], tf.float32, name="w")])
    root = tmp_path_factory.mktemp("signature_subgraphs")
    saved = str(root / "saved")
    tf.saved_model.save(module, saved, signatures={"aaa": module.aaa, "zzz": module.zzz})
    converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=["aaa", "zzz"])
    converter.allow_custom_ops = True
    good = converter.convert()
    schema = tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(good), 0))
    assert [(s.signatureKey, s.subgraphIndex) for s in model.signatureDefs] == [(b"aaa", 0), (b"zzz", 1)]
    for code in model.operatorCodes:
        if code.customCode:
            code.customCode = b"BogusOp"
    builder = flatbuffers.Builder(1 << 16)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    paths = {}
    for name, blob in (("good", good), ("bogus", bytes(builder.Output()))):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.tflite").write_bytes(blob)
        paths[name] = str(root / name / "1")
    return paths


def test_the_cli_refuses_an_op_without_a_kernel_in_another_signature(models, capsys):
    assert tflite_cli.console_main([f"{models['bogus']}/model.tflite"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pkm-serve tflite: error: signature 'zzz' (subgraph 1): "
                          "Encountered unresolved custom op: BogusOp."), err
    assert tflite_cli.console_main([f"{models['good']}/model.tflite"]) == 0


def test_the_server_refuses_to_load_it(models):
    from pkm_serve.serving.errors import ServingError
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("m", 1, models["bogus"])
    with pytest.raises(ServingError) as err:
        loader.load()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "signature 'zzz' (subgraph 1): Encountered unresolved custom op: BogusOp" in err.value.message


def _reference(ids, w):
    table, out = TABLE.astype(np.float64), np.zeros((len(ids), TABLE.shape[1]))
    for b, (row, weights) in enumerate(zip(ids, w)):
        kept = row >= 0
        if kept.any():
            out[b] = (table[row[kept]] * weights[kept, None]).sum(axis=0) / weights[kept].sum()
    return out


def test_the_other_signature_still_loads_and_runs(models):
    from pkm_serve.serving.loader import make_loader_factory
    ids = np.array([[0, 39, -1], [5, 5, 7], [-1, -1, -1]], np.int64)
    w = np.array([[1.0, 0.5, 2.0], [0.25, 1.0, 3.0], [1.0, 1.0, 1.0]], np.float32)
    interp = tflite.make_interpreter(f"{models['good']}/model.tflite")
    interp.allocate_tensors()
    tflite.allocate_signature_subgraphs(interp)
    np.testing.assert_allclose(interp.get_signature_runner("zzz")(ids=ids, w=w)["out"],
                               _reference(ids, w), rtol=1e-5, atol=1e-6)
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("m", 1, models["good"])
    loader.load()
    try:
        got = loader.servable().signature("zzz").run({"ids": ids, "w": w})["out"]
        np.testing.assert_allclose(got, _reference(ids, w), rtol=1e-5, atol=1e-6)
    finally:
        loader.unload()


@pytest.mark.parametrize("interpreter", ["litert", "tf"])
def test_run_tflite_runs_another_signature_by_its_key(models, interpreter):
    """run_tflite ran the primary subgraph only: 'zzz' of this model could not be run through it
    (its inputs were "unknown"). signature_key= runs it, inputs by name or in its runner's order."""
    path = f"{models['good']}/model.tflite"
    ids = np.array([[0, 39, -1], [5, 5, 7]], np.int64)
    w = np.array([[1.0, 0.5, 2.0], [0.25, 1.0, 3.0]], np.float32)
    for inputs in ({"ids": ids, "w": w}, [ids, w]):
        (out,) = tflite.run_tflite(path, inputs, interpreter=interpreter, signature_key="zzz")
        np.testing.assert_allclose(out, _reference(ids, w), rtol=1e-5, atol=1e-6)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    (y,) = tflite.run_tflite(path, {"x": x}, interpreter=interpreter, signature_key="aaa")
    np.testing.assert_array_equal(y, x.astype(np.float64) * 2 + 1)
    with pytest.raises(ValueError, match=r"signature\(s\) \['zzz'\] take \['ids', 'w'\]: run one with signature_key="):
        tflite.run_tflite(path, {"ids": ids, "w": w}, interpreter=interpreter)
    with pytest.raises(ValueError, match=r"signature_key 'bbb' is not a signature of the model; its signatures: \['aaa', 'zzz'\]"):
        tflite.run_tflite(path, [ids, w], interpreter=interpreter, signature_key="bbb")
    with pytest.raises(ValueError, match=r"signature 'zzz' takes inputs \['ids', 'w'\]; unknown \['x'\], missing \['w'\]"):
        tflite.run_tflite(path, {"ids": ids, "x": w}, interpreter=interpreter, signature_key="zzz")
    with pytest.raises(ValueError, match="do not fit"):   # ids past int64, as the primary path refuses them
        tflite.run_tflite(path, {"ids": ids.astype(np.uint64) + 2 ** 63, "w": w}, interpreter=interpreter,
                          signature_key="zzz")
