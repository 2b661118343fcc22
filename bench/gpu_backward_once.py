"""One dense (or row-sparse) GPU backward call after one warm-up, for a profiler to attach to (issue #25):

    ncu -k regex:PositionsKernel --launch-skip 1 --launch-count 1 \
        python bench/gpu_backward_once.py 65536,32,256,4194304 bf16 [sparse]

Uniform int64 indices, per-sample weights with d_weights wanted, sum (bench/gpu_kernels_ab.py's inputs);
PKM_CUDA_LIB picks the library (kernels/capi/pkm_capi.py)."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import pkm_capi  # noqa: E402
from gpu_kernels_ab import DTYPES, inputs  # noqa: E402


def main():
    B, K, D, N = (int(x) for x in sys.argv[1].split(","))
    dtype_name = sys.argv[2]
    sparse = len(sys.argv) > 3 and sys.argv[3] == "sparse"
    lib = pkm_capi.PkmLib()
    table, indices, weights, grad = inputs(B, K, D, N, DTYPES[dtype_name])
    ws = torch.empty(max(1, lib.cuda_backward_workspace_bytes(table, indices, weights, "sum")), dtype=torch.uint8,
                     device="cuda")
    out = (torch.empty_like(table), torch.empty_like(weights))
    for _ in range(2):
        if sparse:
            lib.cuda_sparse_backward(table, indices, grad, weights, "sum")
        else:
            lib.cuda_backward(table, indices, grad, weights, "sum", workspace=ws, out=out)
    torch.cuda.synchronize()
    print("done", B, K, D, N, dtype_name, "sparse" if sparse else "dense")


if __name__ == "__main__":
    main()
