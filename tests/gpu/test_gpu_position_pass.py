"""The narrow-row backward walked by sorted position (kernels/cuda/backward_positions.cu: a warp per 32
sorted positions, rows crossing those windows, long rows summed from pieces) against the float64 CPU
reference, bitwise run to run, the same d_table with or without d_weights (and d_weights alone), and
the sparse rows equal to the dense ones. dim 64 / 256 / 512 reach its one- and two-vector kernels
(fp32 at 512 takes the row pass: the same checks hold)."""

import numpy as np
import pytest

from gpu_common import DTYPES, torch  # noqa: F401  (skips without CUDA)
from test_gpu_embedding_bag import assert_close, to_dev


def window_crossing_case(dtype, dim, seed):
    """Row r has (7 r) % 45 entries (0: untouched; up to 44: crosses a 32-position window), shuffled into
    bags of 16, with 3% padding."""
    rng = np.random.default_rng(seed)
    num_rows, bag = 400, 16
    rows = np.repeat(np.arange(num_rows), (7 * np.arange(num_rows)) % 45)
    rows = rows[: len(rows) // bag * bag]
    rng.shuffle(rows)
    idx = rows.reshape(-1, bag)
    idx[rng.random(idx.shape) < 0.03] = -1
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32)).to(dtype)
    # Positive weights: a mean over weights summing to ~0 would overflow float16.
    weights = torch.from_numpy(rng.uniform(0.25, 1.5, size=idx.shape).astype(np.float32)).to(dtype)
    grad = torch.from_numpy(rng.standard_normal((idx.shape[0], dim)).astype(np.float32)).to(dtype)
    return table, torch.from_numpy(idx), weights, grad


def check_backward_against_reference(lib, dtype, dim, seed, check_d_weights_alone=True):
    """window_crossing_case(dtype, dim, seed), sum and mean, long_segment_entries 1, 31, 32, 33 and the
    default: d_table / d_weights against the float64 CPU reference, bitwise run to run, d_table without
    d_weights (and, with check_d_weights_alone, d_weights without d_table) equal, sparse rows equal to
    the dense ones."""
    table, indices, weights, grad = window_crossing_case(dtype, dim, seed=seed)
    g_table, g_idx, g_w, g_grad = to_dev(table, indices, weights, grad)
    valid = indices.numpy().ravel()
    touched = torch.from_numpy(np.unique(valid[valid >= 0])).cuda()
    for combiner in ("sum", "mean"):
        want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, combiner, reference=True)
        for long_segment in (1, 31, 32, 33, 0):  # 0: the default (2048), no row is long
            opts = {"long_segment_entries": long_segment}
            what = f"{combiner} long_segment={long_segment}"
            d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, options=opts)
            assert_close(d_table, want_dt, dtype, "d_table " + what)
            assert_close(d_w, want_dw, dtype, "d_weights " + what, floor=float(np.sqrt(dim)))
            again = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, options=opts)
            assert torch.equal(again[0], d_table) and torch.equal(again[1], d_w), "not bitwise reproducible " + what
            only_dt, _ = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, want_d_weights=False, options=opts)
            assert torch.equal(only_dt, d_table), what
            if check_d_weights_alone:
                _, only_dw = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, want_d_table=False,
                                               options=opts)
                assert torch.equal(only_dw, d_w), what
            rows, row_grads, sparse_dw = lib.cuda_sparse_backward(g_table, g_idx, g_grad, g_w, combiner, options=opts)
            assert torch.equal(rows, touched) and torch.equal(row_grads, d_table[rows]), what
            assert torch.equal(sparse_dw, d_w), what


@pytest.mark.parametrize("dim", [64, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_across_windows_and_long_rows_match_reference(lib, dtype, dim):
    check_backward_against_reference(lib, dtype, dim, seed=dim)


def test_segment_starts_over_long_gaps_do_not_depend_on_the_workspace(lib):
    """Few entries over many rows: gaps of thousands of rows between touched rows, which the segment
    scatter leaves to the check pass (backward_sort.cu), beside runs of adjacent rows, the first and last
    rows, a hot row and padding. d_table / d_weights match the float64 reference and are bitwise the
    same whatever the workspace held before (zeros: in-range stale starts; 0xFF / 0x07: out of range)."""
    rng = np.random.default_rng(11)
    num_rows, dim = 50000, 64
    rows = np.concatenate([[0, num_rows - 1, 7, 7, 7, 7, 7], np.arange(300, 340), rng.integers(0, num_rows, 17)])
    rng.shuffle(rows)
    idx = rows.reshape(8, 8).copy()
    idx[0, 3] = idx[5, 6] = -1
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32))
    weights = torch.from_numpy(rng.uniform(0.25, 1.5, size=idx.shape).astype(np.float32))
    grad = torch.from_numpy(rng.standard_normal((idx.shape[0], dim)).astype(np.float32))
    indices = torch.from_numpy(idx)
    g_table, g_idx, g_w, g_grad = to_dev(table, indices, weights, grad)
    want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, "sum", reference=True)
    nbytes = lib.cuda_backward_workspace_bytes(g_table, g_idx, g_w, "sum")
    results = []
    for fill in (0x00, 0xFF, 0x07):
        ws = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
        d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, "sum", workspace=ws)
        assert_close(d_table, want_dt, torch.float32, f"d_table, workspace filled with {fill:#x}")
        assert_close(d_w, want_dw, torch.float32, f"d_weights, workspace filled with {fill:#x}", floor=8.0)
        results.append((d_table, d_w))
    for d_table, d_w in results[1:]:
        assert torch.equal(d_table, results[0][0]) and torch.equal(d_w, results[0][1])
