"""The batch threads of a TFLite version's own scheduler (--num_tflite_interpreters_per_pool
above 1) across its load and unload: a refused load leaves none running, a model whose fixed
batch is above the 500 rows TfLiteSession's scheduler takes is refused as upstream's
SharedBatchScheduler::AddQueue refuses it, and a request after the unload is told so."""
import threading

import grpc
import numpy as np
import pytest

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError
from test_serving_tflite_signatures import K, N, TABLE, _sigdef, _with_signature_defs_metadata


def _version(tmp_path, model_bytes):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.tflite").write_bytes(model_bytes)
    return str(tmp_path / "1")


def _unweighted_fixed_batch_model(rows):
    """The bag .tflite without weights, its one input `indices` of a fixed [rows, K]."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    base = tflite.build_embedding_bag_model(TABLE, K, has_weights=False, batch=rows)
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(base), 0))
    m.subgraphs[0].inputs, m.subgraphs[0].operators[0].inputs = [1], [0, 1]
    b = flatbuffers.Builder(len(base) + 1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _batch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("batch-")]


def test_refused_load_leaves_no_batch_threads(tmp_path):
    """The threads started before the signatures were built: each refused load (a retry
    loop reloads it) left four more running."""
    from tensorflow.core.framework import types_pb2
    from pkm_serve.serving.tflite_servable import TfLiteServable
    sdef = _sigdef({"ids": "indices", "wts": "weights"}, {"pooled": "output"})
    sdef.defaults["wts"].dtype = types_pb2.DT_INVALID   # a malformed default: refused by the signature
    path = _version(tmp_path, _with_signature_defs_metadata(tflite.build_embedding_bag_model(TABLE, K),
                                                            {"bags": sdef.SerializeToString()}))
    before = _batch_threads()
    for _ in range(3):
        with pytest.raises(ServingError) as err:
            TfLiteServable("m", 1, path, warmup=False, num_interpreters=4, interpreters_per_pool=2)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'wts'" in err.value.message
    assert _batch_threads() == before


def test_fixed_batch_above_500_rows_is_refused_as_upstream(tmp_path):
    """A model of a fixed batch of 600 rows was served in runs of 500 (each refused by the
    interpreter); upstream refuses the load (input_batch_size_limit 500 < max_execution_batch_size)."""
    from pkm_serve.serving.tflite_servable import TfLiteServable
    path = _version(tmp_path, _unweighted_fixed_batch_model(600))
    before = _batch_threads()
    with pytest.raises(ServingError) as err:
        TfLiteServable("m", 1, path, warmup=False, num_interpreters=2, interpreters_per_pool=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "fixed input batch is 600 rows" in err.value.message and \
        "input_batch_size_limit must be greater than or equal to max_execution_batch_size" in err.value.message
    assert _batch_threads() == before
    servable = TfLiteServable("m", 1, path, warmup=False, num_interpreters=2)   # (no session batching: served)
    try:
        ids = np.random.default_rng(2).integers(0, N, size=(600, K)).astype(np.int32)
        got = servable.signature("").run({"indices": ids})["output"]
        np.testing.assert_allclose(got, TABLE.astype(np.float64)[ids].sum(axis=1), rtol=1e-5, atol=1e-5)
    finally:
        servable.release()


def test_request_after_unload_is_told_the_version_was_unloaded(tmp_path):
    """It was told "server is shutting down" while the server served on."""
    from pkm_serve.serving.tflite_servable import TfLiteServable
    path = _version(tmp_path, tflite.build_embedding_bag_model(TABLE, K))
    servable = TfLiteServable("m", 1, path, warmup=False, num_interpreters=2, interpreters_per_pool=2)
    sig = servable.signature("")
    bags = {"indices": np.zeros((3, K), np.int32), "weights": np.ones((3, K), np.float32)}
    np.testing.assert_allclose(sig.run(bags)["output"], np.tile(TABLE[0] * K, (3, 1)), rtol=1e-6)
    servable.release()
    with pytest.raises(ServingError) as err:
        sig.run(bags)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == "this model version was unloaded"
