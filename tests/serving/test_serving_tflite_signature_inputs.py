"""A TFLite version's signatures must feed every input of the interpreter, each from one
input of its own: an input no request feeds keeps the previous request's data (another
client's) or uninitialised memory, so such a .tflite fails its load (INVALID_ARGUMENT naming
the signature and the tensors), as do two input tensors of one name (TF Serving's
GetTensorInfoMap: "Input tensor name: ... has multiple indices")."""
import flatbuffers
import grpc
import numpy as np
import pytest

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError
from test_serving_tflite_signatures import (K, TABLE, _renamed, _servable, _sigdef,
                                            _with_signature_defs_metadata)


def _refused(tmp_path, model_bytes):
    with pytest.raises(ServingError) as err:
        _servable(tmp_path, model_bytes)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.message


def _metadata_model(entries):
    return _with_signature_defs_metadata(tflite.build_embedding_bag_model(TABLE, K),
                                         {k: v.SerializeToString() for k, v in entries.items()})


def test_metadata_signature_feeding_only_some_inputs_fails_the_load(tmp_path):
    """`ids_only` (indices, not weights) loaded: its requests ran on the weights the last
    `full` request left in the interpreter (first ones on uninitialised memory)."""
    model = _metadata_model({"full": _sigdef({"ids": "indices", "wts": "weights"}, {"pooled": "output"}),
                             "ids_only": _sigdef({"ids": "indices"}, {"pooled": "output"})})
    says = _refused(tmp_path, model)
    assert "signature 'ids_only' feeds only some of the model's inputs" in says and "'weights'" in says, says


def test_two_inputs_of_one_tensor_fail_the_load(tmp_path):
    model = _metadata_model({"bags": _sigdef({"ids": "indices", "ids2": "indices:0", "wts": "weights"},
                                             {"pooled": "output"})})
    says = _refused(tmp_path, model)
    assert "signature 'bags': inputs ids, ids2 all feed tensor 'indices'" in says, says


def test_two_input_tensors_of_one_name_fail_the_load(tmp_path):
    """Without SignatureDefs the two collapsed into one alias `bag` (the other never fed); with
    metadata naming `bag`, one of them was fed and the other not."""
    (tmp_path / "legacy").mkdir()
    says = _refused(tmp_path / "legacy", _renamed({"indices": "bag", "weights": "bag"}))
    assert "signature 'serving_default': input tensors" in says and \
        "Input tensor name: bag has multiple indices" in says, says
    (tmp_path / "metadata").mkdir()
    model = _with_signature_defs_metadata(_renamed({"indices": "bag", "weights": "bag"}), {
        "bags": _sigdef({"ids": "bag"}, {"pooled": "output"}).SerializeToString()})
    says = _refused(tmp_path / "metadata", model)
    assert "signature 'bags': input tensors" in says and "bag has multiple indices" in says, says


def _with_runner_signature(inputs):
    """The bag .tflite with one converter-style SignatureDef `serving_default` naming the
    subgraph inputs `inputs` ({alias: tensor name}) and the output as `pooled`."""
    schema = tflite.flatbuffer_schema()
    base = tflite.build_embedding_bag_model(TABLE, K)
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(base), 0))
    graph = m.subgraphs[0]
    index = {graph.tensors[i].name.decode(): int(i) for i in list(graph.inputs) + list(graph.outputs)}

    def tensor_map(alias, name):
        t = schema.TensorMapT()
        t.name, t.tensorIndex = alias, index[name]
        return t
    sig = schema.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex = "serving_default", 0
    sig.inputs = [tensor_map(a, n) for a, n in inputs.items()]
    sig.outputs = [tensor_map("pooled", "output")]
    m.signatureDefs = [sig]
    b = flatbuffers.Builder(len(base) + 1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def test_signature_runner_feeding_only_some_inputs_fails_the_load(tmp_path):
    (tmp_path / "whole").mkdir()
    servable = _servable(tmp_path / "whole", _with_runner_signature({"ids": "indices", "wts": "weights"}))
    try:   # (the whole signature still serves: float64 reference)
        ids = np.array([[0, 1, 2], [3, 3, 4]], np.int32)
        wts = np.array([[1, 2, 3], [0.5, 0.5, -1]], np.float32)
        got = servable.signature("").run({"ids": ids, "wts": wts})["pooled"]
        want = np.einsum("bk,bkd->bd", wts.astype(np.float64), TABLE.astype(np.float64)[ids])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        servable.release()
    (tmp_path / "part").mkdir()
    says = _refused(tmp_path / "part", _with_runner_signature({"ids": "indices"}))
    assert "signature 'serving_default' feeds only some of the model's inputs" in says and \
        "'weights'" in says, says
