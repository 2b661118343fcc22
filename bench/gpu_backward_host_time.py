"""Host time of one dense backward call through the ctypes wrapper (kernels/capi/pkm_capi.py), in parts:
the whole wrapper call, building PkmBags, the two output allocations, and the C call alone
(pkm_cuda_backward: argument checks, workspace layout, kernel launches). Each timed with the GPU idle
(synchronised before), so launches never wait on a full queue: host microseconds, median of `iters`.

    python bench/gpu_backward_host_time.py --libs A.so,B.so --names a,b [--iters 200]
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
import pkm_capi  # noqa: E402


def host_us(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", required=True)
    parser.add_argument("--names", required=True)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    B, K, D, N = 65536, 32, 256, 4194304  # bench/gpu_kernels_ab.py's huge-table case
    gen = torch.Generator(device="cuda").manual_seed(1234)
    table = torch.randn(N, D, device="cuda", generator=gen).to(torch.bfloat16)
    indices = torch.randint(0, N, (B, K), device="cuda", generator=gen)
    weights = torch.rand(B, K, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(B, D, device="cuda", generator=gen).to(torch.bfloat16)
    out = {}
    for name, path in zip(args.names.split(","), args.libs.split(",")):
        lib = pkm_capi.PkmLib(path)
        ws = torch.empty(lib.cuda_backward_workspace_bytes(table, indices, weights, "sum"), dtype=torch.uint8,
                         device="cuda")
        d_table, d_weights = torch.empty_like(table), torch.empty_like(weights)
        bags = pkm_capi.make_bags(table, indices, weights, "sum")
        stream = torch.cuda.current_stream().cuda_stream
        ptrs = [pkm_capi._ptr(t) for t in (grad, d_table, d_weights, ws)]

        def c_call():
            lib.lib.pkm_cuda_backward(ctypes.byref(bags), ptrs[0], ptrs[1], ptrs[2], ptrs[3], ws.numel(), None,
                                      stream)

        out[name] = {
            "wrapper_call_us": host_us(lambda: lib.cuda_backward(table, indices, grad, weights, "sum", workspace=ws),
                                       args.iters),
            "make_bags_us": host_us(lambda: pkm_capi.make_bags(table, indices, weights, "sum"), args.iters),
            "two_empty_like_us": host_us(lambda: (torch.empty_like(table), torch.empty_like(weights)), args.iters),
            "c_call_us": host_us(c_call, args.iters),
            # The rest of the wrapper, part by part.
            "current_stream_us": host_us(lambda: pkm_capi._current_stream(table.device), args.iters),
            "torch_current_stream_us": host_us(lambda: torch.cuda.current_stream(table.device).cuda_stream,
                                               args.iters),
            "four_ptr_us": host_us(lambda: [pkm_capi._ptr(t) for t in (grad, d_table, d_weights, ws)], args.iters),
            "c_call_as_wrapper_us": host_us(lambda: lib.lib.pkm_cuda_backward(
                ctypes.byref(bags), pkm_capi._ptr(grad), pkm_capi._ptr(d_table), pkm_capi._ptr(d_weights),
                pkm_capi._ptr(ws), ws.numel(), None, pkm_capi._current_stream(table.device)), args.iters),
            "wrapper_call_out_given_us": host_us(
                lambda: lib.cuda_backward(table, indices, grad, weights, "sum", workspace=ws, out=(d_table, d_weights)),
                args.iters),
        }
        print(name, json.dumps(out[name]), flush=True)


if __name__ == "__main__":
    main()
