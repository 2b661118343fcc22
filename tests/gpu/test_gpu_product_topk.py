"""The product-key selection kernel (kernels/cuda/product_keys.cu: pkm_cuda_product_topk and its
backward) against the PyTorch composite a PKM layer uses (top-k of each half's scores, the knn x knn
sums, top-k of those, gather): the same best scores bitwise, the same keys, d_scores equal to torch
autograd's within float32 rounding, bitwise run to run, and clear errors for bad shapes."""

import pytest

from gpu_common import pkm_capi, torch  # noqa: F401  (skips without CUDA)


def composite(scores, knn):
    """(best, index) of the torch composite on scores [rows, 2, n_keys]."""
    n_keys = scores.shape[-1]
    v1, i1 = scores[:, 0].topk(knn, dim=-1)
    v2, i2 = scores[:, 1].topk(knn, dim=-1)
    all_s = (v1[:, :, None] + v2[:, None, :]).flatten(-2)
    all_i = (i1[:, :, None] * n_keys + i2[:, None, :]).flatten(-2)
    best, p = all_s.topk(knn, dim=-1)
    return best, all_i.gather(-1, p)


@pytest.mark.parametrize("n_keys,knn", [(512, 32), (100, 7), (1024, 32), (33, 32), (256, 1), (40, 17)])
def test_product_topk_matches_torch_composite(lib, n_keys, knn):
    gen = torch.Generator(device="cuda").manual_seed(n_keys * 100 + knn)
    rows = 300
    scores = torch.randn(rows, 2, n_keys, device="cuda", generator=gen)
    best, index, pos = lib.cuda_product_topk(scores, knn)
    want_best, want_index = composite(scores, knn)
    assert torch.equal(best, want_best)
    assert torch.equal(index.sort(-1).values, want_index.sort(-1).values)
    assert torch.equal(pos[..., 0].long() * n_keys + pos[..., 1].long(), index)
    picked = scores[:, 0].gather(-1, pos[..., 0].long()) + scores[:, 1].gather(-1, pos[..., 1].long())
    assert torch.equal(picked, best)
    again = lib.cuda_product_topk(scores, knn)
    assert all(torch.equal(a, b) for a, b in zip(again, (best, index, pos)))


@pytest.mark.parametrize("n_keys,knn", [(512, 32), (100, 7), (33, 32)])
def test_product_topk_backward_matches_autograd(lib, n_keys, knn):
    gen = torch.Generator(device="cuda").manual_seed(7 * n_keys + knn)
    rows = 257
    scores = torch.randn(rows, 2, n_keys, device="cuda", generator=gen).requires_grad_(True)
    d_best = torch.randn(rows, knn, device="cuda", generator=gen)
    want_best, _ = composite(scores, knn)
    want_best.backward(d_best)
    _, _, pos = lib.cuda_product_topk(scores.detach(), knn)
    d_scores = lib.cuda_product_topk_backward(d_best, pos, n_keys)
    # A picked position's gradient sums up to knn terms of size ~1, here in rank order, in torch's
    # reduction in its own order: equal within a few float32 ulps of the terms.
    torch.testing.assert_close(d_scores, scores.grad, rtol=1e-5, atol=1e-5)
    assert int((d_scores != 0).sum()) <= 2 * rows * knn
    assert torch.equal(lib.cuda_product_topk_backward(d_best, pos, n_keys), d_scores)


def test_product_topk_bad_shapes(lib):
    scores = torch.randn(4, 2, 64, device="cuda")
    with pytest.raises(pkm_capi.PkmError, match="knn must be in"):
        lib.cuda_product_topk(scores, 33)
    with pytest.raises(pkm_capi.PkmError, match="knn must be in"):
        lib.cuda_product_topk(torch.randn(4, 2, 8, device="cuda"), 9)
    with pytest.raises(pkm_capi.PkmError, match="n_keys must be in"):
        lib.cuda_product_topk(torch.randn(2, 2, 1025, device="cuda"), 4)
    with pytest.raises(pkm_capi.PkmError, match="float32"):
        lib.cuda_product_topk(scores.double(), 4)
    empty = lib.cuda_product_topk(torch.empty(0, 2, 64, device="cuda"), 4)
    assert empty[0].shape == (0, 4)
