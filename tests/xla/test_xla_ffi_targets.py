"""The custom-call targets (typed FFI handlers) run inside another XLA
runtime, JAX's, against the float64 numpy reference: the CUDA handlers of
embedding_bag_xla_gpu_targets.cc on a GPU (libpkm_xla_gpu.so, `make gpu`) and
the Host handlers of embedding_bag_xla_cpu_targets.cc on the CPU
(libpkm_xla_cpu.so, `make xla-targets-cpu`).

The lent GPU machine has no TensorFlow with GPU support, so this is how the
very handlers that _pkm_ops_gpu.so registers with TF's XLA run on a GPU: same
FFI ABI, XLA's own stream and scratch allocator. Each platform is skipped
without JAX, its device or its library (JAX is not a project dependency):

    CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q tests/xla/test_xla_ffi_targets.py
"""

import ctypes
import os

import numpy as np
import pytest

from tests.reference import bag_forward_backward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLATFORMS = {  # JAX device kind -> (library, symbol prefix, XLA platform name)
    "cpu": ("libpkm_xla_cpu.so", "pkm_xla_cpu", "cpu"),
    "gpu": ("libpkm_xla_gpu.so", "pkm_xla_gpu", "CUDA"),
}
TARGETS = {  # custom-call target -> exported handler, after the prefix
    "pkm_embedding_bag_forward": "forward",
    "pkm_embedding_bag_backward": "backward",
    "pkm_ragged_embedding_bag_forward": "ragged_forward",
    "pkm_ragged_embedding_bag_backward": "ragged_backward",
}
COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}
TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
N, D = 300, 40


class Runtime:
    def __init__(self, jax, device, kind):
        self.jax, self.device, self.kind = jax, device, kind


@pytest.fixture(scope="module", params=sorted(PLATFORMS))
def xla_runtime(request):
    """JAX on one device kind, with our handlers registered for its platform."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # int64 indices and row_splits stay int64
    kind = request.param
    library, prefix, platform = PLATFORMS[kind]
    try:
        devices = jax.devices(kind)
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip(f"no {kind} device visible to JAX")
    path = os.path.join(ROOT, "pkm_serve", "lib", library)
    if not os.path.exists(path):
        pytest.skip(f"{path} not built")
    lib = ctypes.CDLL(path)
    for target, handler in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, f"{prefix}_{handler}")),
                                    platform=platform)
    return Runtime(jax, devices[0], kind)


def assert_close(actual, expected, dtype_name, what):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = np.max(np.abs(actual - expected) / (1.0 + np.abs(expected))) if actual.size else 0.0
    assert err <= TOL[dtype_name], f"{what}: max relative error {err:.3g} > {TOL[dtype_name]}"


def run_targets(rt, table, index_args, weights, combiner, grad, ragged):
    """Forward and backward custom calls inside one jitted XLA computation on rt's device."""
    import jax.numpy as jnp

    jax = rt.jax
    put = lambda x: jax.device_put(x, rt.device)  # noqa: E731
    table, grad, index_args = put(table), put(grad), tuple(put(x) for x in index_args)
    weights = None if weights is None else put(weights)
    has_weights = weights is not None
    w = weights if has_weights else put(jnp.zeros([0], table.dtype))
    num_bags = grad.shape[0]
    attrs = dict(combiner=np.int32(COMBINERS[combiner]), has_weights=np.int32(has_weights))
    prefix = "pkm_ragged_embedding_bag" if ragged else "pkm_embedding_bag"

    @jax.jit
    def step(table, index_args, w, grad):
        out = jax.ffi.ffi_call(f"{prefix}_forward", jax.ShapeDtypeStruct((num_bags, table.shape[1]), table.dtype))(
            table, *index_args, w, **attrs)
        d_table, d_w = jax.ffi.ffi_call(
            f"{prefix}_backward",
            (jax.ShapeDtypeStruct(table.shape, table.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype)))(
            grad, table, *index_args, w, **attrs)
        return out, d_table, d_w

    return [np.asarray(x.astype(jnp.float32)) for x in step(table, index_args, w, grad)]


@pytest.mark.parametrize("with_weights", [True, False])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_dense_targets_match_reference(xla_runtime, combiner, dtype_name, with_weights):
    import jax.numpy as jnp

    rng = np.random.default_rng([len(combiner), len(dtype_name), with_weights])
    dtype = getattr(jnp, dtype_name)
    b, k = 70, 9
    indices = rng.integers(0, N, size=(b, k))
    indices[rng.random(indices.shape) < 0.2] = -1
    indices[3] = -1
    indices[5, :4] = 7  # a hot row
    table = jnp.asarray(rng.normal(size=(N, D)), dtype)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, size=(b, k)), dtype) if with_weights else None
    grad = jnp.asarray(rng.normal(size=(b, D)), dtype)
    idx = jnp.asarray(indices, jnp.int32 if with_weights else jnp.int64)
    got = run_targets(xla_runtime, table, (idx,), weights, combiner, grad, ragged=False)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    w_rows = f64(weights).tolist() if with_weights else None
    ref_out, ref_dt, ref_dw = bag_forward_backward(f64(table), indices.tolist(), w_rows, combiner, f64(grad))
    assert_close(got[0], ref_out, dtype_name, "output")
    assert_close(got[1], ref_dt, dtype_name, "d_table")
    assert_close(got[2], np.asarray(ref_dw) if with_weights else np.zeros([0]), dtype_name, "d_weights")


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_ragged_targets_match_reference(xla_runtime, combiner, dtype_name):
    import jax.numpy as jnp

    rng = np.random.default_rng(len(combiner) + 10 * len(dtype_name))
    dtype = getattr(jnp, dtype_name)
    lengths = rng.integers(0, 12, size=50)
    lengths[4] = 0
    rows = [list(rng.integers(-1, N, size=n)) for n in lengths]
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(rows).astype(np.int64)
    table = jnp.asarray(rng.normal(size=(N, D)), dtype)
    w_values = jnp.asarray(rng.uniform(0.1, 2.0, size=values.shape), dtype)
    grad = jnp.asarray(rng.normal(size=(len(rows), D)), dtype)
    got = run_targets(xla_runtime, table, (jnp.asarray(values), jnp.asarray(splits)), w_values, combiner, grad,
                      ragged=True)
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    w_flat = f64(w_values)
    w_rows = [list(w_flat[splits[i]:splits[i + 1]]) for i in range(len(rows))]
    ref_out, ref_dt, ref_dw = bag_forward_backward(f64(table), rows, w_rows, combiner, f64(grad))
    assert_close(got[0], ref_out, dtype_name, "ragged output")
    assert_close(got[1], ref_dt, dtype_name, "ragged d_table")
    assert_close(got[2], np.concatenate(ref_dw), dtype_name, "ragged d_weights")


def _out_of_range_case():
    import jax.numpy as jnp

    rng = np.random.default_rng(9)
    indices = rng.integers(0, N, size=(8, 5))
    indices[2, 1] = N
    indices[6, 4] = N + 1000
    table = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, size=indices.shape), jnp.float32)
    grad = jnp.asarray(rng.normal(size=(8, D)), jnp.float32)
    return indices, table, weights, grad


def test_out_of_range_index(xla_runtime):
    """CPU: the core's InvalidArgument, through XLA. GPU: the documented device
    behaviour (as the TF GPU kernel): treated as padding, never read."""
    import jax.numpy as jnp

    indices, table, weights, grad = _out_of_range_case()
    if xla_runtime.kind == "cpu":
        with pytest.raises(Exception, match=r"indices\[11\] = 300 is out of range \[0, 300\)"):
            run_targets(xla_runtime, table, (jnp.asarray(indices),), weights, "mean", grad, ragged=False)
        return
    got = run_targets(xla_runtime, table, (jnp.asarray(indices),), weights, "mean", grad, ragged=False)
    as_padding = np.where(indices >= N, -1, indices)
    ref = bag_forward_backward(np.asarray(table, np.float64), as_padding.tolist(),
                               np.asarray(weights, np.float64).tolist(), "mean", np.asarray(grad, np.float64))
    for g, e, what in zip(got, [ref[0], ref[1], np.asarray(ref[2])], ["output", "d_table", "d_weights"]):
        assert_close(g, e, "float32", what)


@pytest.mark.parametrize("result", ["small", "tall", "float16", "d_table_small", "d_weights_float16"])
def test_result_buffers_of_another_size_or_type_are_refused(xla_runtime, result):
    """A hand-built ffi_call may pass any result buffers: a smaller or other-typed one was
    written past its end (SIGSEGV), a larger one came back partly unwritten."""
    import jax.numpy as jnp

    jax = xla_runtime.jax
    put = lambda x: jax.device_put(x, xla_runtime.device)  # noqa: E731
    table = put(jnp.ones((N, D), jnp.float32))
    ids = put(jnp.asarray(np.arange(24).reshape(8, 3) % N, jnp.int32))
    w, grad = put(jnp.ones((8, 3), jnp.float32)), put(jnp.ones((8, D), jnp.float32))
    attrs = dict(combiner=np.int32(0), has_weights=np.int32(1))
    spec = jax.ShapeDtypeStruct
    with pytest.raises(Exception, match="INVALID_ARGUMENT: (the output|d_params|d_weights) must hold"):
        if result in ("small", "tall", "float16"):
            shape = {"small": (1, 1), "tall": (16, D), "float16": (8, D)}[result]
            out = spec(shape, jnp.float16 if result == "float16" else jnp.float32)
            np.asarray(jax.ffi.ffi_call("pkm_embedding_bag_forward", out)(table, ids, w, **attrs))
        else:
            d_table = spec((1, 1) if result == "d_table_small" else (N, D), jnp.float32)
            d_w = spec((8, 3), jnp.float16 if result == "d_weights_float16" else jnp.float32)
            outs = jax.ffi.ffi_call("pkm_embedding_bag_backward", (d_table, d_w))(grad, table, ids, w, **attrs)
            [np.asarray(x) for x in outs]


_QUANTIZED_TARGET = """
import ctypes, numpy as np
from pkm_serve import ops
ops.load_library()
from pkm_serve._library import library_path
import jax, jax.numpy as jnp
lib = ctypes.CDLL(library_path())
jax.ffi.register_ffi_target("pkm_quantized_forward_under_test",
                            jax.ffi.pycapsule(lib.pkm_xla_cpu_quantized_forward), platform="cpu")
q, s, b = jnp.ones((10, 4), jnp.int8), jnp.ones((10,), jnp.float32), jnp.zeros((10,), jnp.float32)
ids = jnp.asarray(np.arange(6).reshape(3, 2), jnp.int32)
for shape in ((3, 4), (1, 1), (6, 4)):
    try:
        out = jax.ffi.ffi_call("pkm_quantized_forward_under_test", jax.ShapeDtypeStruct(shape, jnp.float32))(
            q, s, b, ids, jnp.zeros((0,), jnp.float32), combiner=np.int32(0), has_weights=np.int32(0))
        print(shape, np.asarray(out)[0].tolist())
    except Exception as e:
        print(shape, "refused:", str(e).split(": ", 2)[-1].split(chr(10))[0])
"""


def test_the_quantized_host_target_checks_its_output_size():
    """TF's lowering is the quantized target's only caller and sizes the output right; a
    hand-built call with another size was written past its end. A process of its own: it loads
    the TF op library's symbols into JAX."""
    import subprocess
    import sys

    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")  # the quantized targets are in TF's op library
    proc = subprocess.run([sys.executable, "-c", _QUANTIZED_TARGET], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "(3, 4) [2.0, 2.0, 2.0, 2.0]",
        "(1, 1) refused: the output must hold 12 elements, got 1",
        "(6, 4) refused: the output must hold 12 elements, got 24",
    ], proc.stdout
