"""A .tflite's converter SignatureDefs (the signature-runner path): two inputs or outputs of
one alias, an alias left out, or input/output tensors of one name, fail the load naming them, as on the
metadata and tensor-name paths (the runner's by-alias dicts hid them: an output alias was
answered with another tensor's values). Reference: the one-op bag model's own tensors."""
import flatbuffers
import grpc
import numpy as np
import pytest

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError
from test_serving_tflite_signatures import K, TABLE, _servable


def _with_runner_signature(inputs, outputs, renamed=None):
    """The bag .tflite (tensors indices, weights -> output) with one converter-style
    SignatureDef `serving_default`: [(alias, tensor name)] inputs and outputs, after the
    tensors are renamed {old: new}."""
    schema = tflite.flatbuffer_schema()
    base = tflite.build_embedding_bag_model(TABLE, K)
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(base), 0))
    graph = m.subgraphs[0]
    index = {t.name.decode(): i for i, t in enumerate(graph.tensors)}
    for old, new in (renamed or {}).items():
        graph.tensors[index[old]].name = new

    def tensor_maps(pairs):
        maps = []
        for alias, name in pairs:
            t = schema.TensorMapT()
            t.name, t.tensorIndex = alias, index[name]
            maps.append(t)
        return maps
    sig = schema.SignatureDefT()
    sig.signatureKey, sig.subgraphIndex = "serving_default", 0
    sig.inputs, sig.outputs = tensor_maps(inputs), tensor_maps(outputs)
    m.signatureDefs = [sig]
    b = flatbuffers.Builder(len(base) + 1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


BOTH_INPUTS = [("ids", "indices"), ("wts", "weights")]


@pytest.mark.parametrize("inputs, outputs, renamed, says", [
    # The second 'pooled' (the weights) replaced the first: Predict answered the weights.
    (BOTH_INPUTS, [("pooled", "output"), ("pooled", "weights")], None,
     "signature 'serving_default' names two outputs 'pooled' (tensors 'output' and 'weights')"),
    # Was refused as feeding only some inputs, naming neither the alias nor the cause.
    ([("x", "indices"), ("x", "weights")], [("pooled", "output")], None,
     "signature 'serving_default' names two inputs 'x' (tensors 'indices' and 'weights')"),
    # These two loaded: metadata listed two inputs (outputs) under one tensor name.
    (BOTH_INPUTS, [("pooled", "output")], {"weights": "indices"},
     "Input tensor name: indices has multiple indices"),
    (BOTH_INPUTS, [("pooled", "output"), ("w", "weights")], {"weights": "output"},
     "Output tensor name: output has multiple indices"),
    # An alias the file leaves out: AttributeError ('NoneType' ... 'decode') out of the load.
    ([(None, "indices"), ("wts", "weights")], [("pooled", "output")], None,
     "signature 'serving_default' has an input with no name (tensor 'indices')"),
])
def test_runner_signature_with_shared_names_fails_the_load(tmp_path, inputs, outputs, renamed, says):
    with pytest.raises(ServingError) as err:
        _servable(tmp_path, _with_runner_signature(inputs, outputs, renamed))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.message, err.value.message


def test_one_output_tensor_under_two_aliases_is_served(tmp_path):
    """Two aliases of one tensor are not a clash: each answers the pooled bags."""
    servable = _servable(tmp_path, _with_runner_signature(BOTH_INPUTS, [("a", "output"), ("b", "output")]))
    try:
        ids = np.array([[0, 1, 2], [3, 3, 4]], np.int32)
        wts = np.array([[1, 2, 3], [0.5, 0.5, -1]], np.float32)
        got = servable.signature("").run({"ids": ids, "wts": wts})
        want = np.einsum("bk,bkd->bd", wts.astype(np.float64), TABLE.astype(np.float64)[ids])
        for alias in ("a", "b"):
            np.testing.assert_allclose(got[alias], want, rtol=1e-5, atol=1e-5)
    finally:
        servable.release()
