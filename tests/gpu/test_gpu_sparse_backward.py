"""The CUDA row-sparse backward (pkm_cuda_sparse_backward) against the dense
CUDA backward (same passes: bitwise equal rows) and the core's CPU sparse
backward, through the C ABI. Needs a CUDA GPU, torch with CUDA and
`make gpu-standalone`; skips elsewhere (CI), like test_gpu_embedding_bag.py."""

import zlib

import numpy as np
import pytest

from gpu_common import CONFIG_IDS, CONFIGS, pkm_capi, torch  # noqa: F401  (skips without CUDA)
from test_gpu_embedding_bag import assert_close, random_cases, to_dev  # noqa: E402


def valid_rows(indices, num_rows):
    idx = indices.cpu().numpy().astype(np.int64).ravel()
    return np.unique(idx[(idx >= 0) & (idx < num_rows)])


@pytest.mark.parametrize("dtype,combiner,ragged", CONFIGS, ids=CONFIG_IDS)
def test_sparse_rows_equal_dense_backward_rows(lib, dtype, combiner, ragged):
    rng = np.random.default_rng(zlib.crc32(f"sparse-{dtype}-{combiner}-{ragged}".encode()))
    for what, with_weights, (table, indices, weights, splits) in random_cases(rng, dtype, combiner, ragged, 3000):
        num_rows, dim = table.shape
        g = to_dev(table, indices, weights, splits)
        grad = torch.from_numpy(rng.standard_normal((g[1].shape[0] if not ragged else len(splits) - 1, dim))
                                .astype(np.float32)).to(dtype).to("cuda")
        rows, row_grads, d_w = lib.cuda_sparse_backward(g[0], g[1], grad, g[2], combiner, g[3])
        expect = valid_rows(indices, num_rows)
        np.testing.assert_array_equal(rows.cpu().numpy(), expect, err_msg=what)
        assert row_grads.shape == (len(expect), dim) and row_grads.dtype == dtype
        d_table, d_w_dense = lib.cuda_backward(g[0], g[1], grad, g[2], combiner, g[3])
        # The same passes write the same rows: bitwise equal, untouched rows zero.
        assert torch.equal(row_grads, d_table[rows]), what
        untouched = np.setdiff1d(np.arange(num_rows), expect)
        assert torch.count_nonzero(d_table[torch.from_numpy(untouched).cuda()]) == 0
        if with_weights:
            assert torch.equal(d_w, d_w_dense), what
        c_rows, c_grads, c_dw = lib.cpu_sparse_backward(table, indices, grad.cpu(), weights, combiner, splits)
        np.testing.assert_array_equal(c_rows.numpy(), expect)
        assert_close(row_grads, c_grads, dtype, "row_grads vs CPU core " + what)


def test_hot_rows_pieces_and_invalid_indices(lib):
    rng = np.random.default_rng(3)
    num_rows, dim = 1000, 128
    idx = rng.integers(0, num_rows, size=(400, 32))
    idx[rng.random(idx.shape) < 0.5] = 11  # one very hot row
    idx[0, 0] = num_rows + 5                # out of range: treated as padding on the GPU
    table = torch.randn(num_rows, dim, device="cuda")
    weights = torch.rand(idx.shape, device="cuda")
    indices = torch.from_numpy(idx).cuda()
    grad = torch.randn(400, dim, device="cuda")
    for long_segment in (16, 0):
        opts = {"long_segment_entries": long_segment}
        rows, row_grads, d_w = lib.cuda_sparse_backward(table, indices, grad, weights, "mean", options=opts)
        d_table, d_w_dense = lib.cuda_backward(table, indices, grad, weights, "mean", options=opts)
        np.testing.assert_array_equal(rows.cpu().numpy(), valid_rows(indices, num_rows))
        assert torch.equal(row_grads, d_table[rows]) and torch.equal(d_w, d_w_dense)
        assert float(d_w[0, 0]) == 0.0


def test_nothing_touched_and_alloc_failure(lib):
    table = torch.randn(10, 8, device="cuda")
    indices = torch.full((4, 3), -1, device="cuda")
    rows, row_grads, _ = lib.cuda_sparse_backward(table, indices, torch.randn(4, 8, device="cuda"))
    assert rows.numel() == 0 and row_grads.shape == (0, 8)
    # A failing allocation callback is reported, not ignored.
    bags = pkm_capi.make_bags(table, torch.zeros((2, 2), dtype=torch.int64, device="cuda"))
    fail = pkm_capi.SPARSE_ALLOC_FN(lambda *_: 1)
    ws = torch.empty(lib.lib.pkm_cuda_sparse_backward_workspace_bytes(bags, None) + 1, dtype=torch.uint8,
                     device="cuda")
    grad = torch.randn(2, 8, device="cuda")
    rc = lib.lib.pkm_cuda_sparse_backward(bags, grad.data_ptr(), fail, None, None, ws.data_ptr(), ws.numel(),
                                          None, torch.cuda.current_stream().cuda_stream)
    assert rc == pkm_capi.INVALID_ARGUMENT
    assert "allocation callback failed" in lib.lib.pkm_cuda_last_error().decode()
