"""The CUDA `max` combiner (torch's mode="max"): forward = elementwise max over
the bag's valid rows (padding not counted, an empty bag gives 0); backward =
the upstream gradient to the row holding each column's maximum, the first bag
position on ties; weights refused. Against a numpy float64 reference and
torch.nn.functional.embedding_bag(mode="max"); dense and ragged bags, every
table dtype, ties, hot rows in pieces, determinism, the fused optimizer.
Needs a CUDA GPU, torch with CUDA and `make gpu-standalone`."""

import zlib

import numpy as np
import pytest

from gpu_common import DTYPES, pkm_capi, torch  # noqa: F401  (skips without CUDA)


def reference(table, bags, grad):
    """bags: lists of indices (negative = padding). float64 (out, d_table)."""
    table = np.asarray(table, np.float64)
    out = np.zeros((len(bags), table.shape[1]))
    d_table = np.zeros_like(table)
    for b, bag in enumerate(bags):
        valid = [i for i in bag if 0 <= i < table.shape[0]]
        if not valid:
            continue
        rows = table[valid]
        first = rows.argmax(axis=0)  # numpy: first occurrence on ties
        out[b] = rows.max(axis=0)
        for c, k in enumerate(first):
            d_table[valid[k], c] += grad[b, c]
    return out, d_table


def dense_case(rng, dtype, num_rows, dim, num_bags, k, ties):
    if ties:  # few distinct values: many ties
        table = rng.integers(-2, 3, size=(num_rows, dim)).astype(np.float32)
    else:
        table = rng.standard_normal((num_rows, dim)).astype(np.float32)
    table = torch.from_numpy(table).to(dtype)
    idx = rng.integers(0, num_rows, size=(num_bags, k))
    idx[rng.random(idx.shape) < 0.2] = -1
    idx[0] = -1  # an all-padding bag
    if k > 2:
        idx[1, :2] = idx[1, 2]  # one row repeated in a bag
    grad = torch.from_numpy(rng.standard_normal((num_bags, dim)).astype(np.float32)).to(dtype)
    return table, torch.from_numpy(idx), grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_max_forward_backward_match_reference(lib, dtype, ties):
    rng = np.random.default_rng(zlib.crc32(f"max-{dtype}-{ties}".encode()))
    for dim in (1, 37, 256, 1288):
        table, idx, grad = dense_case(rng, dtype, 300, dim, 40, 9, ties)
        t, i, g = table.cuda(), idx.cuda(), grad.cuda()
        out = lib.cuda_forward(t, i, None, "max")
        d_table, _ = lib.cuda_backward(t, i, g, None, "max")
        want_out, want_dt = reference(table.float().numpy(), idx.numpy().tolist(), grad.float().numpy())
        np.testing.assert_array_equal(out.float().cpu().numpy(), want_out.astype(np.float32))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        np.testing.assert_allclose(d_table.float().cpu().numpy(), want_dt, rtol=tol, atol=tol, err_msg=f"dim={dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_max_nan_propagates_whatever_the_bag_order(lib, dtype):
    """A NaN in a bag's row makes that column NaN in every order (np.max, TF's
    reduce_max; fmaxf would drop it), and its gradient goes to the first NaN
    (np.argmax); 37 and 1288 columns take different launch shapes."""
    for dim in (37, 1288):
        table = np.tile(np.array([[-1.0], [2.0], [0.0]], np.float32), (1, dim))
        table[0, ::3] = np.nan
        table[1, dim - 1] = np.nan
        bags = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [-1, 2, 0]]
        grad = np.random.default_rng(dim).standard_normal((len(bags), dim)).astype(np.float32)
        t = torch.from_numpy(table).to(dtype).cuda()
        out = lib.cuda_forward(t, torch.tensor(bags).cuda(), None, "max")
        d_table, _ = lib.cuda_backward(t, torch.tensor(bags).cuda(), torch.from_numpy(grad).to(dtype).cuda(), None,
                                       "max")
        want_out, want_dt = reference(table, bags, torch.from_numpy(grad).to(dtype).float().numpy())
        np.testing.assert_array_equal(out.float().cpu().numpy(), want_out.astype(np.float32), err_msg=f"dim={dim}")
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # d_table sums 7 bags' gradients in dtype
        np.testing.assert_allclose(d_table.float().cpu().numpy(), want_dt, rtol=tol, atol=tol, err_msg=f"dim={dim}")


def test_max_matches_torch_embedding_bag(lib):
    import torch.nn.functional as F

    rng = np.random.default_rng(3)
    table = torch.randn(1000, 256, device="cuda", requires_grad=True)
    idx = torch.from_numpy(rng.integers(0, 1000, size=(64, 20))).cuda()
    grad = torch.randn(64, 256, device="cuda")
    want = F.embedding_bag(idx, table, mode="max")
    want.backward(grad)
    out = lib.cuda_forward(table.detach(), idx, None, "max")
    d_table, _ = lib.cuda_backward(table.detach(), idx, grad, None, "max")
    assert torch.equal(out, want.detach())
    torch.testing.assert_close(d_table, table.grad, rtol=1e-5, atol=1e-5)


def test_max_ragged_hot_rows_deterministic_and_fused_sgd(lib):
    rng = np.random.default_rng(8)
    values = torch.from_numpy(np.where(rng.random(5000) < 0.5, 3, rng.integers(0, 200, 5000))).cuda()
    splits = torch.from_numpy(np.sort(np.r_[0, rng.integers(0, 5000, 99), 5000, 5000])).cuda()  # an empty bag
    table = torch.randn(200, 512, device="cuda")
    grad = torch.randn(splits.numel() - 1, 512, device="cuda")
    opts = {"long_segment_entries": 64}  # row 3 has ~2500 entries
    first = lib.cuda_backward(table, values, grad, None, "max", splits, options=opts)[0]
    for _ in range(2):
        assert torch.equal(lib.cuda_backward(table, values, grad, None, "max", splits, options=opts)[0], first)
    s = splits.cpu().numpy()
    bags = [values.cpu().numpy()[s[b]:s[b + 1]].tolist() for b in range(len(s) - 1)]
    want_out, want_dt = reference(table.cpu().numpy(), bags, grad.cpu().numpy())
    out = lib.cuda_forward(table, values, None, "max", splits)
    np.testing.assert_array_equal(out.cpu().numpy(), want_out.astype(np.float32))
    np.testing.assert_allclose(first.cpu().numpy(), want_dt, rtol=1e-5, atol=1e-4)
    # the fused SGD step moves the table by -lr * the same gradient
    updated = table.clone()
    lib.cuda_fused_update(updated, values, grad, "sgd", (), None, "max", splits, options=opts, learning_rate=0.5)
    torch.testing.assert_close(updated, table - 0.5 * first, rtol=1e-6, atol=1e-6)


def test_max_refuses_weights(lib):
    table = torch.randn(10, 8, device="cuda")
    idx = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    with pytest.raises(pkm_capi.PkmError, match="combiner .max. takes no weights"):
        lib.cuda_forward(table, idx, torch.ones(2, 3, device="cuda"), "max")
