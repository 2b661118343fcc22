"""The narrow-row backward walked by sorted position (kernels/cuda/backward_positions.cu: a warp per 32
sorted positions, rows crossing those windows, long rows summed from pieces) against the float64 CPU
reference, bitwise run to run, the same d_table with or without d_weights (and d_weights alone), and
the sparse rows equal to the dense ones. dim 64 / 256 / 512 reach its one- and two-vector kernels
(fp32 at 512 takes the row pass: the same checks hold)."""

import numpy as np
import pytest

from gpu_common import DTYPES, torch  # noqa: F401  (skips without CUDA)
from test_gpu_embedding_bag import assert_close, to_dev


def window_crossing_case(dtype, dim, seed, spare_rows=0):
    """Row r < 400 has (7 r) % 45 entries (0: untouched; up to 44: crosses a 32-position window), shuffled
    into bags of 16, with 3% padding; the table has `spare_rows` untouched rows more."""
    rng = np.random.default_rng(seed)
    num_rows, bag = 400, 16
    rows = np.repeat(np.arange(num_rows), (7 * np.arange(num_rows)) % 45)
    rows = rows[: len(rows) // bag * bag]
    rng.shuffle(rows)
    idx = rows.reshape(-1, bag)
    idx[rng.random(idx.shape) < 0.03] = -1
    table = torch.from_numpy(rng.standard_normal((num_rows + spare_rows, dim)).astype(np.float32)).to(dtype)
    # Positive weights: a mean over weights summing to ~0 would overflow float16.
    weights = torch.from_numpy(rng.uniform(0.25, 1.5, size=idx.shape).astype(np.float32)).to(dtype)
    grad = torch.from_numpy(rng.standard_normal((idx.shape[0], dim)).astype(np.float32)).to(dtype)
    return table, torch.from_numpy(idx), weights, grad


def check_backward_against_reference(lib, dtype, dim, seed, check_d_weights_alone=True, spare_rows=0):
    """window_crossing_case(dtype, dim, seed, spare_rows), sum and mean, long_segment_entries 1, 31, 32, 33 and the
    default: d_table / d_weights against the float64 CPU reference, bitwise run to run, d_table without
    d_weights (and, with check_d_weights_alone, d_weights without d_table) equal, sparse rows equal to
    the dense ones."""
    table, indices, weights, grad = window_crossing_case(dtype, dim, seed=seed, spare_rows=spare_rows)
    g_table, g_idx, g_w, g_grad = to_dev(table, indices, weights, grad)
    valid = indices.numpy().ravel()
    touched = torch.from_numpy(np.unique(valid[valid >= 0])).cuda()
    for combiner in ("sum", "mean"):
        want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, combiner, reference=True)
        for long_segment in (1, 31, 32, 33, 0):  # 0: the default (at least 512), no row is long
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


@pytest.mark.parametrize("dim", [64, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_across_windows_in_a_table_with_more_rows_than_entries(lib, dtype, dim):
    """The same with 10000 untouched rows more than the ~8800 entries: 16-bit tables then take the
    shared-memory ring walk instead of the register walk (backward_positions.cu), fp32 takes it in both."""
    check_backward_against_reference(lib, dtype, dim, seed=dim + 7, spare_rows=10000)


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


def gap_case(lead, gaps, tail, seed, dim=64, bag=8):
    """Touched rows separated by `gaps` untouched ones, after `lead` untouched rows and before `tail`;
    each touched row has 1-3 entries, shuffled into bags of `bag`, the last bag padded with -1."""
    rng = np.random.default_rng(seed)
    touched = lead + np.concatenate([[0], np.cumsum(np.asarray(gaps) + 1)])
    num_rows = int(touched[-1]) + 1 + tail
    rows = np.repeat(touched, rng.integers(1, 4, len(touched)))
    rng.shuffle(rows)
    idx = np.full(-(-len(rows) // bag) * bag, -1, dtype=np.int64)
    idx[: len(rows)] = rows
    idx = idx.reshape(-1, bag)
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32))
    weights = torch.from_numpy(rng.uniform(0.25, 1.5, size=idx.shape).astype(np.float32))
    grad = torch.from_numpy(rng.standard_normal((idx.shape[0], dim)).astype(np.float32))
    return table, torch.from_numpy(idx), weights, grad


# Three times over: ~90 entries, so gaps also fall between the 32-position chunks of different warps.
GAPS = [0, 1, 2, 31, 32, 33, 63, 64, 65, 66, 100, 200, 0, 5, 1000] * 3


@pytest.mark.parametrize("lead,tail", [(0, 0), (3, 64), (64, 65), (65, 3), (500, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_untouched_rows_between_touched_ones_are_zeroed(lib, dtype, lead, tail):
    """A dense d_table written into a NaN-filled buffer: the untouched rows in gaps of 0-1000 rows between
    touched rows (inside one warp's 32 positions and across them), before the first and after the last,
    come out zero, the touched ones match the float64 reference, and the result is the same as into a
    zero-filled buffer."""
    table, indices, weights, grad = gap_case(lead, GAPS, tail, seed=lead * 1000 + tail)
    table, weights, grad = table.to(dtype), weights.to(dtype), grad.to(dtype)
    g_table, g_idx, g_w, g_grad = to_dev(table, indices, weights, grad)
    want_dt, want_dw = lib.cpu_backward(table, indices, grad, weights, "sum", reference=True)
    results = []
    for fill in (float("nan"), 0.0):
        out = (torch.full_like(g_table, fill), torch.full_like(g_w, fill))
        d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, "sum", out=out)
        assert_close(d_table, want_dt, dtype, f"d_table into {fill}")
        assert_close(d_w, want_dw, dtype, f"d_weights into {fill}", floor=8.0)
        results.append((d_table, d_w))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("num_rows", [1, 40, 64, 65, 300])
def test_no_valid_index_zeroes_every_row(lib, num_rows):
    """Only padding and out-of-range indices: every d_table row and d_weight is zero, written into a
    NaN-filled buffer (the walk has no row to sum; the zero groups cover 1 to 300 rows)."""
    idx = torch.tensor([[-1, num_rows, -1, num_rows + 5]] * 3, dtype=torch.int64)
    table = torch.randn(num_rows, 64)
    weights, grad = torch.rand(3, 4), torch.randn(3, 64)
    g_table, g_idx, g_w, g_grad = to_dev(table, idx, weights, grad)
    out = (torch.full_like(g_table, float("nan")), torch.full_like(g_w, float("nan")))
    d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, "sum", out=out)
    assert torch.equal(d_table, torch.zeros_like(g_table)) and torch.equal(d_w, torch.zeros_like(g_w))


def single_entry_case(dtype, dim, seed, index_dtype):
    """Fewer entries than table rows: 600 rows of one entry, 60 of two to five, one hot row of 70 (long under
    long_segment 31), padded with -1 to 40 bags of 48 (two 32-entry chunks per bag; ~54% padding), shuffled,
    then 2% of all entries set out of range (some of the hot row's too); ragged splits of the same entries
    with empty bags and bags of 1 to 130."""
    rng = np.random.default_rng(seed)
    num_rows = 5000
    picked = rng.permutation(num_rows)
    rows = np.concatenate([picked[:600], np.repeat(picked[600:660], rng.integers(2, 6, 60)), [picked[700]] * 70])
    rows = np.concatenate([rows, np.full(40 * 48 - len(rows), -1)])
    rng.shuffle(rows)
    rows[rng.random(rows.shape) < 0.02] = num_rows + 3  # out of range: padding on the GPU, skipped
    idx = rows.reshape(40, 48).astype(index_dtype)
    table = torch.from_numpy(rng.standard_normal((num_rows, dim)).astype(np.float32)).to(dtype)
    weights = torch.from_numpy(rng.uniform(0.25, 1.5, size=idx.shape).astype(np.float32)).to(dtype)
    grad = torch.from_numpy(rng.standard_normal((idx.shape[0], dim)).astype(np.float32)).to(dtype)
    sizes = np.concatenate([[0, 1, 130, 0, 33, 31, 32, 64], np.full(40, 0)])
    sizes[8:] = rng.integers(0, 60, 40)
    sizes[-1] = idx.size - sizes[:-1].sum()
    assert sizes[-1] >= 0
    splits = np.concatenate([[0], np.cumsum(sizes)]).astype(index_dtype)
    return table, torch.from_numpy(idx), weights, grad, torch.from_numpy(splits)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dim", [64, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_of_one_entry_written_by_bag(lib, dtype, dim, index_dtype):
    """A table with more rows than entries, where rows with one entry go to SingleEntryRowsKernel (a warp
    per bag) and the walk skips them: dense and ragged bags, sum / mean / sqrtn, long rows or not. d_table
    and d_weights, written into NaN-filled buffers (a row nobody writes stays NaN), match the float64
    reference; with sum a single row's gradient is bitwise fp32 weight * gradient rounded once (the walk's
    fmaf(w, g, 0)); run to run bitwise; sparse rows equal the dense ones; d_table alone and d_weights alone
    equal the joint call's. Which kernel wrote a row is not visible here (both give the same bits):
    bench/gpu_backward_ab.py shows the pass's time and bitwise equality with a build without it."""
    table, idx, weights, grad, splits = single_entry_case(dtype, dim, seed=dim + 31, index_dtype=index_dtype)
    num_rows = table.shape[0]
    for ragged in (False, True):
        indices = idx.reshape(-1) if ragged else idx
        row_splits = splits if ragged else None
        if ragged:  # one gradient row per ragged bag
            g_rows = torch.from_numpy(np.random.default_rng(dim).standard_normal(
                (len(splits) - 1, dim)).astype(np.float32)).to(dtype)
        else:
            g_rows = grad
        w = weights.reshape(-1) if ragged else weights
        g_table, g_idx, g_w, g_grad = to_dev(table, indices, w, g_rows)
        g_splits = row_splits.cuda() if ragged else None
        flat = indices.numpy().ravel()
        counts = np.bincount(flat[(flat >= 0) & (flat < num_rows)], minlength=num_rows)
        touched = torch.from_numpy(np.flatnonzero(counts)).cuda()
        cpu_idx = indices.clone()
        cpu_idx[cpu_idx >= num_rows] = -1  # the GPU treats them as padding; the CPU reference refuses them
        for combiner in ("sum", "mean", "sqrtn"):
            want_dt, want_dw = lib.cpu_backward(table, cpu_idx, g_rows, w, combiner, row_splits=row_splits,
                                                reference=True)
            for long_segment in (31, 0):
                opts = {"long_segment_entries": long_segment}
                what = f"{combiner} ragged={ragged} long_segment={long_segment}"
                out = (torch.full_like(g_table, float("nan")), torch.full_like(g_w, float("nan")))
                d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits,
                                                 options=opts, out=out)
                assert_close(d_table, want_dt, dtype, "d_table " + what)
                assert_close(d_w, want_dw, dtype, "d_weights " + what, floor=float(np.sqrt(dim)))
                if combiner == "sum":
                    single = np.flatnonzero((counts[np.clip(flat, 0, num_rows - 1)] == 1) & (flat >= 0) &
                                            (flat < num_rows))
                    bags = (np.searchsorted(splits.numpy(), single, side="right") - 1 if ragged
                            else single // idx.shape[1])
                    rows_ = torch.from_numpy(flat[single]).cuda()
                    want_single = (g_w.reshape(-1)[torch.from_numpy(single).cuda()].float()[:, None] *
                                   g_grad[torch.from_numpy(bags).cuda()].float()).to(dtype)
                    assert torch.equal(d_table[rows_], want_single), what
                again = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits, options=opts)
                assert torch.equal(again[0], d_table) and torch.equal(again[1], d_w), "not bitwise " + what
                only_dt, _ = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits,
                                               want_d_weights=False, options=opts)
                _, only_dw = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits,
                                               want_d_table=False, options=opts)
                assert torch.equal(only_dt, d_table) and torch.equal(only_dw, d_w), what
                rows, row_grads, sparse_dw = lib.cuda_sparse_backward(g_table, g_idx, g_grad, g_w, combiner,
                                                                      row_splits=g_splits, options=opts)
                assert torch.equal(rows, touched) and torch.equal(row_grads, d_table[rows]), what
                assert torch.equal(sparse_dw, d_w), what


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dim", [64, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_written_by_bag_are_bitwise_the_walks(lib, dtype, dim, index_dtype):
    """The pass by bag (SingleEntryRowsKernel) writes the rows of one entry only where the call has fewer
    entries than table rows. The same call with bags of padding alone appended (entries >= rows, so every
    row is walked by sorted position) must give bitwise the same d_table, and the same d_weights for the
    original entries (zeros for the padding): dense and ragged bags, sum / mean / sqrtn, long rows from 3
    entries, from 32 and none, with and without d_weights, and the row-sparse rows. single_entry_case has
    rows of one to five entries and a hot row of 70."""
    table, idx, weights, grad, splits = single_entry_case(dtype, dim, seed=dim + 83, index_dtype=index_dtype)
    num_rows, width = table.shape[0], idx.shape[1]
    extra = -(-(num_rows - idx.numel()) // width) + 1  # padding bags that make entries outnumber rows
    rng = np.random.default_rng(dim)
    more_grad = torch.from_numpy(rng.standard_normal((extra, dim)).astype(np.float32)).to(dtype)
    for ragged in (False, True):
        if ragged:
            indices = idx.reshape(-1)
            walked_indices = torch.cat([indices, torch.full((extra * width,), -1, dtype=indices.dtype)])
            g_rows = torch.from_numpy(rng.standard_normal((len(splits) - 1, dim)).astype(np.float32)).to(dtype)
            row_splits = splits
            walked_splits = torch.cat([splits, splits[-1:] + extra * width])  # one more bag: the padding
            walked_grad = torch.cat([g_rows, more_grad[:1]])
            w = weights.reshape(-1)
            walked_w = torch.cat([w, torch.ones(extra * width, dtype=w.dtype)])
        else:
            indices = idx
            walked_indices = torch.cat([idx, torch.full((extra, width), -1, dtype=idx.dtype)])
            g_rows, row_splits, walked_splits = grad, None, None
            walked_grad = torch.cat([grad, more_grad])
            w = weights
            walked_w = torch.cat([weights, torch.ones((extra, width), dtype=weights.dtype)])
        assert walked_indices.numel() >= num_rows > indices.numel()
        dev = to_dev(table, indices, w, g_rows, walked_indices, walked_w, walked_grad)
        g_table, g_idx, g_w, g_grad, gw_idx, gw_w, gw_grad = dev
        g_splits = row_splits.cuda() if ragged else None
        gw_splits = walked_splits.cuda() if ragged else None
        n = indices.numel()
        for combiner in ("sum", "mean", "sqrtn"):
            for long_segment in (2, 31, 0):
                opts = {"long_segment_entries": long_segment}
                what = f"{combiner} ragged={ragged} long_segment={long_segment}"
                out = (torch.full_like(g_table, float("nan")), torch.full_like(g_w, float("nan")))
                d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits,
                                                 options=opts, out=out)
                walked_dt, walked_dw = lib.cuda_backward(g_table, gw_idx, gw_grad, gw_w, combiner,
                                                         row_splits=gw_splits, options=opts)
                assert torch.equal(d_table, walked_dt), "d_table " + what
                assert torch.equal(d_w.reshape(-1), walked_dw.reshape(-1)[:n]), "d_weights " + what
                assert not walked_dw.reshape(-1)[n:].any(), "padding d_weights " + what
                only_dt, _ = lib.cuda_backward(g_table, g_idx, g_grad, g_w, combiner, row_splits=g_splits,
                                               want_d_weights=False, options=opts)
                assert torch.equal(only_dt, d_table), "d_table alone " + what
                rows, row_grads, sparse_dw = lib.cuda_sparse_backward(g_table, g_idx, g_grad, g_w, combiner,
                                                                      row_splits=g_splits, options=opts)
                assert torch.equal(row_grads, d_table[rows]) and torch.equal(sparse_dw, d_w), "sparse " + what


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rows_of_one_entry_without_weights(lib, dtype, dim):
    """The same case without per-sample weights (coefficient 1, or the bag's mean / sqrtn scale): d_table,
    written into a NaN-filled buffer, matches the float64 reference; with sum each single row's gradient is
    the bag's gradient row itself, bitwise; the sparse rows equal the dense ones."""
    table, idx, _, grad, _ = single_entry_case(dtype, dim, seed=dim + 57, index_dtype=np.int64)
    num_rows = table.shape[0]
    g_table, g_idx, g_grad = to_dev(table, idx, grad)
    flat = idx.numpy().ravel()
    valid = (flat >= 0) & (flat < num_rows)
    counts = np.bincount(flat[valid], minlength=num_rows)
    single = np.flatnonzero(valid & (counts[np.clip(flat, 0, num_rows - 1)] == 1))
    assert len(single) > 400
    cpu_idx = idx.clone()
    cpu_idx[cpu_idx >= num_rows] = -1
    for combiner in ("sum", "mean", "sqrtn"):
        want_dt, _ = lib.cpu_backward(table, cpu_idx, grad, None, combiner, reference=True)
        out = (torch.full_like(g_table, float("nan")), None)
        d_table, d_w = lib.cuda_backward(g_table, g_idx, g_grad, None, combiner, out=out)
        assert d_w is None
        assert_close(d_table, want_dt, dtype, f"d_table {combiner}")
        if combiner == "sum":
            rows = torch.from_numpy(flat[single]).cuda()
            bags = torch.from_numpy(single // idx.shape[1]).cuda()
            assert torch.equal(d_table[rows], g_grad[bags]), combiner
        rows, row_grads, _ = lib.cuda_sparse_backward(g_table, g_idx, g_grad, None, combiner)
        assert torch.equal(row_grads, d_table[rows]), combiner
