"""The fused op under tf.function(jit_compile=True): forward, d_table and
d_weights against a float64 numpy reference and against the op outside XLA,
the compiled HLO (our custom calls, no gather), errors, and the composite
fallback for a backend without a target."""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import _xla, ops
from tests.reference import bag_forward_backward

DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
N, D, K = 40, 12, 5


@pytest.fixture(scope="module", autouse=True)
def _library():
    ops.load_library()  # before the first XLA compilation registers JIT kernels
    assert "CPU" in _xla.xla_device_types(), "op library built without the XLA CPU target"


def assert_close(actual, expected, dtype_name, what):
    actual = tf.cast(actual, tf.float64).numpy() if isinstance(actual, tf.Tensor) else np.asarray(actual)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = np.max(np.abs(actual - expected) / (1.0 + np.abs(expected))) if actual.size else 0.0
    assert err <= TOL[dtype_name], f"{what}: max relative error {err:.3g} > {TOL[dtype_name]}"


def forward_and_grads(table, indices, weights, combiner, upstream):
    """out, d_table, d_weights of sum(embedding_bag(...) * upstream)."""
    with tf.GradientTape() as tape:
        tape.watch(table)
        if weights is not None:
            tape.watch(weights)
        out = ops.embedding_bag(table, indices, weights, combiner=combiner)
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * upstream)
    d_table, d_weights = tape.gradient(loss, [table, weights if weights is not None else table])
    return out, d_table, (d_weights if weights is not None else tf.zeros([0]))


def random_bags(rng, lead_shape):
    indices = rng.integers(0, N, size=lead_shape + (K,))
    indices[rng.random(indices.shape) < 0.25] = -1  # padding
    indices.reshape(-1, K)[0] = -1  # one bag of padding only: zeros, zero gradients
    weights = rng.uniform(0.1, 2.0, size=indices.shape)
    return indices, weights


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("combiner", ops.WEIGHTED_COMBINERS)
def test_jit_matches_reference_and_op_outside_xla(combiner, dtype_name, with_weights, rank):
    rng = np.random.default_rng([rank, with_weights, len(combiner), len(dtype_name)])
    dtype = DTYPES[dtype_name]
    lead = {1: (), 2: (6,), 3: (2, 3)}[rank]
    indices, weights = random_bags(rng, lead)
    table = tf.cast(tf.constant(rng.normal(size=(N, D))), dtype)
    w = tf.cast(tf.constant(weights), dtype) if with_weights else None
    idx = tf.constant(indices, tf.int64 if rank == 2 else tf.int32)
    upstream = tf.constant(rng.normal(size=lead + (D,)), tf.float32)

    jit = tf.function(forward_and_grads, jit_compile=True)
    got = jit(table, idx, w, combiner, upstream)
    outside = forward_and_grads(table, idx, w, combiner, upstream)

    # The reference sees the table and weights as rounded to dtype.
    flat_idx = indices.reshape(-1, K).tolist()
    flat_w = tf.cast(w, tf.float64).numpy().reshape(-1, K).tolist() if with_weights else None
    ref_out, ref_dt, ref_dw = bag_forward_backward(
        tf.cast(table, tf.float64).numpy(), flat_idx, flat_w, combiner, upstream.numpy().reshape(-1, D))
    expected = [ref_out.reshape(lead + (D,)), ref_dt,
                np.asarray(ref_dw).reshape(indices.shape) if with_weights else np.zeros([0])]
    for what, g, o, e in zip(["output", "d_table", "d_weights"], got, outside, expected):
        assert_close(g, e, dtype_name, f"jit {what}")
        assert_close(g, tf.cast(o, tf.float64).numpy(), dtype_name, f"jit vs outside XLA {what}")


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("combiner", ops.WEIGHTED_COMBINERS)
def test_jit_ragged_matches_reference(combiner, dtype_name):
    rng = np.random.default_rng(len(combiner) * 7 + len(dtype_name))
    dtype = DTYPES[dtype_name]
    rows = [[3, -1, 7], [], [39, 39], [-1], [0, 5, 6, 7, 8, 9]]
    row_w = [list(rng.uniform(0.1, 2.0, size=len(r))) for r in rows]
    table = tf.cast(tf.constant(rng.normal(size=(N, D))), dtype)
    idx = tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1)
    w = tf.cast(tf.ragged.constant(row_w, dtype=tf.float64, ragged_rank=1), dtype)
    upstream = tf.constant(rng.normal(size=(len(rows), D)), tf.float32)

    def f(table, values, splits, w_values):
        bags = tf.RaggedTensor.from_row_splits(values, splits)
        weights = tf.RaggedTensor.from_row_splits(w_values, splits)
        with tf.GradientTape() as tape:
            tape.watch([table, w_values])
            out = ops.embedding_bag(table, bags, weights, combiner=combiner)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * upstream)
        return [out] + tape.gradient(loss, [table, w_values])

    got = tf.function(f, jit_compile=True)(table, idx.values, idx.row_splits, w.values)
    flat_w = [list(tf.cast(r, tf.float64).numpy()) for r in w]
    ref_out, ref_dt, ref_dw = bag_forward_backward(
        tf.cast(table, tf.float64).numpy(), rows, flat_w, combiner, upstream.numpy())
    for what, g, e in zip(["output", "d_table", "d_weights"], got,
                          [ref_out, ref_dt, np.concatenate(ref_dw)]):
        assert_close(g, e, dtype_name, f"ragged jit {what}")


def _hlo(fn, *args):
    return fn.experimental_get_compiler_ir(*args)(stage="hlo")


def test_compiled_graph_calls_our_kernels_and_never_gathers():
    table = tf.Variable(tf.random.normal([N, D]))
    idx = tf.constant([[1, 2, -1], [4, 5, 6]])
    w = tf.constant([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])

    @tf.function(jit_compile=True)
    def step(idx, w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(table, idx, w, combiner="sqrtn") ** 2)
        return tape.gradient(loss, table)

    hlo = _hlo(step, idx, w)
    assert 'custom_call_target="pkm_embedding_bag_forward"' in hlo
    assert 'custom_call_target="pkm_embedding_bag_backward"' in hlo
    assert " gather(" not in hlo and "scatter(" not in hlo


def test_out_of_range_index_is_a_clear_error_under_xla():
    table = tf.random.normal([N, D])
    fwd = tf.function(lambda i: ops.embedding_bag(table, i), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[4\] = 40 is out of range \[0, 40\)"):
        fwd(tf.constant([[0, 1, 2], [3, 40, 5]]))

    @tf.function(jit_compile=True)
    def grad_only(i):  # the backward's own check (the forward is not needed for d_table)
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(ops.embedding_bag(table, i))
        return tape.gradient(loss, table)

    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        grad_only(tf.constant([[0, 1, 2], [3, 99, 5]]))
    ragged = tf.function(lambda v, s: ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(v, s)),
                         jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"out of range \[0, 40\)"):
        ragged(tf.constant([1, 2, 41], tf.int64), tf.constant([0, 1, 3], tf.int64))


def test_zero_sized_results_still_check_ids_under_xla():
    """XLA replaced a custom call whose results are all zero-sized by constants, so under jit_compile a
    [N, 0] table took an index >= N, and ragged bags with no bags took row_splits [0] beside values,
    without the error they get outside XLA; now both fail with the kernel's message."""
    table = tf.zeros([N, 0])
    fwd = tf.function(lambda i: ops.embedding_bag(table, i), jit_compile=True)
    assert fwd(tf.constant([[0, 1], [-1, N - 1]])).shape == (2, 0)
    for run in (lambda i: ops.embedding_bag(table, i), fwd):  # outside XLA it was an error already
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[3\] = 40 is out of range \[0, 40\)"):
            run(tf.constant([[0, 1], [2, N]]))

    @tf.function(jit_compile=True)
    def d_table(i):  # the backward alone: d_table [N, 0], no d_weights
        with tf.GradientTape() as tape:
            tape.watch(table)
            loss = tf.reduce_sum(ops.embedding_bag(table, i))
        return tape.gradient(loss, table)

    assert d_table(tf.constant([[0, 1]])).shape == (N, 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 40 is out of range"):
        d_table(tf.constant([[0, N]]))
    ragged = tf.function(lambda t, v, s: ops.embedding_bag(t, tf.RaggedTensor.from_row_splits(v, s, validate=False)),
                         jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[2\] = 41 is out of range \[0, 40\)"):
        ragged(table, tf.constant([1, 2, 41]), tf.constant([0, 1, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"row_splits\[-1\] = 0 must equal the number of values \(2\)"):
        ragged(tf.random.normal([N, D]), tf.constant([1, 2]), tf.constant([0]))


def test_bad_shapes_fail_at_compile_time_with_the_kernels_message():
    table = tf.random.normal([N, D])
    # Unknown dims at trace time: the shape function cannot reject it, the lowering must.
    spec = [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.float32)]
    f = tf.function(lambda i, w: ops.load_library().pkm_embedding_bag(table, i, w), jit_compile=True,
                    input_signature=spec)
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights must have the shape of indices"):
        f(tf.constant([[0, 1]]), tf.constant([[1.0, 2.0, 3.0]]))


def test_backend_without_target_falls_back_to_composite_with_one_warning(monkeypatch):
    monkeypatch.setattr(_xla, "_xla_device_types", frozenset())  # as if the library had no CPU target
    monkeypatch.setattr(_xla, "_xla_fallback_warned", set())
    table = tf.constant(np.random.default_rng(0).normal(size=(N, D)), tf.float32)
    idx = tf.constant([[1, 2, -1], [4, 5, 6]])
    fwd = tf.function(lambda i: ops.embedding_bag(table, i, combiner="mean"), jit_compile=True)
    with pytest.warns(RuntimeWarning, match="no XLA custom-call target for CPU.*materialises"):
        got = fwd(idx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        tf.function(lambda i: ops.embedding_bag(table, i), jit_compile=True)(idx)
    hlo = _hlo(fwd, idx)
    assert "pkm_embedding_bag" not in hlo and "gather(" in hlo
    ref, _, _ = bag_forward_backward(table.numpy(), idx.numpy().tolist(), None, "mean", np.zeros((2, D)))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ops.COMBINERS)
def test_composite_under_xla_treats_an_index_past_the_table_as_padding(monkeypatch, combiner):
    """XLA drops the composite's Assert and clamps a gather's ids, so an id >= N read row N-1
    (and its gradient went there) where the library has no target for the device. Such an id
    is now padding there, as on the GPU (DESIGN.md "The op"); outside XLA it stays an error."""
    monkeypatch.setattr(_xla, "_xla_device_types", frozenset())  # as if the library had no CPU target
    monkeypatch.setattr(_xla, "_xla_fallback_warned", {"CPU"})  # warned already
    rng = np.random.default_rng(3)
    table = tf.constant(rng.normal(size=(N, D)), tf.float32)
    bags = [[1, N, -1], [N + 3, 4, 5], [N, N + 1, -1]]
    weights = None if combiner == "max" else rng.uniform(0.5, 2.0, size=(3, 3))
    upstream = rng.normal(size=(3, D))
    padded = [[i if i < N else -1 for i in bag] for bag in bags]  # the GPU rule
    want, want_d_table, _ = bag_forward_backward(table.numpy(), padded, weights, combiner, upstream)
    w = None if weights is None else tf.constant(weights, tf.float32)
    for ragged in (False, True):
        ids = tf.ragged.constant(bags, dtype=tf.int64) if ragged else tf.constant(bags, tf.int64)
        wts = None if w is None else (tf.RaggedTensor.from_tensor(w) if ragged else w)

        @tf.function(jit_compile=True)
        def step(t):
            with tf.GradientTape() as tape:
                tape.watch(t)
                out = ops.embedding_bag(t, ids, wts, combiner=combiner)
                loss = tf.reduce_sum(out * upstream)
            return out, tape.gradient(loss, t)

        out, d_table = step(table)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"ragged={ragged}")
        np.testing.assert_allclose(tf.convert_to_tensor(d_table).numpy(), want_d_table, rtol=1e-5, atol=1e-6)
        with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
            ops.embedding_bag_composite(table, ids, wts, combiner=combiner)  # not under XLA


def test_composite_refuses_weights_not_shaped_like_the_ids(monkeypatch):
    """The fused op refuses weights of another shape than the ids; the composite broadcast
    them (tf.where), so under XLA without a target ops.embedding_bag took [B] weights for
    [B, K] ids, and outside XLA a mismatch failed in SelectV2. Both now get the op's message."""
    monkeypatch.setattr(_xla, "_xla_device_types", frozenset())  # as if the library had no CPU target
    monkeypatch.setattr(_xla, "_xla_fallback_warned", {"CPU"})  # warned already
    table = tf.random.normal([N, D])
    ids, per_bag = tf.constant([[1, 2], [3, 4]]), tf.constant([2.0, 3.0])
    want = r"weights shape \(2,\) must equal indices shape \(2, 2\)"
    with pytest.raises(ValueError, match=want):
        ops.embedding_bag(table, ids, per_bag)  # the fused op, eagerly
    with pytest.raises(ValueError, match=want):
        tf.function(lambda: ops.embedding_bag(table, ids, per_bag), jit_compile=True)()
    with pytest.raises(ValueError, match=r"weights shape \(1, 3\) must equal indices shape \(1, 2\)"):
        ops.embedding_bag_composite(table, [[1, 2]], tf.ones([1, 3]))
    # Shapes known only when the graph runs: an error there, not a broadcast.
    spec = [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.float32)]
    run = tf.function(lambda i, w: ops.embedding_bag_composite(table, i, w), input_signature=spec)
    with pytest.raises(tf.errors.InvalidArgumentError):
        run(ids, tf.constant([[2.0, 3.0]]))


def test_compile_device_is_seen_only_while_tracing_for_xla():
    seen = []

    def probe():
        seen.append(_xla.compile_device_type())
        return tf.constant(1.0)

    probe()
    tf.function(probe)()
    tf.function(probe, jit_compile=True)()
    with tf.device("/CPU:0"):
        tf.function(lambda: tf.function(probe)(), jit_compile=True)()  # nested in a jit function
    assert seen == [None, None, "CPU", "CPU"]


def test_library_loaded_after_tf_ran_xla_still_lowers():
    """TF builds its XLA JIT kernels once per process; a library loaded after
    that must still register its lowering (pkm_xla_register_late)."""
    import subprocess
    import sys

    script = (
        "import tensorflow as tf\n"
        "tf.function(lambda x: x * 2, jit_compile=True)(tf.constant(1.0))\n"  # TF's registration runs here
        "from pkm_serve import ops\n"
        "t = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])\n"
        "f = tf.function(lambda i: ops.embedding_bag(t, i, combiner='mean'), jit_compile=True)\n"
        "print(f(tf.constant([[0, 2], [1, -1]])).numpy().tolist())\n"
        "print('pkm_embedding_bag_forward' in f.experimental_get_compiler_ir(tf.constant([[0, 2]]))('hlo'))\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == "[[3.0, 4.0], [3.0, 4.0]]" and lines[-1] == "True", proc.stdout


def test_sparse_gradient_under_xla_is_a_clear_error_and_layers_opt_out_of_jit():
    from pkm_serve.layers import EmbeddingBag

    table = tf.Variable(np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32))

    @tf.function(jit_compile=True)
    def step(idx):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ops.embedding_bag(table, idx, sparse_gradient=True))
        return tape.gradient(loss, table)

    with pytest.raises(ValueError, match="sparse_gradient=True cannot be compiled by XLA"):
        step(tf.constant([[1, 2]]))
    # Keras' jit_compile="auto" must keep such a layer outside XLA.
    assert EmbeddingBag(16, 4, sparse_gradient=True).supports_jit is False
    assert EmbeddingBag(16, 4).supports_jit is True


@pytest.mark.parametrize("kind", ("constant", "variable", "layer"))
def test_sparse_gradient_inference_under_xla_is_the_plain_lookup(kind):
    """No tape records: nothing has a data-dependent shape, so a sparse_gradient=True lookup served
    under jit_compile is the plain one (it was the ValueError meant for training)."""
    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(11)
    table = rng.standard_normal((N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=(6, K))
    weights = rng.uniform(0.1, 1.0, size=idx.shape).astype(np.float32)
    if kind == "layer":
        layer = EmbeddingBag(N, D, combiner="sqrtn", sparse_gradient=True)
        layer.build()
        layer.embeddings.assign(table)
        serve = tf.function(lambda i, w: layer(i, w), jit_compile=True)
    else:
        params = tf.constant(table) if kind == "constant" else tf.Variable(table)
        serve = tf.function(lambda i, w: ops.embedding_bag(params, i, w, "sqrtn", sparse_gradient=True),
                            jit_compile=True)
    out = serve(tf.constant(idx, tf.int32), tf.constant(weights))
    want, _, _ = bag_forward_backward(table, idx.tolist(), weights.tolist(), "sqrtn", np.zeros((6, D)))
    assert_close(out, want, "float32", "forward")
