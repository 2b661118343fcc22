"""Two gaps in preparing every signature's subgraph at load (tflite.allocate_signature_subgraphs).

A TensorFlow (Flex) op, which the Python runtimes have no kernel for without the Flex delegate,
in a signature other than the primary one was taken for a refusal of the converter's shapes and
left to the calls: `pkm-serve tflite` printed the plan with exit 0 and the server loaded the
version, refusing every request to that signature, where a custom op without a kernel there, or
the Flex op in the primary signature, fails both. Now both fail, naming the signature and
giving the runtime's refusal of that signature's first call (a fresh interpreter's: the
reference).

A refusal left to the calls stays in the runtime's error text, which is every message reported
so far: the first refused request of each interpreter was answered with the load's refusal
("weights must have the shape of indices [1, 1], got [1, 3]", of shapes the client never sent)
before its own. Now a request's error is what the runtime says about that request alone: the
same as a fresh interpreter's (the reference) for the same inputs."""
import re

import grpc
import numpy as np
import pytest

from pkm_serve import tflite, tflite_cli
from tests.serving.test_serving_tflite_signatures import _with_signature_defs_metadata
from tests.tflite.metadata_entries import with_metadata_entry

TABLE = np.random.default_rng(36).standard_normal((40, 6)).astype(np.float32)


def _write(root, name, blob):
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.tflite").write_bytes(blob)
    return str(root / name / "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"bag", "flex"}: version dirs of two-signature models, 'aaa'
    (x * 2 + 1) in subgraph 0 and 'zzz' in subgraph 1: a weighted mean bag (ids [-1, -1],
    weights [-1, 3]) through PkmEmbeddingBag, or a matrix inverse (FlexMatrixInverse)."""
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    root = tmp_path_factory.mktemp("subgraph_refusals")
    affine = tf.function(lambda x: {"y": x * 2.0 + 1.0},
                         input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    bag = tf.function(lambda ids, w: {"out": ops.embedding_bag(tf.constant(TABLE), ids, w, combiner="mean")},
                      input_signature=[tf.TensorSpec([None, None], tf.int64, name="ids"),
                                       tf.TensorSpec([None, 3], tf.float32, name="w")])
    inverse = tf.function(lambda m: {"inv": tf.linalg.inv(m)},
                          input_signature=[tf.TensorSpec([None, 2, 2], tf.float32, name="m")])
    paths = {}
    for name, signatures in (("bag", {"aaa": affine, "zzz": bag}),
                             ("flex", {"aaa": affine, "zzz": inverse})):
        module = tf.Module()
        saved = str(root / f"{name}_saved")
        tf.saved_model.save(module, saved, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved, signature_keys=sorted(signatures))
        converter.allow_custom_ops = True
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS, tf.lite.OpsSet.SELECT_TF_OPS]
        paths[name] = _write(root, name, converter.convert())
    return paths


def _load(path):
    from pkm_serve.serving.loader import make_loader_factory
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True)("m", 1, path)
    loader.load()
    return loader


def _refusal(run, kind=RuntimeError):
    with pytest.raises(kind) as refused:
        run()
    return ' '.join(getattr(refused.value, "message", str(refused.value)).split())


def test_a_flex_op_in_another_signature_fails_the_cli_and_the_load(models, capsys):
    from pkm_serve.serving.errors import ServingError
    fresh = tflite.make_interpreter(f"{models['flex']}/model.tflite")
    want = _refusal(lambda: fresh.get_signature_runner("zzz")(m=np.eye(2, dtype=np.float32)[None]))
    assert want.startswith("Select TensorFlow op(s)"), want
    assert tflite_cli.console_main([f"{models['flex']}/model.tflite"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pkm-serve tflite: error: signature 'zzz' (subgraph 1): Select TensorFlow op(s)"), err
    with pytest.raises(ServingError) as refused:
        _load(models["flex"])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # (the load error gives the runtime's messages each on its own, '; '-separated)
    want_messages = "; ".join(tflite.runtime_messages(want))
    assert f"signature 'zzz' (subgraph 1): {want_messages}" in refused.value.message, refused.value.message


def test_a_refused_request_reads_its_own_error_not_the_loads(models):
    from pkm_serve.serving.errors import ServingError
    ids = np.array([[0, 40, -1]], np.int64)   # 40: past the table's 40 rows
    w = np.ones((1, 3), np.float32)
    fresh = tflite.make_interpreter(f"{models['bag']}/model.tflite")
    want = "; ".join(tflite.runtime_messages(
        _refusal(lambda: fresh.get_signature_runner("zzz")(ids=ids, w=w))))
    assert "indices[1] = 40 is out of range [0, 40) (negative indices are padding); Node number" in want, want
    assert "[1, 1]" not in want, want
    loader = _load(models["bag"])
    try:
        signature = loader.servable().signature("zzz")
        for _ in range(2):
            got = _refusal(lambda: signature.run({"ids": ids, "w": w}), ServingError)
            assert got == f"signature 'zzz' rejected the inputs: {want}", got
        good = np.array([[0, 39, -1]], np.int64)
        np.testing.assert_allclose(signature.run({"ids": good, "w": w})["out"],
                                   (TABLE[0:1].astype(np.float64) + TABLE[39:40]) / 2, rtol=1e-5, atol=1e-6)
    finally:
        loader.unload()


def test_signature_defs_from_the_metadata_prepare_only_the_subgraph_they_run(models, tmp_path, capsys):
    """TF Serving serves a model's signature_defs_metadata alone, on the primary subgraph: the
    Flex op of the converter's other signature, which no request reaches, failed the load.
    `pkm-serve tflite` then still failed (exit 1) on the model the server loads: it prints the
    plan, with the other signature's missing kernel as a note."""
    from tensorflow.core.protobuf import meta_graph_pb2
    with open(f"{models['flex']}/model.tflite", "rb") as f:
        model_bytes = f.read()
    interp = tflite.make_interpreter(model_bytes)
    (x,), (y,) = interp.get_input_details(), interp.get_output_details()
    sdef = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    sdef.inputs["x"].name, sdef.outputs["y"].name = x["name"], y["name"]
    path = _write(tmp_path, "metadata", _with_signature_defs_metadata(model_bytes, {"affine": sdef.SerializeToString()}))
    assert tflite_cli.console_main([f"{path}/model.tflite"]) == 0
    out, err = capsys.readouterr()
    (note,) = err.splitlines()
    assert note.startswith("pkm-serve tflite: note: signature 'zzz' (subgraph 1): Select TensorFlow op(s)"), note
    assert note.endswith(" (a server loads the model: it serves its signature_defs_metadata, on the primary subgraph)")
    plan = out.splitlines()[1:]
    assert out.startswith("delegate: ") and plan and all(line.endswith(" runs") or " claimed by node " in line
                                                         for line in plan), out
    with open(f"{path}/model.tflite", "rb") as f:   # (the schema's reader: the reference)
        written = tflite.flatbuffer_schema().Model.GetRootAsModel(f.read(), 0)
    assert tflite.metadata_names(_with_signature_defs_metadata(model_bytes, {})) == \
        [written.Metadata(i).Name().decode() for i in range(written.MetadataLength())]
    loader = _load(path)
    try:
        assert list(loader.servable().signature_defs) == ["affine"]
        x_value = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(loader.servable().signature("affine").run({"x": x_value})["y"],
                                      x_value.astype(np.float64) * 2 + 1)
    finally:
        loader.unload()


def _with_metadata_blob(model_bytes, blob):
    """model_bytes plus a signature_defs_metadata entry holding ``blob``."""
    return with_metadata_entry(model_bytes, "signature_defs_metadata", blob)


def test_an_empty_or_unreadable_signature_defs_metadata_the_cli_and_the_server_agree(models, tmp_path, capsys):
    """An empty signature_defs_metadata map is no SignatureDef (upstream's GetSignatureDefMap
    gives an empty map, and tflite_session.cc serves the model as one without any): the server
    served the signature runners, preparing 'zzz' and refusing the load for its Flex op, while
    `pkm-serve tflite` took the entry's name alone for served SignatureDefs and printed the plan
    with a note, exit 0. Now both refuse it; and an entry that is not a map, which the load
    refuses ("Invalid SignatureDefs found"), fails the CLI with the same words. The entry count
    is read without flatbuffers' modules (tflite_runtime has none): flexbuffers' reader is the
    reference."""
    from flatbuffers import flexbuffers
    from pkm_serve.serving.errors import ServingError
    with open(f"{models['flex']}/model.tflite", "rb") as f:
        model_bytes = f.read()
    for entries in ({}, {"a": b"x"}, {"a": b"", "bb": b"y" * 300, "c": b"z" * 70000}):
        blob = _with_signature_defs_metadata(model_bytes, entries)
        model = tflite.flatbuffer_schema().Model.GetRootAsModel(blob, 0)
        (entry,) = [model.Metadata(i) for i in range(model.MetadataLength())
                    if model.Metadata(i).Name() == b"signature_defs_metadata"]
        want = len(flexbuffers.GetRoot(model.Buffers(entry.Buffer()).DataAsNumpy().tobytes()).AsMap)
        assert tflite.signature_defs_metadata_size(blob) == want == len(entries)
    assert tflite.signature_defs_metadata_size(model_bytes) is None
    empty = _write(tmp_path, "empty", _with_signature_defs_metadata(model_bytes, {}))
    assert tflite_cli.console_main([f"{empty}/model.tflite"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pkm-serve tflite: error: signature 'zzz' (subgraph 1): Select TensorFlow op(s)"), err
    with pytest.raises(ServingError, match=r"signature 'zzz' \(subgraph 1\): Select TensorFlow op\(s\)"):
        _load(empty)
    not_a_map = _write(tmp_path, "vector", _with_metadata_blob(model_bytes, bytes(flexbuffers.Dumps([1, 2]))))
    assert tflite_cli.console_main([f"{not_a_map}/model.tflite"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pkm-serve tflite: error: Invalid SignatureDefs found in TfLite model "
                          "(its signature_defs_metadata)"), err
    with pytest.raises(ServingError, match=r"Invalid SignatureDefs found in TfLite model \(its signature_defs_metadata\)"):
        _load(not_a_map)


def test_signature_defs_metadata_stored_by_offset_is_read_as_upstream_reads_it(tmp_path, capsys):
    """TF Serving's GetSignatureDefMap reads the entry's buffer data() alone, never Buffer.offset
    (schema.fbs' store after the flatbuffer): data kept inline as well is served (by both),
    data only after the flatbuffer is refused by both in the same words, which say so (the
    server's were "AttributeError: 'int' object has no attribute 'tobytes'")."""
    from tensorflow.core.protobuf import meta_graph_pb2
    from pkm_serve.serving.errors import ServingError
    from tests.tflite.metadata_entries import with_metadata_stored_by_offset
    sdef = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    sdef.inputs["ids"].name, sdef.inputs["wts"].name, sdef.outputs["pooled"].name = "indices", "weights", "output"
    inline = _with_signature_defs_metadata(tflite.build_embedding_bag_model(TABLE, 3), {"bags": sdef.SerializeToString()})
    both = _write(tmp_path, "both", with_metadata_stored_by_offset(inline, "signature_defs_metadata", True))
    assert tflite_cli.console_main([f"{both}/model.tflite"]) == 0
    capsys.readouterr()
    loader = _load(both)
    try:
        assert list(loader.servable().signature_defs) == ["bags"]
    finally:
        loader.unload()
    outside = with_metadata_stored_by_offset(inline, "signature_defs_metadata", False)
    model = tflite.flatbuffer_schema().Model.GetRootAsModel(inline, 0)
    blob = model.Buffers(model.Metadata(model.MetadataLength() - 1).Buffer()).DataAsNumpy().tobytes()
    words = (r"Invalid SignatureDefs found in TfLite model \(its signature_defs_metadata\): IndexError: its buffer "
             r"holds no data: its bytes are stored by offset \((\d+)\) outside the flatbuffer")
    path = _write(tmp_path, "outside", outside)
    assert tflite_cli.console_main([f"{path}/model.tflite"]) == 1
    stored_at = int(re.search(words, capsys.readouterr().err)[1])
    assert outside[stored_at:] == blob   # the offset named is where the bytes are
    with pytest.raises(ServingError, match=words):
        _load(path)


def test_a_signature_defs_metadata_entry_naming_no_buffer_of_data_the_cli_and_the_server_agree(tmp_path, capsys):
    """An entry naming buffer 9999 of 3: the server read past the flatbuffer's buffers
    ("unpack_from requires a buffer of at least ..."); one naming buffer 0 (the field left out,
    its default): the CLI said "buffer None of 3". Both now give the CLI's and server's same words."""
    import flatbuffers
    from pkm_serve.serving.errors import ServingError
    schema = tflite.flatbuffer_schema()
    added = with_metadata_entry(tflite.build_embedding_bag_model(TABLE, 3), "signature_defs_metadata", b"\x00\x01\x02")
    for index, words in ((9999, "IndexError: buffer 9999 of 3"), (0, "IndexError: its buffer holds no data")):
        m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(added), 0))
        assert len(m.buffers) == 3 and not m.buffers[0].data   # (buffer 0: the schema's empty one)
        m.metadata[-1].buffer = index
        b = flatbuffers.Builder(4096)
        b.Finish(m.Pack(b), file_identifier=b"TFL3")
        path = _write(tmp_path, f"buffer{index}", bytes(b.Output()))
        assert tflite_cli.console_main([f"{path}/model.tflite"]) == 1
        want = f"Invalid SignatureDefs found in TfLite model (its signature_defs_metadata): {words}"
        assert capsys.readouterr().err.strip() == f"pkm-serve tflite: error: {want}"
        with pytest.raises(ServingError, match=re.escape(want) + "$"):
            _load(path)
