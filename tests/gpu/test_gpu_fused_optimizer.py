"""The CUDA fused backward + row-wise optimizer (pkm_cuda_fused_update) through
the C ABI: against the float64 reference (tests/row_optimizer_reference.py),
the core's CPU fused update, and the unfused path (the CUDA sparse gradient,
then the update in torch float32); bitwise determinism; lazy rows; hot rows cut
into pieces; several column tiles (multi-pass row-wise Adagrad); half tables;
errors. Needs a CUDA GPU, torch with CUDA and `make gpu-standalone`."""

import zlib

import numpy as np
import pytest

from gpu_common import pkm_capi, torch  # noqa: F401  (skips without CUDA)
from tests.row_optimizer_reference import apply_rows, fused_update, initial_state, touched_rows  # noqa: E402

KINDS = ["sgd", "rowwise_adagrad", "adam"]
HYPER = {"sgd": dict(learning_rate=0.05), "rowwise_adagrad": dict(learning_rate=0.05, epsilon=1e-7),
         "adam": dict(learning_rate=0.01, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=3)}


def ref_hyper(kind):
    h = dict(HYPER[kind])
    h["lr"] = h.pop("learning_rate")
    return h


def case(seed, num_rows, dim, bags, k, pad=0.1, hot=None):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((num_rows, dim)).astype(np.float32)
    idx = rng.integers(0, num_rows, size=(bags, k))
    if hot is not None:
        idx[rng.random(idx.shape) < 0.6] = hot
    idx[rng.random(idx.shape) < pad] = -1
    weights = rng.uniform(0.2, 1.5, size=idx.shape).astype(np.float32)
    grad = rng.standard_normal((bags, dim)).astype(np.float32)
    return table, idx, weights, grad


def run_gpu(lib, kind, table, idx, weights, grad, state, combiner="sum", dtype=torch.float32, options=None):
    t = torch.from_numpy(table).to(dtype).cuda()
    s = tuple(torch.from_numpy(x.copy()).cuda() for x in state)
    w = torch.from_numpy(weights).cuda()
    d_w = lib.cuda_fused_update(t, torch.from_numpy(idx).cuda(), torch.from_numpy(grad).to(dtype).cuda(), kind, s,
                                w, combiner, options=options, **HYPER[kind])
    torch.cuda.synchronize()
    return t, s, d_w


def assert_state_close(got, want, rtol=1e-5):
    for g, w in zip(got, want):
        w = np.asarray(w)
        np.testing.assert_allclose(g.cpu().numpy(), w, rtol=rtol, atol=rtol * np.abs(w).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [37, 256, 2100])  # scalar path, one tile, three tiles
def test_fused_update_matches_float64_reference(lib, kind, combiner, dim):
    table, idx, weights, grad = case(zlib.crc32(f"{kind}{combiner}{dim}".encode()), 300, dim, 40, 12)
    state = initial_state(kind, *table.shape)
    t, s, d_w = run_gpu(lib, kind, table, idx, weights, grad, state, combiner)
    want_t, want_s, want_dw = fused_update(kind, table, idx, weights, combiner, grad, state, **ref_hyper(kind))
    np.testing.assert_allclose(t.cpu().numpy(), want_t, rtol=1e-6, atol=1e-6)
    assert_state_close(s, want_s)
    valid = idx >= 0
    np.testing.assert_allclose(d_w.cpu().numpy()[valid], want_dw[valid], rtol=1e-4, atol=1e-4)
    untouched = np.setdiff1d(np.arange(table.shape[0]), touched_rows(idx, table.shape[0]))
    assert untouched.size > 0
    assert np.array_equal(t.cpu().numpy()[untouched], table[untouched])
    for got, before in zip(s, state):
        assert np.array_equal(got.cpu().numpy()[untouched], before[untouched])


@pytest.mark.parametrize("kind", KINDS)
def test_fused_equals_cpu_core_and_unfused_sparse_gradient(lib, kind):
    table, idx, weights, grad = case(9, 2000, 512, 256, 32)
    state = initial_state(kind, *table.shape)
    t, s, d_w = run_gpu(lib, kind, table, idx, weights, grad, state)
    # the core's CPU fused update
    ct = torch.from_numpy(table.copy())
    cs = tuple(torch.from_numpy(x.copy()) for x in state)
    c_dw = lib.cpu_fused_update(ct, torch.from_numpy(idx), torch.from_numpy(grad), kind, cs,
                                torch.from_numpy(weights), **HYPER[kind])
    np.testing.assert_allclose(t.cpu().numpy(), ct.numpy(), rtol=1e-6, atol=1e-7)
    assert_state_close(s, [x.numpy() for x in cs], rtol=1e-6)
    np.testing.assert_allclose(d_w.cpu().numpy(), c_dw.numpy(), rtol=1e-5, atol=1e-5)
    # unfused: the CUDA sparse gradient, then the update (float32 torch on the GPU)
    gt = torch.from_numpy(table).cuda()
    rows, row_grads, _ = lib.cuda_sparse_backward(gt, torch.from_numpy(idx).cuda(), torch.from_numpy(grad).cuda(),
                                                  torch.from_numpy(weights).cuda(), "sum")
    want_t, want_s = apply_rows(kind, table, row_grads.cpu().numpy(), rows.cpu().numpy(), state, **ref_hyper(kind))
    np.testing.assert_allclose(t.cpu().numpy(), want_t, rtol=1e-6, atol=1e-7)
    assert_state_close(s, want_s, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_hot_rows_in_pieces_are_correct_and_bitwise_deterministic(lib, kind):
    table, idx, weights, grad = case(4, 64, 1024, 400, 24, hot=7)
    state = initial_state(kind, *table.shape)
    opts = {"long_segment_entries": 64}  # row 7 has ~5800 entries: ~90 pieces
    first = run_gpu(lib, kind, table, idx, weights, grad, state, options=opts)
    want_t, want_s, _ = fused_update(kind, table, idx, weights, "sum", grad, state, **ref_hyper(kind))
    # Row 7's gradient is a float32 sum of ~5800 terms of magnitude ~1 (the
    # float64 reference's error bound is ~sqrt(5800) ulp of the sum): 2e-5.
    np.testing.assert_allclose(first[0].cpu().numpy(), want_t, rtol=2e-5, atol=2e-5)
    assert_state_close(first[1], want_s, rtol=5e-5)
    for _ in range(3):
        again = run_gpu(lib, kind, table, idx, weights, grad, state, options=opts)
        assert torch.equal(again[0], first[0]) and torch.equal(again[2], first[2])
        assert all(torch.equal(a, b) for a, b in zip(again[1], first[1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_tables_with_float32_state(lib, dtype):
    table, idx, weights, grad = case(12, 500, 256, 64, 16)
    table = torch.from_numpy(table).to(dtype).float().numpy()  # representable start
    state = initial_state("adam", *table.shape)
    t, s, _ = run_gpu(lib, "adam", table, idx, weights, grad, state, dtype=dtype)
    g16 = torch.from_numpy(grad).to(dtype).float().numpy()
    want_t, want_s, _ = fused_update("adam", table, idx, weights, "sum", g16, state, **ref_hyper("adam"))
    np.testing.assert_allclose(t.float().cpu().numpy(), want_t, rtol=1e-2, atol=1e-2)
    assert_state_close(s, want_s, rtol=1e-4)


def test_fused_update_bad_arguments(lib):
    table = torch.randn(10, 8, device="cuda")
    idx = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    grad = torch.randn(2, 8, device="cuda")
    with pytest.raises(pkm_capi.PkmError, match="adam needs both moments"):
        lib.cuda_fused_update(table, idx, grad, "adam", (), learning_rate=0.1)
    m = torch.zeros(10, 8, device="cuda")
    with pytest.raises(pkm_capi.PkmError, match="step must be >= 1"):
        lib.cuda_fused_update(table, idx, grad, "adam", (m, m.clone()), learning_rate=0.1, step=0)
    with pytest.raises(pkm_capi.PkmError, match="workspace"):
        lib.cuda_fused_update(table, idx, grad, "sgd", (), learning_rate=0.1,
                              workspace=torch.empty(1, dtype=torch.uint8, device="cuda"))
