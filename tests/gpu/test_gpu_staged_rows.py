"""The wide-row backward pass with cp.async-staged gradient rows (kernels/cuda/backward_staged.cuh:
vector rows wider than two 16-byte vectors per lane, every combiner but max) for the table gradient
and for the fused optimizer update. Rows of 0-44 entries (walks crossing the 32-step metadata windows
and the 4-row groups), long rows summed from pieces at long_segment_entries 1, 31, 32, 33 and the
default, partial column tiles (dim 1104, 2080): against the float64 CPU reference, bitwise run to run,
d_table with and without d_weights equal, sparse rows equal to the dense ones; the fused Adam update
against the unfused path (this d_table, then Adam in float64) within 1e-6 and bitwise run to run."""

import numpy as np
import pytest

from gpu_common import torch  # noqa: F401  (skips without CUDA)
from test_gpu_embedding_bag import to_dev
from test_gpu_position_pass import check_backward_against_reference, window_crossing_case
from tests.row_optimizer_reference import apply_rows

ADAM = dict(learning_rate=0.01, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=3)
DIMS = [(torch.float32, 1024), (torch.float32, 1104), (torch.float32, 2080), (torch.bfloat16, 1024),
        (torch.float16, 2080)]


@pytest.mark.parametrize("dtype,dim", DIMS, ids=lambda x: str(x).split(".")[-1])
def test_staged_rows_gradient_matches_reference_and_is_deterministic(lib, dtype, dim):
    check_backward_against_reference(lib, dtype, dim, seed=dim + 1, check_d_weights_alone=False)


@pytest.mark.parametrize("dim", [1024, 2080])
def test_staged_fused_adam_matches_unfused_and_is_deterministic(lib, dim):
    table, indices, weights, grad = window_crossing_case(torch.float32, dim, seed=3 * dim)
    rng = np.random.default_rng(dim)
    state = (rng.standard_normal(table.shape).astype(np.float32) * 0.01,
             rng.uniform(0.0, 0.01, table.shape).astype(np.float32))
    g_table, g_idx, g_w, g_grad = to_dev(table, indices, weights, grad)
    for long_segment in (1, 33, 0):
        opts = {"long_segment_entries": long_segment}
        d_table, want_dw = lib.cuda_backward(g_table, g_idx, g_grad, g_w, "sum", options=opts)
        valid = indices.numpy().ravel()
        rows = np.unique(valid[valid >= 0])
        hyper = {k: v for k, v in ADAM.items() if k != "learning_rate"}
        want_t, want_s = apply_rows("adam", table.numpy(), d_table.cpu().numpy()[rows], rows, state,
                                    lr=ADAM["learning_rate"], **hyper)
        results = []
        for _ in range(2):
            t = g_table.clone()
            s = tuple(torch.from_numpy(x.copy()).cuda() for x in state)
            d_w = lib.cuda_fused_update(t, g_idx, g_grad, "adam", s, g_w, "sum", options=opts, **ADAM)
            results.append((t, s[0], s[1], d_w))
        t, m, v, d_w = results[0]
        np.testing.assert_allclose(t.cpu().numpy(), want_t, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m.cpu().numpy(), want_s[0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(v.cpu().numpy(), want_s[1], rtol=1e-6, atol=1e-9)
        assert torch.equal(d_w, want_dw), f"fused d_weights differ from the backward's, long_segment={long_segment}"
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[1])), "fused update not bitwise reproducible"
        untouched = np.setdiff1d(np.arange(table.shape[0]), rows)
        assert untouched.size > 0 and torch.equal(t[untouched].cpu(), table[untouched])
