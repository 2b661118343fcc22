"""The core's fused backward + row-wise optimizer through the C ABI (CPU, runs
in CI): pkm_cpu_fused_update against the float64 reference
(tests/row_optimizer_reference.py), against the unfused path (the core's
sparse gradient, then the same update in numpy float32), bitwise determinism
across thread counts, and errors."""

import ctypes
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
import pkm_capi  # noqa: E402

from tests.capi.test_capi_cpu_abi import bags_for, lib  # noqa: E402,F401  (fixture)
from tests.row_optimizer_reference import apply_rows, fused_update, initial_state, touched_rows  # noqa: E402

KINDS = ["sgd", "rowwise_adagrad", "adam"]
HYPER = {"sgd": dict(lr=0.05), "rowwise_adagrad": dict(lr=0.05, epsilon=1e-7),
         "adam": dict(lr=0.01, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=3)}


def make_opt(kind, state, lr, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=1):
    opt = pkm_capi.PkmRowOptimizer()
    opt.kind = pkm_capi.OPTIMIZERS[kind]
    opt.learning_rate, opt.epsilon, opt.beta_1, opt.beta_2, opt.step = lr, epsilon, beta_1, beta_2, step
    opt.state0 = state[0].ctypes.data if len(state) > 0 else None
    opt.state1 = state[1].ctypes.data if len(state) > 1 else None
    return opt


def run_fused(lib, kind, table, indices, weights, combiner, grad, state, threads=1):
    table, state = table.copy(), tuple(s.copy() for s in state)
    d_weights = np.full_like(weights, np.nan) if weights is not None else None
    err = ctypes.create_string_buffer(512)
    rc = lib.pkm_cpu_fused_update(ctypes.byref(bags_for(table, indices, weights, combiner)), grad.ctypes.data,
                                  ctypes.byref(make_opt(kind, state, **HYPER[kind])),
                                  d_weights.ctypes.data if d_weights is not None else None, threads, err, len(err))
    assert rc == 0, err.value
    return table, state, d_weights


def problem(seed, num_rows=40, dim=12, bags=10, k=7, weighted=True):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((num_rows, dim)).astype(np.float32)
    indices = rng.integers(-1, num_rows, size=(bags, k)).astype(np.int64)
    indices[0, :3] = 5  # a row repeated inside one bag
    weights = rng.uniform(0.2, 1.5, size=indices.shape).astype(np.float32) if weighted else None
    grad = rng.standard_normal((bags, dim)).astype(np.float32)
    return table, indices, weights, grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_fused_update_matches_the_float64_reference(lib, kind, combiner):
    table, indices, weights, grad = problem(3 + len(combiner))
    state = initial_state(kind, *table.shape)
    got_table, got_state, got_dw = run_fused(lib, kind, table, indices, weights, combiner, grad, state)
    want_table, want_state, want_dw = fused_update(kind, table, indices, weights, combiner, grad, state,
                                                   **HYPER[kind])
    np.testing.assert_allclose(got_table, want_table, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_state, want_state):  # float32 gradient sums vs float64: scale-relative
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    valid = (indices >= 0)
    np.testing.assert_allclose(got_dw[valid], want_dw[valid], rtol=1e-5, atol=1e-5)
    assert (got_dw[~valid] == 0).all()
    untouched = np.setdiff1d(np.arange(table.shape[0]), touched_rows(indices, table.shape[0]))
    assert untouched.size > 0
    np.testing.assert_array_equal(got_table[untouched], table[untouched])
    for got, before in zip(got_state, state):
        np.testing.assert_array_equal(got[untouched], before[untouched])


def unfused(lib, kind, table, indices, weights, combiner, grad, state):
    """The core's sparse gradient, then the update in numpy float32."""
    keep = {}

    def alloc(_ctx, num_rows, rows_p, grads_p):
        keep["rows"] = np.empty(num_rows, np.int64)
        keep["grads"] = np.empty((num_rows, table.shape[1]), np.float32)
        rows_p[0] = keep["rows"].ctypes.data if num_rows else None
        grads_p[0] = keep["grads"].ctypes.data if num_rows else None
        return 0

    callback = pkm_capi.SPARSE_ALLOC_FN(alloc)
    err = ctypes.create_string_buffer(512)
    d_weights = np.empty_like(weights)  # the same row pass as the fused one (gradient and dots)
    rc = lib.pkm_cpu_sparse_backward(ctypes.byref(bags_for(table, indices, weights, combiner)), grad.ctypes.data,
                                     callback, None, d_weights.ctypes.data, err, len(err))
    assert rc == 0, err.value
    new_table, new_state = apply_rows(kind, table, keep["grads"], keep["rows"], state, **HYPER[kind])
    return new_table.astype(np.float32), tuple(s.astype(np.float32) for s in new_state)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_equals_the_unfused_sparse_gradient_then_update(lib, kind):
    table, indices, weights, grad = problem(11, num_rows=300, dim=33, bags=64, k=16)
    state = initial_state(kind, *table.shape)
    got_table, got_state, _ = run_fused(lib, kind, table, indices, weights, "sum", grad, state)
    want_table, want_state = unfused(lib, kind, table, indices, weights, "sum", grad, state)
    np.testing.assert_allclose(got_table, want_table, rtol=1e-6, atol=1e-7)
    for got, want in zip(got_state, want_state):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("kind", KINDS)
def test_fused_update_is_bitwise_deterministic_across_threads(lib, kind):
    table, indices, weights, grad = problem(5, num_rows=500, dim=20, bags=128, k=16)
    state = initial_state(kind, *table.shape)
    first = run_fused(lib, kind, table, indices, weights, "mean", grad, state, threads=1)
    for threads in (1, 3, 4):
        again = run_fused(lib, kind, table, indices, weights, "mean", grad, state, threads=threads)
        assert again[0].tobytes() == first[0].tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(again[1], first[1]))
        assert again[2].tobytes() == first[2].tobytes()


def test_fused_update_errors_name_the_problem(lib):
    table, indices, weights, grad = problem(1)
    err = ctypes.create_string_buffer(512)

    def call(opt, idx=indices):
        return lib.pkm_cpu_fused_update(ctypes.byref(bags_for(table, idx, weights, "sum")), grad.ctypes.data,
                                        ctypes.byref(opt), None, 1, err, len(err))

    before = table.copy()
    bad = make_opt("sgd", (), 0.1)
    bad.kind = 7
    assert call(bad) == -1 and b"optimizer kind" in err.value
    assert call(make_opt("adam", (), 0.1)) == -1 and b"adam needs both moments" in err.value
    assert call(make_opt("rowwise_adagrad", (), 0.1)) == -1 and b"accumulator" in err.value
    m, v = initial_state("adam", *table.shape)
    assert call(make_opt("adam", (m, v), 0.1, step=0)) == -1 and b"step must be >= 1" in err.value
    bad_idx = indices.copy()
    bad_idx[2, 1] = 999
    assert call(make_opt("sgd", (), 0.1), bad_idx) == -1 and b"indices[15] = 999" in err.value
    np.testing.assert_array_equal(table, before)  # nothing written on error
