"""A .tflite whose one input has a fixed batch (here 8 rows its ops hold: a Reshape pairs the
rows) under --num_tflite_interpreters_per_pool above 1: TF Serving's TfLiteSession splits a
request into runs of that batch; a shorter run (the request's last piece, or a small request)
is padded to it and the padding's outputs dropped, as upstream's interpreter keeps its batch.
Here the short piece was resized and refused, failing the whole request. Reference: numpy
float64 of the same model."""
import grpc
import numpy as np
import pytest

from pkm_serve.serving.errors import ServingError

B, K, N, D = 8, 4, 50, 6
RNG = np.random.default_rng(34)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)
W = RNG.standard_normal((2 * D, 3)).astype(np.float32)


def _reference(ids):
    """The model on any whole number of row pairs: bag sums, rows paired, @ W, each pair's
    answer given to both of its rows."""
    bags = TABLE.astype(np.float64)[ids].sum(axis=1)
    return np.repeat(bags.reshape(-1, 2 * D) @ W.astype(np.float64), 2, axis=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tf_with_ops):
    import tensorflow as tf
    from pkm_serve import ops

    @tf.function(input_signature=[tf.TensorSpec([B, K], tf.int32, name="ids")])
    def serve(ids):
        pairs = tf.reshape(ops.embedding_bag(tf.constant(TABLE), ids), [B // 2, 2 * D])
        return {"out": tf.repeat(pairs @ tf.constant(W), 2, axis=0)}
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()])
    converter.allow_custom_ops = True
    path = tmp_path_factory.mktemp("fixed_batch") / "1"
    path.mkdir()
    (path / "model.tflite").write_bytes(converter.convert())
    return str(path)


def _ids(rows):
    return np.random.default_rng(rows).integers(0, N, size=(rows, K)).astype(np.int32)


def test_short_runs_are_padded_to_the_fixed_batch(model_dir, invoked_rows):
    from pkm_serve.serving.tflite_servable import TfLiteServable
    servable = TfLiteServable("m", 1, model_dir, warmup=False, num_interpreters=2, interpreters_per_pool=2)
    try:
        signature = servable.signature("")
        for rows, runs in ((20, [8, 8, 8]), (2, [8]), (16, [8, 8])):
            invoked_rows.clear()
            ids = _ids(rows)
            got = signature.run({"ids": ids})
            key = next(iter(got))
            assert got[key].shape == (rows, 3) and invoked_rows == runs
            np.testing.assert_allclose(got[key], _reference(ids), rtol=1e-5, atol=1e-5)
    finally:
        servable.release()


def test_without_the_sessions_batching_another_batch_is_refused_naming_it(model_dir):
    """No version scheduler (as upstream: the interpreter is resized to the request and its
    kernels refuse): INVALID_ARGUMENT that now names the fixed batch."""
    from pkm_serve.serving.tflite_servable import TfLiteServable
    servable = TfLiteServable("m", 1, model_dir, warmup=False)
    try:
        with pytest.raises(ServingError) as err:
            servable.signature("").run({"ids": _ids(6)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'ids' has 6 rows; the model fixes its batch at 8: [8, 4]" in err.value.message, \
            err.value.message
        ids = _ids(8)
        got = servable.signature("").run({"ids": ids})
        np.testing.assert_allclose(next(iter(got.values())), _reference(ids), rtol=1e-5, atol=1e-5)
    finally:
        servable.release()


def test_a_dynamic_batch_stored_above_one_splits_without_padding(tmp_path, tf_with_ops, invoked_rows):
    """A single input stored [8, K] with shape signature [-1, K]: runs of 8 rows (upstream reads
    the stored dimension), but a short run is not padded (the model takes any batch)."""
    import flatbuffers
    import tensorflow as tf
    from pkm_serve import ops, tflite
    from pkm_serve.serving.tflite_servable import TfLiteServable

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="ids")])
    def serve(ids):
        return {"bags": ops.embedding_bag(tf.constant(TABLE), ids)}
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()])
    converter.allow_custom_ops = True
    schema = tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(converter.convert()), 0))
    graph = model.subgraphs[0]
    graph.tensors[graph.inputs[0]].shape = [B, K]
    builder = flatbuffers.Builder(1 << 16)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.tflite").write_bytes(bytes(builder.Output()))
    servable = TfLiteServable("m", 1, str(tmp_path / "1"), warmup=False, num_interpreters=2, interpreters_per_pool=2)
    try:
        for rows, runs in ((20, [8, 8, 4]), (3, [3])):
            invoked_rows.clear()
            ids = _ids(rows)
            got = next(iter(servable.signature("").run({"ids": ids}).values()))
            assert invoked_rows == runs
            np.testing.assert_allclose(got, TABLE.astype(np.float64)[ids].sum(axis=1), rtol=1e-5, atol=1e-5)
    finally:
        servable.release()
