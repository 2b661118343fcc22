"""Row-wise int8 tables in the op family: PkmQuantizedEmbeddingBag (dense and ragged) in TF eager,
tf.function and XLA, the core through the C ABI, and the TFLite kernel on the same layout, each
against the float64 reference of the dequantised table (tests/reference.py)."""
import ctypes
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import quantized, tflite
from tests import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, D = 300, 40


def random_table(seed, param_dtype=np.float32, n=N, d=D):
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, size=(n, d)).astype(np.int8)
    scales = rng.uniform(0.001, 0.05, size=n).astype(param_dtype)
    biases = rng.uniform(-1, 1, size=n).astype(param_dtype)
    return q, scales, biases


def assert_matches(got, want, rtol=1e-5):
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max()) if np.size(want) else 0.0, 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("param_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_dense_eager_matches_reference(param_dtype, combiner, index_dtype):
    q, scales, biases = random_table(len(combiner), param_dtype)
    rng = np.random.default_rng(3)
    idx = rng.integers(-1, N, size=(4, 5, 9)).astype(index_dtype)  # rank 3, -1 = padding
    w = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)
    table64 = reference.dequantize_rows(q, scales, biases)
    got = quantized.embedding_bag(quantized.QuantizedTable(q, scales, biases), idx, w, combiner)
    assert got.dtype == tf.float32 and got.shape == (4, 5, D)
    assert_matches(got.numpy(), reference.embedding_bag(table64, idx, w, combiner))
    unweighted = quantized.embedding_bag(quantized.QuantizedTable(q, scales, None), idx, combiner=combiner)
    assert_matches(unweighted.numpy(), reference.embedding_bag(reference.dequantize_rows(q, scales), idx, None,
                                                               combiner))


@pytest.mark.parametrize("out_dtype", [tf.float16, tf.bfloat16])
def test_half_weights_give_half_outputs(out_dtype):
    q, scales, biases = random_table(9)
    idx = np.random.default_rng(1).integers(0, N, size=(6, 7))
    w = np.random.default_rng(2).uniform(0.1, 1, size=idx.shape)
    got = quantized.embedding_bag(quantized.QuantizedTable(q, scales, biases), idx, tf.constant(w, out_dtype))
    assert got.dtype == out_dtype
    want = reference.embedding_bag(reference.dequantize_rows(q, scales, biases), idx,
                                   tf.cast(tf.constant(w, out_dtype), tf.float64).numpy())
    assert_matches(tf.cast(got, tf.float64).numpy(), want, rtol=2e-2)


def test_ragged_and_tf_function():
    q, scales, biases = random_table(4)
    table = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    ids = tf.ragged.constant([[1, 2, 3], [], [299, -1, 0, 5], [7]], dtype=tf.int64)
    w = tf.ragged.constant([[0.5, 1.0, 2.0], [], [1.0, 1.0, 3.0, 0.25], [2.0]])

    @tf.function
    def lookup(ids, w):
        return quantized.embedding_bag(table, ids, w, combiner="mean")

    got = lookup(ids, w)
    want = reference.ragged_embedding_bag(reference.dequantize_rows(q, scales, biases), ids.values.numpy(),
                                          ids.row_splits.numpy(), w.values.numpy(), "mean")
    assert_matches(got.numpy(), want)
    ops_in_graph = {n.op for n in lookup.get_concrete_function(ids, w).graph.as_graph_def().node}
    assert "PkmQuantizedRaggedEmbeddingBag" in ops_in_graph


@pytest.mark.parametrize("ragged", [False, True])
def test_xla_custom_call_matches_reference(ragged):
    q, scales, biases = random_table(5, np.float16)
    table = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    rng = np.random.default_rng(6)
    table64 = reference.dequantize_rows(q, scales, biases)
    if ragged:
        values = rng.integers(0, N, size=11).astype(np.int32)
        splits = np.array([0, 4, 4, 11], np.int64)

        @tf.function(jit_compile=True)
        def lookup(v, s):
            return quantized.embedding_bag(table, tf.RaggedTensor.from_row_splits(v, s), combiner="sqrtn")
        args = (tf.constant(values), tf.constant(splits))
        want = reference.ragged_embedding_bag(table64, values, splits, None, "sqrtn")
        target = "pkm_quantized_ragged_embedding_bag_forward"
    else:
        idx = rng.integers(-1, N, size=(8, 2, 6)).astype(np.int32)
        w = rng.uniform(0.1, 1, size=idx.shape).astype(np.float32)

        @tf.function(jit_compile=True)
        def lookup(i, w):
            return quantized.embedding_bag(table, i, w, combiner="mean")
        args = (tf.constant(idx), tf.constant(w))
        want = reference.embedding_bag(table64, idx, w, "mean")
        target = "pkm_quantized_embedding_bag_forward"
    assert_matches(lookup(*args).numpy(), want)
    assert f'custom_call_target="{target}"' in lookup.experimental_get_compiler_ir(*args)(stage="hlo")


def test_xla_index_error_is_invalid_argument():
    q, scales, biases = random_table(8)
    table = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    lookup = tf.function(lambda i: quantized.embedding_bag(table, i), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[3\] = 300 is out of range"):
        lookup(tf.constant([[0, 1], [2, N]]))


def test_gradient_is_a_clear_error():
    q, scales, biases = random_table(2)
    scale_var = tf.Variable(scales)
    w = tf.Variable(tf.ones([2, 3]))
    with tf.GradientTape() as tape:
        out = quantized.embedding_bag(quantized.QuantizedTable(q, scale_var, biases), [[0, 1, 2], [3, 4, 5]], w)
        loss = tf.reduce_sum(out)
    with pytest.raises(LookupError, match="PkmQuantizedEmbeddingBag has no gradient: an int8 table is for serving"):
        tape.gradient(loss, [w, scale_var])


def test_bad_inputs_are_invalid_argument():
    q, scales, biases = random_table(3)
    lib_call = quantized.embedding_bag
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 300 is out of range \[0, 300\)"):
        lib_call(quantized.QuantizedTable(q, scales, biases), [[4, N]])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="row_scales|Dimensions must be equal"):
        lib_call(quantized.QuantizedTable(q, scales[:-1], biases[:-1]), [[0, 1]])
    from pkm_serve import ops
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row_biases must be a \[300\] vector"):
        ops.load_library().pkm_quantized_embedding_bag(q, scales, biases[:7], [[0, 1]], tf.zeros([0]),
                                                       has_weights=False)
    with pytest.raises(TypeError, match="values must be int8"):
        lib_call(quantized.QuantizedTable(q.astype(np.float32), scales, biases), [[0]])
    with pytest.raises(ValueError, match="combiner must be one of sum, mean, sqrtn"):
        lib_call(quantized.QuantizedTable(q, scales, biases), [[0]], combiner="max")


@pytest.mark.parametrize("param_dtype", ["float32", "float16"])
def test_quantize_rows_error_bound(param_dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 64)).astype(np.float32) * rng.uniform(0.01, 10, size=(500, 1)).astype(np.float32)
    x[3] = 0.7  # a constant row
    values, scales, biases = quantized.quantize_rows(x, param_dtype)
    assert values.dtype == np.int8 and scales.dtype == np.dtype(param_dtype)
    deq = reference.dequantize_rows(values, scales, biases)
    span = x.max(axis=1) - x.min(axis=1)
    slack = 1e-6 if param_dtype == "float32" else 2e-3  # float16 params round the bias
    assert np.all(np.abs(deq - x) <= (span / 255 / 2 + slack * np.abs(x).max(axis=1))[:, None] + 1e-7)
    assert abs(deq[3] - 0.7).max() < (1e-6 if param_dtype == "float32" else 1e-3)
    with pytest.raises(ValueError, match="non-finite"):
        quantized.quantize_rows(np.array([[1.0, np.inf]]))


@pytest.mark.parametrize("row", [[0.0, 1.0e6], [0.0, 2.0e7], [-1.0e6, 0.0]])
def test_float16_row_parameters_out_of_range_are_refused(row):
    # The bias (or scale) rounded to inf: rows that dequantised to inf / NaN, with no error.
    table = np.array([[0.0, 1.0], row], np.float32)
    with pytest.raises(ValueError, match=r"row 1's range .* needs a scale or bias beyond float16"):
        quantized.quantize_rows(table, "float16")
    values, scales, biases = quantized.quantize_rows(table, "float32")
    deq = reference.dequantize_rows(values, scales, biases)
    assert np.abs(deq[1] - table[1]).max() <= (max(row) - min(row)) / 255


def test_core_int8_through_the_c_abi():
    sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
    import pkm_capi

    path = os.path.join(ROOT, "pkm_serve", "lib", "libpkm_capi_cpu.so")
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: run `make capi-cpu` (make test builds it)")
    lib = pkm_capi.PkmLib(path).lib  # checks the PkmBags mirror, int8-row fields included
    q, scales, biases = random_table(12)
    idx = np.random.default_rng(4).integers(-1, N, size=(7, 5)).astype(np.int64)
    bags = pkm_capi.PkmBags()
    bags.table, bags.elem_type, bags.num_rows, bags.dim = q.ctypes.data, 3, N, D
    bags.indices, bags.indices_int64, bags.num_bags, bags.bag_size = idx.ctypes.data, 1, 7, 5
    bags.num_indices = idx.size
    bags.combiner = pkm_capi.COMBINERS["sum"]
    bags.row_scales, bags.row_biases, bags.row_params_type = scales.ctypes.data, biases.ctypes.data, 0
    err = ctypes.create_string_buffer(256)
    want = reference.embedding_bag(reference.dequantize_rows(q, scales, biases), idx)
    for ref in (0, 1):
        out = np.full((7, D), np.nan, np.float32)
        assert lib.pkm_cpu_forward(ctypes.byref(bags), out.ctypes.data, ref, err, len(err)) == 0, err.value
        assert_matches(out, want)
    bags.row_scales = None
    assert lib.pkm_cpu_forward(ctypes.byref(bags), out.ctypes.data, 0, err, len(err)) == -1
    assert b"row_scales" in err.value


def _tflite_with_zero_points(q, scales, zero_points, bag_size):
    """A one-op .tflite whose int8 table carries per-row zero points (asymmetric TFLite
    quantisation): the kernel's scale * (q - zero_point) is the core's scale * q + bias."""
    schema = tflite._schema()  # pylint: disable=protected-access
    model_bytes = tflite.quantize_table_int8(tflite.build_embedding_bag_model(
        np.zeros(q.shape, np.float32) + 1.0, bag_size))
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    sub = model.subgraphs[0]
    table = sub.tensors[sub.operators[0].inputs[0]]
    model.buffers[table.buffer].data = np.frombuffer(q.tobytes(), np.uint8)
    table.quantization.scale = [float(s) for s in scales]
    table.quantization.zeroPoint = [int(z) for z in zero_points]
    import flatbuffers
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def test_tflite_kernel_shares_the_layout():
    rng = np.random.default_rng(11)
    q = rng.integers(-100, 100, size=(N, D)).astype(np.int8)
    scales = rng.uniform(0.001, 0.05, size=N).astype(np.float32)
    zero_points = rng.integers(-20, 20, size=N)
    idx = rng.integers(0, N, size=(5, 4)).astype(np.int32)
    w = rng.uniform(0.1, 1, size=idx.shape).astype(np.float32)
    got = tflite.run_tflite(_tflite_with_zero_points(q, scales, zero_points, 4), [idx, w])[0]
    biases = (-scales * zero_points).astype(np.float32)
    want = reference.embedding_bag(reference.dequantize_rows(q, scales, biases), idx, w)
    assert_matches(got, want)
    tf_op = quantized.embedding_bag(quantized.QuantizedTable(q, scales, biases), idx, w)
    assert_matches(got, tf_op.numpy().astype(np.float64))
