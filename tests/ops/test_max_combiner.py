"""combiner="max" (torch's mode="max") in every runtime: the fused op in TF
eager, tf.function and XLA, the ragged op, the composite, TFLite, against the
float64 numpy reference (forward and d_table, ties to the first position) and
against torch 2.13's F.embedding_bag(mode="max"); weights with max refused with
the core's one message."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import bag_forward_backward, embedding_bag

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}
N, D, K = 40, 11, 6


def table_with_ties(rng, dtype):
    """Rows 5 and 9 are equal (a tie between different rows); the values are
    rounded to `dtype` so the reference sees what the kernel sees."""
    table = rng.standard_normal((N, D))
    table[9] = table[5]
    table[12, :4] = table[5, :4]  # partial ties
    table = tf.cast(table, dtype)
    return table, tf.cast(table, tf.float64).numpy()


def dense_bags(rng):
    idx = rng.integers(0, N, size=(9, K))
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[0] = -1  # all padding: 0, no gradient
    idx[1, :3] = [9, 5, 12]  # ties: row 9 comes first and takes the gradient
    idx[2, :3] = [12, 5, 9]
    return idx


def run(table, idx, upstream, mode):
    """out, d_table of sum(embedding_bag(table, idx, combiner='max') * upstream)."""
    def step(t, i):
        with tf.GradientTape() as tape:
            tape.watch(t)
            out = ops.embedding_bag(t, i, combiner="max")
            loss = tf.reduce_sum(tf.cast(out, tf.float64) * upstream)
        return out, tape.gradient(loss, t)
    if mode == "eager":
        return step(table, idx)
    return tf.function(step, jit_compile=(mode == "xla"))(table, idx)


def close(actual, expected, dtype_name, what):
    actual = tf.cast(actual, tf.float64).numpy()
    err = np.max(np.abs(actual - expected) / (1.0 + np.abs(expected)))
    assert actual.shape == expected.shape and err <= TOL[dtype_name], f"{what}: error {err:.3g}"


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_dense_forward_and_gradient_match_the_reference(dtype_name, mode):
    rng = np.random.default_rng([len(dtype_name), len(mode)])
    table, table_np = table_with_ties(rng, DTYPES[dtype_name])
    idx = dense_bags(rng)
    upstream = rng.standard_normal((idx.shape[0], D))
    out, d_table = run(table, tf.constant(idx, tf.int64), upstream, mode)
    want_out, want_dt, _ = bag_forward_backward(table_np, [list(b) for b in idx], None, "max", upstream)
    close(out, want_out, dtype_name, f"{mode} forward")
    close(d_table, want_dt, dtype_name, f"{mode} d_table")
    assert np.all(tf.cast(out[0], tf.float32).numpy() == 0)
    # (The reference gives each tie wholly to the first position: a split or
    # another winner would differ from want_dt by |upstream|, far above TOL.)


def test_rank3_indices_and_int32():
    rng = np.random.default_rng(3)
    table, table_np = table_with_ties(rng, tf.float32)
    idx = rng.integers(-1, N, size=(2, 3, K)).astype(np.int32)
    out = ops.embedding_bag(table, idx, combiner="max")
    close(out, embedding_bag(table_np, idx, None, "max"), "float32", "rank-3 forward")


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_ragged_bags_with_empty_ones(mode):
    rng = np.random.default_rng(4)
    table, table_np = table_with_ties(rng, tf.float32)
    bags = [[9, 5, 3], [], [-1, -1], [12, 5, 9, 1], [7]]
    values = [i for b in bags for i in b]
    splits = np.cumsum([0] + [len(b) for b in bags])
    upstream = rng.standard_normal((len(bags), D))

    def step(t, v, s):
        with tf.GradientTape() as tape:
            tape.watch(t)
            out = ops.embedding_bag(t, tf.RaggedTensor.from_row_splits(v, s), combiner="max")
            loss = tf.reduce_sum(tf.cast(out, tf.float64) * upstream)
        return out, tape.gradient(loss, t)
    fn = step if mode == "eager" else tf.function(step, jit_compile=True)
    out, d_table = fn(table, tf.constant(values, tf.int64), tf.constant(splits, tf.int64))
    want_out, want_dt, _ = bag_forward_backward(table_np, bags, None, "max", upstream)
    close(out, want_out, "float32", "ragged forward")
    close(d_table, want_dt, "float32", "ragged d_table")


def nan_table_and_orders():
    """3 rows x 11 columns, NaN in row 0's columns 0, 3, 6, 9 and row 1's column 10,
    and every order of the three rows as a bag (one with padding): max is NaN
    wherever a bag's row holds one, whatever the order (np.max, TF's reduce_max),
    and the gradient goes to the first NaN (np.argmax)."""
    table = np.tile(np.array([[-1.0], [2.0], [0.0]]), (1, D))
    table[0, ::3] = np.nan
    table[1, 10] = np.nan
    bags = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [-1, 2, 0]]
    return table, bags


@pytest.mark.parametrize("mode", ["eager", "function", "xla", "ragged", "ragged_xla"])
def test_nan_propagates_whatever_the_bag_order(mode):
    table_np, bags = nan_table_and_orders()
    upstream = np.random.default_rng(9).standard_normal((len(bags), D))
    table = tf.constant(table_np, tf.float32)
    if mode.startswith("ragged"):
        ids = tf.RaggedTensor.from_row_lengths(tf.constant([i for b in bags for i in b], tf.int64),
                                               [len(b) for b in bags])
        fn = tf.function(lambda t: _max_step(t, ids, upstream), jit_compile=mode == "ragged_xla")
        out, d_table = fn(table)
    else:
        out, d_table = run(table, tf.constant(bags, tf.int64), upstream, mode)
    want_out, want_dt, _ = bag_forward_backward(table_np, [[i for i in b if i >= 0] for b in bags], None, "max",
                                                upstream)
    assert np.isnan(want_out).sum() == 4 * len(bags) + 6  # the reference sees every NaN
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-6, err_msg=f"{mode} forward")
    np.testing.assert_allclose(d_table.numpy(), want_dt, rtol=1e-6, err_msg=f"{mode} d_table")
    composite = ops.embedding_bag_composite(table, tf.constant(bags, tf.int64), combiner="max")
    np.testing.assert_array_equal(np.isnan(composite.numpy()), np.isnan(want_out))


def _max_step(t, ids, upstream):
    with tf.GradientTape() as tape:
        tape.watch(t)
        out = ops.embedding_bag(t, ids, combiner="max")
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * upstream)
    return out, tape.gradient(loss, t)


def test_tflite_max_propagates_nan(tmp_path):
    from pkm_serve import tflite

    table_np, bags = nan_table_and_orders()
    for dtype in (np.float32, np.float16):
        model = tflite.build_embedding_bag_model(table_np.astype(dtype), 3, combiner="max", has_weights=False)
        idx = np.array(bags, np.int32)
        (out,) = tflite.run_tflite(model, [idx, np.ones(idx.shape, dtype)], interpreter="litert")
        np.testing.assert_allclose(out.astype(np.float64), embedding_bag(table_np, idx, None, "max"), rtol=1e-6)


@pytest.mark.parametrize("ragged", [False, True])
def test_composite_forward_matches(ragged):
    rng = np.random.default_rng(5)
    table, table_np = table_with_ties(rng, tf.bfloat16)
    idx = dense_bags(rng)
    if ragged:
        bags = [list(b[: 1 + i % K]) for i, b in enumerate(idx)] + [[]]
        rt = tf.ragged.constant(bags, tf.int64)
        got = ops.embedding_bag_composite(table, rt, combiner="max")
        want = bag_forward_backward(table_np, bags, None, "max", np.zeros((len(bags), D)))[0]
    else:
        got = ops.embedding_bag_composite(table, idx, combiner="max")
        want = embedding_bag(table_np, idx, None, "max")
    close(got, want, "bfloat16", "composite")


def test_weights_with_max_are_refused_with_the_core_message():
    table = tf.ones([4, 3])
    idx = tf.constant([[0, 1]])
    w = tf.ones([1, 2])
    with pytest.raises(ValueError, match="^" + ops.MAX_WITH_WEIGHTS_ERROR.replace("(", r"\(").replace(")", r"\)")):
        ops.embedding_bag(table, idx, w, combiner="max")
    with pytest.raises(ValueError, match="takes no weights"):
        ops.embedding_bag_composite(table, idx, w, combiner="max")
    lib = ops.load_library()
    # The op itself (has_weights=True): InvalidArgument with the same text, from the core's rule.
    with pytest.raises(tf.errors.InvalidArgumentError) as err:
        lib.pkm_embedding_bag(table, idx, w, combiner="max", has_weights=True)
    assert ops.MAX_WITH_WEIGHTS_ERROR in err.value.message
    # Traced: the shape function's rule refuses it while the graph is built (TF: ValueError).
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as err:
        tf.function(lambda: lib.pkm_embedding_bag(table, idx, w, combiner="max", has_weights=True),
                    jit_compile=True)()
    assert ops.MAX_WITH_WEIGHTS_ERROR in str(err.value)


def test_layer_accepts_max():
    from pkm_serve.layers import EmbeddingBag

    layer = EmbeddingBag(N, D, combiner="max")
    idx = np.array([[1, 2, -1], [-1, -1, -1]])
    out = layer(idx).numpy()
    table = layer.embeddings.numpy().astype(np.float64)
    np.testing.assert_allclose(out, embedding_bag(table, idx, None, "max"), rtol=1e-6)
    assert EmbeddingBag.from_config(layer.get_config()).combiner == "max"


# ---- TFLite --------------------------------------------------------------------

@pytest.mark.parametrize("interpreter", ["litert", "tf"])
def test_tflite_max_matches_the_reference(interpreter, tmp_path):
    from pkm_serve import tflite

    rng = np.random.default_rng(6)
    table, table_np = table_with_ties(rng, tf.float32)
    idx = dense_bags(rng).astype(np.int32)
    # The real converter's custom op (flexbuffer "combiner": "max", has_weights false).
    concrete = tf.function(lambda i: ops.embedding_bag(table, i, combiner="max"),
                           input_signature=[tf.TensorSpec([None, K], tf.int32)]).get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete])
    converter.allow_custom_ops = True
    path = tmp_path / "max.tflite"
    path.write_bytes(converter.convert())
    (out,) = tflite.run_tflite(str(path), [idx], interpreter=interpreter)
    np.testing.assert_allclose(out, embedding_bag(table_np, idx, None, "max"), rtol=1e-6, atol=1e-7)
    # float16 table through the model builder.
    t16 = table_np.astype(np.float16)
    model16 = tflite.build_embedding_bag_model(t16, K, combiner="max", has_weights=False)
    # has_weights=false: the weights input is a placeholder the kernel ignores.
    (out16,) = tflite.run_tflite(model16, [idx, np.ones(idx.shape, np.float16)], interpreter=interpreter)
    np.testing.assert_allclose(out16.astype(np.float64), embedding_bag(t16.astype(np.float64), idx, None, "max"),
                               rtol=1e-3)


def test_tflite_max_with_weights_fails_with_the_core_message():
    from pkm_serve import tflite

    model = tflite.build_embedding_bag_model(np.ones((4, 3), np.float32), 2, combiner="max", has_weights=True)
    with pytest.raises(Exception, match="takes no weights"):
        tflite.run_tflite(model, [np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32)], interpreter="litert")


# ---- torch 2.13 (a bench extra: skipped where it is not installed) -------------

@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_matches_torch_embedding_bag_mode_max(dtype_name):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    table, table_np = table_with_ties(rng, DTYPES[dtype_name])
    bags = [[9, 5, 3], [], [12, 5, 9, 1], [7], [5, 9], [3, 3, 3]]  # no padding: torch's offsets
    values = [i for b in bags for i in b]
    offsets = np.cumsum([0] + [len(b) for b in bags])[:-1]
    upstream = rng.standard_normal((len(bags), D)).astype(np.float32)
    tdtype = torch.float32 if dtype_name == "float32" else torch.bfloat16
    weight = torch.tensor(table_np, dtype=tdtype, requires_grad=True)
    want = torch.nn.functional.embedding_bag(torch.tensor(values), weight, torch.tensor(offsets), mode="max")
    (want.float() * torch.tensor(upstream)).sum().backward()

    rt = tf.RaggedTensor.from_row_splits(tf.constant(values, tf.int64),
                                         np.cumsum([0] + [len(b) for b in bags]))
    with tf.GradientTape() as tape:
        tape.watch(table)
        out = ops.embedding_bag(table, rt, combiner="max")
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * upstream)
    d_table = tape.gradient(loss, table)
    np.testing.assert_array_equal(tf.cast(out, tf.float32).numpy(), want.detach().float().numpy())
    np.testing.assert_allclose(tf.cast(d_table, tf.float32).numpy(), weight.grad.float().numpy(),
                               rtol=TOL[dtype_name])
