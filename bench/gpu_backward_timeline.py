"""Where one GPU backward call's time goes (issue #25): the device operations of one dense and one
row-sparse backward call (after a warm-up), in order, with each one's start relative to the first,
its duration and the idle gap before it (torch profiler, CUPTI), for the huge-table shape and
variants of it that keep B*K (the entries, the sort, d_table, the touched rows) and change only B
(the upstream gradient's size: what the walk re-reads K times).

    python bench/gpu_backward_timeline.py [--cases huge,...] [--dtypes bf16,fp32] [--out DIR] [--tag h200]
"""

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import pkm_capi  # noqa: E402
from gpu_backward_ab import CASES, ZIPF, zipf_indices  # noqa: E402
from gpu_kernels_ab import DTYPES, inputs  # noqa: E402


def timeline(fn):
    """[(name, start_us, duration_us)] of the device operations of one fn() call, in start order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [(ev.name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0][-48:], ev.time_range.start,
            ev.time_range.end)
           for ev in prof.events() if ev.device_type.name == "CUDA"]
    ops.sort(key=lambda op: op[1])
    t0 = ops[0][1] if ops else 0
    return [(name, start - t0, end - start) for name, start, end in ops]


def table(ops):
    lines = ["| op | start us | us | gap before us |", "|---|---|---|---|"]
    prev_end = None
    for name, start, dur in ops:
        gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
        lines.append(f"| {name} | {start:.1f} | {dur:.1f} | {gap:.1f} |")
        prev_end = start + dur if prev_end is None else max(prev_end, start + dur)
    busy = sum(d for _, _, d in ops)
    span = prev_end or 0.0
    lines.append(f"| **span** | | {span:.1f} | (sum of ops {busy:.1f}) |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so"))
    parser.add_argument("--cases", default="huge")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    lib = pkm_capi.PkmLib(args.lib)
    props = torch.cuda.get_device_properties(0)
    lines = [f"# One backward call's device operations on {props.name} "
             f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC)", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}; per-sample weights, d_weights wanted, sum; "
             f"uniform int64 indices (Zipf in huge_zipf). Command: `python {' '.join(sys.argv)}`", ""]
    report = []
    for case_name in args.cases.split(","):
        B, K, D, N = CASES[case_name]
        for dt in args.dtypes.split(","):
            table_t, indices, weights, grad = inputs(B, K, D, N, DTYPES[dt])
            if case_name in ZIPF:
                indices = zipf_indices(B, K, N, ZIPF[case_name])
            ws = torch.empty(max(1, lib.cuda_backward_workspace_bytes(table_t, indices, weights, "sum")),
                             dtype=torch.uint8, device="cuda")
            out = (torch.empty_like(table_t), torch.empty_like(weights))
            variants = {
                "dense": lambda: lib.cuda_backward(table_t, indices, grad, weights, "sum", workspace=ws, out=out),
                "row-sparse": lambda: lib.cuda_sparse_backward(table_t, indices, grad, weights, "sum"),
            }
            for vname, fn in variants.items():
                ops = timeline(fn)
                report.append({"case": case_name, "B": B, "K": K, "D": D, "N": N, "dtype": dt, "variant": vname,
                               "ops": ops})
                lines += [f"## {case_name} (B={B} K={K} D={D} N={N}) {dt}, {vname}", ""] + table(ops) + [""]
                print("\n".join(lines[-len(ops) - 4:]), flush=True)
            del table_t, indices, weights, grad, ws, out, variants
            torch.cuda.empty_cache()
    harness.write_results(f"gpu_backward_timeline_{args.tag}", {"rows": report}, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
