"""The SignatureDef a TFLite version gets when its .tflite holds none: TF Serving's
tflite_session.cc makes one `serving_default` keyed by each input and output tensor's name
cut at its first ':' (TfToTfLiteLegacyTensorName), the TensorInfo keeping the whole name.
Reference: the .tflite run alone in the interpreter, and numpy float64."""
import numpy as np

import reference
from pkm_serve import tflite

N, D, K = 30, 4, 3
TABLE = np.random.default_rng(8).standard_normal((N, D)).astype(np.float32)


def _renamed(names):
    """The PKM bag .tflite (inputs indices, weights; output output) without SignatureDefs,
    its tensors renamed {old: new}."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    model_bytes = tflite.build_embedding_bag_model(TABLE, K)
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    m.signatureDefs = None
    for tensor in m.subgraphs[0].tensors:
        old = tensor.name.decode() if isinstance(tensor.name, bytes) else tensor.name
        tensor.name = names.get(old, old)
    b = flatbuffers.Builder(len(model_bytes) + 1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _servable(tmp_path, model_bytes):
    from pkm_serve.serving.tflite_servable import TfLiteServable
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.tflite").write_bytes(model_bytes)
    return TfLiteServable("m", 1, str(tmp_path / "1"), warmup=False)


def _bags():
    rng = np.random.default_rng(1)
    return rng.integers(0, N, size=(5, K)).astype(np.int32), rng.random((5, K)).astype(np.float32)


def _assert_serves_the_bags(servable, model, key, ids, wts, out):
    """Signature `key` (inputs ids/wts, output out) answers as the interpreter run alone and
    the float64 reference."""
    idx, w = _bags()
    got = servable.signature(key).run({ids: idx, wts: w})[out]
    np.testing.assert_array_equal(got, tflite.run_tflite(model, [idx, w])[0])
    np.testing.assert_allclose(got, reference.embedding_bag(TABLE.astype(np.float64), idx, w), rtol=1e-5, atol=1e-5)


def test_aliases_are_tensor_names_cut_at_the_colon_as_tf_serving(tmp_path):
    """The converter names tensors 'serving_default_x:0', 'StatefulPartitionedCall:0':
    such a .tflite stripped of its SignatureDefs was served under the whole names, so a
    TF Serving client's request (inputs keyed 'serving_default_indices') was refused."""
    model = _renamed({"indices": "serving_default_indices:0", "weights": "serving_default_weights:0",
                      "output": "StatefulPartitionedCall:0"})
    servable = _servable(tmp_path, model)
    try:
        sdef = servable.signature_defs["serving_default"]
        assert sorted(sdef.inputs) == ["serving_default_indices", "serving_default_weights"]
        assert list(sdef.outputs) == ["StatefulPartitionedCall"]
        assert sdef.inputs["serving_default_indices"].name == "serving_default_indices:0"
        assert sdef.outputs["StatefulPartitionedCall"].name == "StatefulPartitionedCall:0"
        _assert_serves_the_bags(servable, model, "", "serving_default_indices", "serving_default_weights",
                                "StatefulPartitionedCall")
    finally:
        servable.release()


def test_names_that_cut_to_one_alias_keep_their_whole_names(tmp_path):
    """Upstream's map keeps only the last of two such tensors (the other input could not
    be fed); here both are served, under their whole names."""
    servable = _servable(tmp_path, _renamed({"indices": "bag:0", "weights": "bag:1"}))
    try:
        assert sorted(servable.signature_defs["serving_default"].inputs) == ["bag:0", "bag:1"]
        idx, w = _bags()
        got = servable.signature("").run({"bag:0": idx, "bag:1": w})["output"]
        np.testing.assert_allclose(got, reference.embedding_bag(TABLE.astype(np.float64), idx, w),
                                   rtol=1e-5, atol=1e-5)
    finally:
        servable.release()


def _with_signature_defs_metadata(model_bytes, entries):
    """model_bytes plus a signature_defs_metadata entry: a FlexBuffer map {key: the value's
    bytes as a FlexBuffer string}, the layout of TFLite's signature_def_util
    SetSignatureDefMap (which TF Serving's GetSignatureDefMap reads)."""
    import flatbuffers
    from flatbuffers import flexbuffers
    fb = flexbuffers.Builder()
    with fb.Map():
        for key, value in entries.items():
            fb.Key(key)
            # (Builder.String takes text only; a serialized proto is bytes.)
            fb._WriteBlob(value, append_zero=True, type_=flexbuffers.Type.STRING)  # noqa: SLF001
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(bytes(fb.Finish()), np.uint8)
    m.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = "signature_defs_metadata", len(m.buffers) - 1
    m.metadata = (m.metadata or []) + [entry]
    b = flatbuffers.Builder(len(model_bytes) + 4096)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _sigdef(inputs, outputs, method="tensorflow/serving/predict"):
    from tensorflow.core.protobuf import meta_graph_pb2
    sdef = meta_graph_pb2.SignatureDef(method_name=method)
    for infos, names in ((sdef.inputs, inputs), (sdef.outputs, outputs)):
        for alias, name in names.items():
            infos[alias].name = name
    return sdef


def test_signature_defs_in_the_metadata_are_the_ones_served(tmp_path):
    """TF Serving takes a .tflite's SignatureDefs from its signature_defs_metadata (keys,
    aliases, method names); they were ignored, and such a model was served under its
    tensor names, its keys and methods lost. Tensor names are matched whole or cut at
    their first ':' (FixTfLiteTensorName)."""
    sdef = _sigdef({"ids": "indices", "wts": "weights:0"}, {"pooled": "output:0"},
                   method="tensorflow/serving/regress")
    model = _with_signature_defs_metadata(tflite.build_embedding_bag_model(TABLE, K),
                                          {"bags": sdef.SerializeToString()})
    servable = _servable(tmp_path, model)
    try:
        assert list(servable.signature_defs) == ["bags"]
        served = servable.signature_defs["bags"]
        assert served.method_name == "tensorflow/serving/regress"
        assert {k: v.name for k, v in served.inputs.items()} == {"ids": "indices", "wts": "weights"}
        assert {k: v.name for k, v in served.outputs.items()} == {"pooled": "output"}
        # The TensorInfos here give names only: dtype and shape come from the tensors.
        assert [d.size for d in served.inputs["ids"].tensor_shape.dim] == [-1, K]
        assert served.inputs["ids"].dtype == 3 and served.inputs["wts"].dtype == 1   # DT_INT32, DT_FLOAT
        _assert_serves_the_bags(servable, model, "bags", "ids", "wts", "pooled")
    finally:
        servable.release()


def _typed(ids_dtype):
    sdef = _sigdef({"ids": "indices", "wts": "weights"}, {"pooled": "output"})
    sdef.inputs["ids"].dtype = ids_dtype
    return sdef


def test_metadata_naming_an_unknown_tensor_or_unreadable_fails_the_load(tmp_path):
    import grpc
    import pytest
    from pkm_serve.serving.errors import ServingError
    base = tflite.build_embedding_bag_model(TABLE, K)
    cases = [({"bags": _sigdef({"ids": "no_such:0"}, {"pooled": "output"}).SerializeToString()},
              "Signature input ids of signature 'bags' references an unknown tensor 'no_such:0'"),
             ({"bags": b"\xff\xff not a SignatureDef"}, "Invalid SignatureDefs found in TfLite model"),
             # A dtype unlike the tensor's (an unknown enum raised a TypeError out of the load).
             ({"bags": _typed(7).SerializeToString()},
              "Signature input ids of signature 'bags' declares dtype DT_STRING, but tensor 'indices' is DT_INT32"),
             ({"bags": _typed(999).SerializeToString()}, "declares dtype <unknown DataType 999>")]
    for i, (entries, says) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        with pytest.raises(ServingError) as err:
            _servable(tmp_path / str(i), _with_signature_defs_metadata(base, entries))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.message, \
            err.value.message
