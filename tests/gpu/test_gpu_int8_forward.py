"""CUDA forward over row-wise int8 tables (kernels/cuda/forward_int8.cu) through the C ABI,
against the float64 reference of the dequantised table and the core's CPU int8 forward.

Needs a CUDA GPU, PyTorch with CUDA and `make gpu-standalone`; skips without a GPU, like
the other tests/gpu modules (run with CUDA_VISIBLE_DEVICES=0 python -m pytest -q tests/gpu).
"""

import numpy as np
import pytest

from gpu_common import pkm_capi, torch  # noqa: F401  (skips without CUDA)
import reference  # noqa: E402  (tests/, on the path through gpu_common)


def quantized(rng, n, d, param_dtype):
    q = torch.from_numpy(rng.integers(-128, 128, size=(n, d), dtype=np.int8))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=n).astype(np.float32)).to(param_dtype)
    biases = torch.from_numpy(rng.uniform(-1, 1, size=n).astype(np.float32)).to(param_dtype)
    return q, scales, biases


def check(got, want, what):
    got = got.cpu().numpy().astype(np.float64)
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-30)
    err = np.abs(got - want)
    assert not (err > 1e-5 * np.abs(want) + 1e-5 * scale).any(), f"{what}: max abs err {err.max():.3g}"


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [512, 4, 37, 1000])
def test_dense_matches_reference(lib, param_dtype, combiner, dim):
    rng = np.random.default_rng(dim)
    n, b, k = 3000, 65, 23
    q, scales, biases = quantized(rng, n, dim, param_dtype)
    idx = rng.integers(-1, n, size=(b, k)).astype(np.int64)
    w = rng.uniform(0.1, 1.0, size=(b, k)).astype(np.float32)
    table64 = reference.dequantize_rows(q.numpy(), scales.float().numpy(), biases.float().numpy())
    want = reference.embedding_bag(table64, idx, w, combiner)
    got = lib.cuda_forward_int8(q.cuda(), scales.cuda(), torch.from_numpy(idx).cuda(), torch.from_numpy(w).cuda(),
                                combiner, row_biases=biases.cuda())
    check(got, want, f"int8 {combiner} dim {dim} {param_dtype}")
    cpu = lib.cpu_forward(q, torch.from_numpy(idx), torch.from_numpy(w), combiner, reference=False,
                          row_scales=scales, row_biases=biases)
    check(got, cpu.numpy().astype(np.float64), "GPU vs the core's CPU int8 forward")


def test_ragged_int32_no_biases_and_out_of_range(lib):
    rng = np.random.default_rng(7)
    n, d = 500, 128
    q, scales, _ = quantized(rng, n, d, torch.float32)
    splits = np.array([0, 3, 3, 40, 41], np.int64)
    values = rng.integers(0, n, size=41).astype(np.int32)
    values[5] = n + 3  # out of range: padding on the device, counted
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    got = lib.cuda_forward_int8(q.cuda(), scales.cuda(), torch.from_numpy(values).cuda(), None, "mean",
                                row_splits=torch.from_numpy(splits).cuda(), invalid_counter=counter)
    kept = values.astype(np.int64)
    kept[5] = -1
    want = reference.ragged_embedding_bag(reference.dequantize_rows(q.numpy(), scales.numpy()), kept, splits,
                                          None, "mean")
    check(got, want, "ragged int8 mean")
    assert int(counter.item()) == 1


def test_bad_arguments_are_errors(lib):
    q = torch.zeros((4, 8), dtype=torch.int8, device="cuda")
    idx = torch.zeros((2, 2), dtype=torch.int64, device="cuda")
    with pytest.raises(pkm_capi.PkmError, match="row_scales"):
        lib.cuda_forward_int8(q, None, idx)
    with pytest.raises(pkm_capi.PkmError, match="float32 or float16"):
        lib.cuda_forward_int8(q, torch.ones(4, dtype=torch.bfloat16, device="cuda"), idx)


def test_launcher_refuses_bad_row_params(lib):
    # The C launcher's own checks, past the Python wrapper's.
    import ctypes

    q = torch.zeros((4, 8), dtype=torch.int8, device="cuda")
    scales = torch.ones(4, dtype=torch.float32, device="cuda")
    idx = torch.zeros((2, 2), dtype=torch.int64, device="cuda")
    out = torch.empty((2, 8), dtype=torch.float32, device="cuda")
    bags = pkm_capi.make_bags(q, idx, row_scales=scales)
    bags.row_params_type = 2
    stream = torch.cuda.current_stream().cuda_stream
    assert lib.lib.pkm_cuda_forward_int8(ctypes.byref(bags), ctypes.c_void_p(out.data_ptr()), stream) == -1
    assert "row_params_type" in lib.lib.pkm_cuda_last_error().decode()
    bags.row_params_type = 0
    bags.row_scales = None
    assert lib.lib.pkm_cuda_forward_int8(ctypes.byref(bags), ctypes.c_void_p(out.data_ptr()), stream) == -1
    assert "row_scales is null" in lib.lib.pkm_cuda_last_error().decode()
