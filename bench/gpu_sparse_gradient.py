"""GPU benchmark: dense vs row-sparse CUDA backward through the C ABI.

    make gpu-standalone && python bench/gpu_sparse_gradient.py [--out bench/results]

Table 2^20 x 256 float32, bags of 32 uniform random rows, B*K = 2^14 .. 2^22.
Times pkm_cuda_backward (dense d_table [N, D]) against pkm_cuda_sparse_backward
(rows + row_grads of the touched rows; includes its one stream synchronisation
and the outputs' allocation) with CUDA events, median of the repeats; also
torch's nn.functional.embedding_bag forward+backward (dense, per_sample_weights) as the
peer. Writes gpu_sparse_gradient_<gpu>.{json,md}.
"""
import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import pkm_capi  # noqa: E402


def timed(fn, repeats):
    """Median ms over CUDA-event-timed calls after one warm-up call (bench/harness.py)."""
    return harness.cuda_event_ms(fn, repeats, warmup=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    lib = pkm_capi.PkmLib()
    n, d, k = args.rows, args.dim, 32
    table = torch.randn(n, d, device="cuda")
    rows_out = []
    for log2 in range(14, 23, 2):
        lookups = 1 << log2
        idx = torch.randint(0, n, (lookups // k, k), device="cuda")
        w = torch.rand(idx.shape, device="cuda")
        grad = torch.randn(lookups // k, d, device="cuda")
        dense_ms = timed(lambda: lib.cuda_backward(table, idx, grad, w, "sum", want_d_weights=False), args.repeats)
        sparse_ms = timed(lambda: lib.cuda_sparse_backward(table, idx, grad, w, "sum", want_d_weights=False),
                          args.repeats)
        touched = int(lib.cuda_sparse_backward(table, idx, grad, w, "sum", want_d_weights=False)[0].numel())
        t = table.clone().requires_grad_(True)

        def torch_bwd():
            t.grad = None
            torch.nn.functional.embedding_bag(idx, t, per_sample_weights=w, mode="sum").backward(grad)

        torch_ms = timed(torch_bwd, args.repeats)
        row = {"log2_lookups": log2, "rows_touched": touched, "touched_fraction": touched / n,
               "dense_ms": dense_ms, "sparse_ms": sparse_ms, "torch_fwd_bwd_ms": torch_ms,
               "dense_grad_bytes": n * d * 4, "sparse_grad_bytes": touched * (d * 4 + 8)}
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": n, "dim": d, "results": rows_out}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_sparse_gradient_{gpu}.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# CUDA backward, dense vs row-sparse ({report['date']}, {report['gpu']}, torch {report['torch']})",
             "", f"Table {n} x {d} float32, bags of 32 uniform rows, weighted sum; table gradient only.", "",
             "| B*K | rows touched | dense ms | sparse ms | sparse/dense | torch embedding_bag fwd+bwd ms |",
             "|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| 2^{r['log2_lookups']} | {r['rows_touched']} ({100 * r['touched_fraction']:.1f}%) | "
                     f"{r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | {r['sparse_ms'] / r['dense_ms']:.2f}x | "
                     f"{r['torch_fwd_bwd_ms']:.3f} |")
    with open(os.path.join(args.out, f"gpu_sparse_gradient_{gpu}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
