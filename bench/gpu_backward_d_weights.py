"""What d_weights costs the GPU backward (issue #25): the dense and the row-sparse backward of the
huge-table shape (B=65536 K=32 D=256 N=4M) with d_weights wanted, with per-sample weights but no
d_weights (frozen weights), and without weights, against writing their outputs once: a
cudaMemsetAsync of d_table (dense) and torch's zero_ of the touched rows (sparse). Without
d_weights the backward reads no table rows. One process, the variants taking turns call by call
(gpu_kernels_ab.interleaved_event_ms); dense also by CUDA-graph replay (best of 3 rounds).

    python bench/gpu_backward_d_weights.py [--dtypes bf16,fp32] [--iters 20] [--out DIR] [--tag h200]
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import pkm_capi  # noqa: E402
from gpu_backward_ab import CASES, memset_fn  # noqa: E402
from gpu_kernels_ab import DTYPES, inputs, interleaved_event_ms  # noqa: E402


def one_dtype(lib, dtype_name, iters):
    B, K, D, N = CASES["huge"]
    table, indices, weights, grad = inputs(B, K, D, N, DTYPES[dtype_name])
    memset_name, memset = memset_fn()
    d_table = torch.empty_like(table)
    d_weights = torch.empty_like(weights)
    variants = {"d_weights": (weights, True), "frozen_weights": (weights, False), "no_weights": (None, False)}
    dense = {}
    for name, (w, want_dw) in variants.items():
        ws = torch.empty(max(1, lib.cuda_backward_workspace_bytes(table, indices, w, "sum")), dtype=torch.uint8,
                         device="cuda")
        out = (d_table, d_weights if want_dw else None)
        dense[name] = (lambda w=w, ws=ws, out=out: lib.cuda_backward(
            table, indices, grad, w, "sum", workspace=ws, out=out))  # out[1] None: no d_weights
    dense["memset"] = lambda: memset(d_table)
    row = {"B": B, "K": K, "D": D, "N": N, "dtype": dtype_name, "memset": memset_name}
    graph = {name: [] for name in dense}
    for _ in range(3):
        for name, fn in dense.items():
            graph[name].append(harness.cuda_graph_ms(fn, iters))
    for name in dense:
        row[f"dense_{name}_graph_ms"] = min(graph[name])
    for name, ms in interleaved_event_ms(dense, 5 * iters).items():
        row[f"dense_{name}_event_ms"] = ms
    del dense
    touched = int(torch.unique(indices).numel())
    rows_buf = torch.empty(touched, D, device="cuda", dtype=table.dtype)
    sparse = {name: (lambda w=w, want_dw=want_dw: lib.cuda_sparse_backward(
        table, indices, grad, w, "sum", want_d_weights=want_dw)) for name, (w, want_dw) in variants.items()}
    sparse["touched_zero_"] = lambda: rows_buf.zero_()
    row["touched_rows"] = touched
    for name, ms in interleaved_event_ms(sparse, 5 * iters).items():
        row[f"sparse_{name}_event_ms"] = ms
    del sparse, rows_buf, table, indices, weights, grad, d_table, d_weights
    torch.cuda.empty_cache()
    return row


def markdown(report):
    lines = [f"# GPU backward with and without d_weights ({report['date']})", "",
             f"{report['machine']}. Huge-table shape B=65536 K=32 D=256 N=4M, uniform indices, sum. "
             "Dense: ms by CUDA-graph replay (event-timed around one call in brackets) and as a multiple of "
             "a memset of d_table; row-sparse: event-timed ms and as a multiple of torch's zero_ of the "
             "touched rows. `python bench/gpu_backward_d_weights.py`.", "",
             "| dtype | variant | dense ms | dense / memset | sparse ms | sparse / touched rows' zero_ |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        for v in ("d_weights", "frozen_weights", "no_weights"):
            g, e = r[f"dense_{v}_graph_ms"], r[f"dense_{v}_event_ms"]
            s = r[f"sparse_{v}_event_ms"]
            lines.append(f"| {r['dtype']} | {v.replace('_', ' ')} | {g:.3f} ({e:.3f}) | "
                         f"{g / r['dense_memset_graph_ms']:.2f} | {s:.3f} | "
                         f"{s / r['sparse_touched_zero__event_ms']:.2f} |")
        lines.append(f"| {r['dtype']} | write floor | memset {r['dense_memset_graph_ms']:.3f} | 1 | "
                     f"zero_ {r['sparse_touched_zero__event_ms']:.3f} ({r['touched_rows']} rows) | 1 |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    lib = pkm_capi.PkmLib(os.path.join(ROOT, "pkm_serve", "lib", "libpkm_cuda.so"))
    rows = [one_dtype(lib, d, args.iters) for d in args.dtypes.split(",")]
    report = {"machine": harness.machine_name(), "date": harness.utc_date(), "rows": rows}
    md = markdown(report)
    harness.write_results(f"gpu_backward_d_weights_{args.tag}", report, md, args.out)
    print(md)


if __name__ == "__main__":
    main()
