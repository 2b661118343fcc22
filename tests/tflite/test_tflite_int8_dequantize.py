"""quantize_table_int8 of a model converted with float16 weight quantization
(``optimizations=[DEFAULT]``, ``supported_types=[tf.float16]``): the converter stores
the table as a FLOAT16 constant behind a DEQUANTIZE, which the rewrite follows."""
import numpy as np
import pytest

from pkm_serve import tflite
from tests.reference import embedding_bag

tf = pytest.importorskip("tensorflow")

N, D, K = 400, 24, 5


def _convert_float16(fn, signature):
    concrete = tf.function(fn, input_signature=signature).get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete])
    converter.allow_custom_ops = True
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]
    return converter.convert()


def _int8_tables(model_bytes):
    """[(dequantized float64 table)] of every INT8 tensor with per-row quantisation."""
    schema = tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    out = []
    for t in model.subgraphs[0].tensors:
        if t.type == schema.TensorType.INT8 and t.quantization is not None:
            q = np.frombuffer(bytes(bytearray(model.buffers[t.buffer].data)), np.int8)
            q = q.reshape(list(t.shape)).astype(np.float64)
            s = np.asarray(t.quantization.scale, np.float64)[:, None]
            z = np.asarray(t.quantization.zeroPoint, np.float64)[:, None]
            out.append(s * (q - z))
    return out


@pytest.mark.parametrize("interpreter", ["litert", "tflite_runtime"])
def test_a_float16_converted_table_is_quantized_and_its_dequantize_dropped(interpreter, tmp_path):
    from pkm_serve import ops
    from tests.tflite.test_tflite import run_in
    rng = np.random.default_rng(31)
    table = rng.standard_normal((N, D)).astype(np.float32)
    const = tf.constant(table)
    f16 = _convert_float16(
        lambda i, w, j: (ops.embedding_bag(const, i, w, combiner="mean"),
                         ops.embedding_bag(const, j, None, combiner="sum")),
        [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, K], tf.float32),
         tf.TensorSpec([None, 3], tf.int64)])
    before = tflite.ops_in_plan(tflite.make_interpreter(f16)).count("DEQUANTIZE")
    q = tflite.quantize_table_int8(f16)
    # 2 bytes a value -> 1, plus a row's float32 scale and int64 zero point
    assert len(f16) - len(q) >= N * (2 * D - (D + 12)) - 512
    # the table's DEQUANTIZE is gone (an unweighted site's empty weights keep theirs)
    assert tflite.ops_in_plan(tflite.make_interpreter(q)).count("DEQUANTIZE") == before - 1
    (deq,) = _int8_tables(q)   # one table, both sites read it
    np.testing.assert_allclose(deq, table.astype(np.float16), atol=np.abs(table).max() / 250)
    idx = rng.integers(-1, N, (7, K)).astype(np.int32)
    w = rng.uniform(0.1, 2.0, (7, K)).astype(np.float32)
    jdx = rng.integers(0, N, (4, 3)).astype(np.int64)   # 4 rows: told apart by shape
    path = tmp_path / "int8.tflite"
    path.write_bytes(q)
    out = run_in(interpreter, str(path), [idx, w, jdx], tmp_path)
    want = [embedding_bag(deq, idx, w, "mean"), embedding_bag(deq, jdx, None, "sum")]
    assert sorted(o.shape for o in out) == [(4, D), (7, D)]
    for o in out:
        np.testing.assert_allclose(o, want[0] if len(o) == 7 else want[1], rtol=1e-5, atol=1e-5)


def test_a_float16_table_a_stock_gather_also_reads_stays_float(tmp_path):
    from pkm_serve import ops
    rng = np.random.default_rng(32)
    table = rng.standard_normal((N, D)).astype(np.float32)
    const = tf.constant(table)
    fn = lambda i: (ops.embedding_bag(const, i, None), tf.reduce_sum(tf.gather(const, i), axis=1))  # noqa: E731
    f16 = _convert_float16(fn, [tf.TensorSpec([None, K], tf.int32)])
    # the gather would read int8 rows as float; the refusal says why, as for float32 tables
    with pytest.raises(ValueError, match=r"^no constant .* found that only PkmEmbeddingBag reads "
                                         r"\(1 read elsewhere too, left float\)$"):
        tflite.quantize_table_int8(f16)
    idx = rng.integers(0, N, (3, K)).astype(np.int32)
    out = tflite.run_tflite(f16, [idx])
    for o in out:   # the float16 model itself still runs: both outputs are the float16 table's sums
        np.testing.assert_allclose(o, embedding_bag(table.astype(np.float16).astype(np.float64), idx, None, "sum"),
                                   rtol=1e-5, atol=1e-5)


def test_two_signatures_sharing_the_float16_table_both_read_int8():
    """The converter stores the table once for both signatures' subgraphs; the rewrite stores
    its row scales and zero points once too (it wrote one copy per signature's tensor)."""
    from pkm_serve import ops
    table = np.random.default_rng(33).standard_normal((N, D)).astype(np.float32)

    class Two(tf.Module):
        def __init__(self):
            self.t = tf.constant(table)

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32)])
        def a(self, i):
            return {"x": ops.embedding_bag(self.t, i, None)}

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int32)])
        def b(self, i):
            return {"y": ops.embedding_bag(self.t, i, None, combiner="mean")}

    m = Two()
    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [m.a.get_concrete_function(), m.b.get_concrete_function()], m)
    converter.allow_custom_ops = True
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]
    q = tflite.quantize_table_int8(converter.convert())
    deq = _int8_tables(q)[0]
    schema = tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(q), 0))
    quant = [t.quantization for sg in model.subgraphs for t in sg.tensors if t.type == schema.TensorType.INT8]
    assert len(quant) == 2   # one table tensor in each signature's subgraph, the same scales in both
    for q_params in quant:
        np.testing.assert_array_equal(q_params.scale, quant[0].scale)
        np.testing.assert_array_equal(q_params.zeroPoint, quant[0].zeroPoint)
    assert q.count(np.asarray(quant[0].scale, np.float32).tobytes()) == 1
    assert q.count(np.asarray(quant[0].zeroPoint, np.int64).tobytes()) == 1
    assert tflite.check_int8_tables(q) == 1   # (it counted the table once per signature)
    interp = tflite.make_interpreter(q)
    i, j = np.array([[1, 2, -1], [0, 5, 5]], np.int32), np.array([[3, 4]], np.int32)
    np.testing.assert_allclose(interp.get_signature_runner("a")(i=i)["x"],
                               embedding_bag(deq, i, None, "sum"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(interp.get_signature_runner("b")(i=j)["y"],
                               embedding_bag(deq, j, None, "mean"), rtol=1e-5, atol=1e-6)
