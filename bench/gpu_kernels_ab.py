"""A/B of libpkm_cuda.so builds (e.g. the merged tree's and a branch's) beside PyTorch, in one
process on the same inputs: forward device time (CUDA graph replay) and event time, the dense and
row-sparse backward, and their floors (writing d_table / the touched rows once). Also checks that
both builds agree (forward within float32 rounding; dense backward bitwise when its summation
order is unchanged) and, with --profile, lists the backward's kernels by device time (torch
profiler, which sees every kernel of the process).

    python bench/gpu_kernels_ab.py --libs OLD.so,NEW.so[,...] --names old,new[,...] --out DIR [--profile]
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import pkm_capi  # noqa: E402

DEV = "cuda"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, K, D, N, dtypes, with backward)
CASES = [
    (65536, 32, 256, 4194304, ("bf16", "fp16", "fp32"), True),  # 512-byte half rows; huge-table backward
    (512, 128, 1024, 262144, ("fp32", "fp16", "bf16"), True),  # small batch
    (512, 128, 256, 262144, ("bf16", "fp32"), False),  # small batch, narrow rows
    (16384, 128, 1024, 262144, ("fp32", "bf16"), True),  # the seed shape (no regression)
    (65536, 32, 128, 4194304, ("fp32",), False),  # 512-byte fp32 rows: is it the row size?
    (65536, 32, 512, 4194304, ("bf16",), False),  # 1 KB half rows
    (4096, 128, 256, 262144, ("fp32", "bf16"), True),  # narrow rows, ~2 entries per row
]


def inputs(B, K, D, N, dtype):
    gen = torch.Generator(device=DEV).manual_seed(1234)
    table = torch.randn(N, D, device=DEV, dtype=torch.float32, generator=gen).to(dtype)
    indices = torch.randint(0, N, (B, K), device=DEV, generator=gen)
    weights = torch.rand(B, K, device=DEV, generator=gen).to(dtype)
    grad = torch.randn(B, D, device=DEV, generator=gen).to(dtype)
    return table, indices, weights, grad


def kernel_breakdown(fn):
    """{kernel name: device ms} of one fn() call (after a warm-up), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            name = ev.name.split("(")[0].split("<")[0][-60:]
            totals[name] = totals.get(name, 0.0) + ev.device_time / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def interleaved_event_ms(fns, iters, warmup=3):
    """{name: median ms} of each fns[name]() between two events, the builds taking turns call by call
    (clock and load drift then hit every build alike), the GPU idle before each call."""
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(harness.cuda_event_once_ms(fn))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def case(libs, B, K, D, N, dtype_name, with_bwd, iters, profile_bwd):
    dtype = DTYPES[dtype_name]
    table, indices, weights, grad = inputs(B, K, D, N, dtype)
    elem = table.element_size()
    gathered = B * K * D * elem
    row = {"B": B, "K": K, "D": D, "N": N, "dtype": dtype_name, "gathered_GB": gathered / 1e9}
    outs = {}
    for name, lib in libs.items():
        out = torch.empty(B, D, device=DEV, dtype=dtype)
        fwd = lambda lib=lib, out=out: lib.cuda_forward(table, indices, weights, "sum", out=out)  # noqa: E731
        row[f"{name}_fwd_graph_ms"] = harness.cuda_graph_ms(fwd, iters)
        row[f"{name}_fwd_event_ms"] = harness.cuda_event_ms(fwd, iters)
        outs[name] = fwd().float()
    tfwd = lambda: F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights)  # noqa: E731
    row["torch_fwd_graph_ms"] = harness.cuda_graph_ms(tfwd, iters)
    row["torch_fwd_event_ms"] = harness.cuda_event_ms(tfwd, iters)
    ref = tfwd().float()
    for name in libs:
        row[f"{name}_fwd_rel_err_vs_torch"] = ((outs[name] - ref).norm() / ref.norm()).item()
    tiny = torch.empty(1, device=DEV)
    row["launch_floor_graph_ms"] = harness.cuda_graph_ms(lambda: tiny.zero_(), iters)
    row["launch_floor_event_ms"] = harness.cuda_event_ms(lambda: tiny.zero_(), iters)
    if with_bwd:
        dense, bwds = {}, {}
        for name, lib in libs.items():
            ws = torch.empty(max(1, lib.cuda_backward_workspace_bytes(table, indices, weights, "sum")),
                             dtype=torch.uint8, device=DEV)
            bwd = lambda lib=lib, ws=ws: lib.cuda_backward(table, indices, grad, weights, "sum",  # noqa: E731
                                                           workspace=ws)
            row[f"{name}_bwd_ms"] = harness.cuda_event_ms(bwd, iters)
            dense[name] = bwd()
            row[f"{name}_sparse_bwd_ms"] = harness.cuda_event_ms(
                lambda lib=lib: lib.cuda_sparse_backward(table, indices, grad, weights, "sum"), iters)
            if profile_bwd:
                row[f"{name}_bwd_kernels_ms"] = kernel_breakdown(bwd)
                row[f"{name}_sparse_bwd_kernels_ms"] = kernel_breakdown(
                    lambda lib=lib: lib.cuda_sparse_backward(table, indices, grad, weights, "sum"))
            bwds[name] = bwd
        if len(libs) > 1:  # the dense backward again, builds taking turns, 5x the calls
            for name, ms in interleaved_event_ms(bwds, 5 * iters).items():
                row[f"{name}_bwd_interleaved_ms"] = ms
        del bwds
        names = list(libs)
        (ta, wa), (tb, wb) = dense[names[0]], dense[names[-1]]
        for name in names[1:]:  # every build against the first
            tn, wn = dense[name]
            row[f"{name}_bwd_bitwise_equal_to_{names[0]}"] = bool(torch.equal(ta, tn) and torch.equal(wa, wn))
        row["bwd_bitwise_equal"] = bool(torch.equal(ta, tb) and torch.equal(wa, wb))
        row["bwd_rel_diff"] = ((ta.float() - tb.float()).norm() / ta.float().norm()).item()
        del dense
        buf = torch.empty(N, D, device=DEV, dtype=dtype)
        row["write_d_table_ms"] = harness.cuda_event_ms(lambda: buf.zero_(), iters)
        del buf
        touched = int(torch.unique(indices).numel())
        buf = torch.empty(touched, D, device=DEV, dtype=dtype)
        row["touched_rows"] = touched
        row["write_touched_rows_ms"] = harness.cuda_event_ms(lambda: buf.zero_(), iters)
        del buf
    del table, indices, weights, grad, outs, ref
    torch.cuda.empty_cache()
    return row


def table_md(rows, names, copy_tbps):
    a, b = names[0], names[-1]
    lines = ["| shape B,K,D,N | dtype | " + " | ".join(f"{n} fwd ms (TB/s)" for n in names) +
             " | torch fwd ms | torch / " + b + " | launch floor ms | bytes floor ms | " + b + " / floor |",
             "|---|---|" + "---|" * (len(names) + 5)]
    for r in rows:
        bytes_floor = r["gathered_GB"] / copy_tbps
        floor = max(bytes_floor, r["launch_floor_graph_ms"])
        cells = " | ".join(f"{r[f'{n}_fwd_graph_ms']:.4f} ({r['gathered_GB'] / r[f'{n}_fwd_graph_ms']:.2f})"
                           for n in names)
        lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {cells} | {r['torch_fwd_graph_ms']:.4f} | "
                     f"{r['torch_fwd_graph_ms'] / r[f'{b}_fwd_graph_ms']:.2f}x | {r['launch_floor_graph_ms']:.4f} | "
                     f"{bytes_floor:.4f} | {r[f'{b}_fwd_graph_ms'] / floor:.2f} |")
    lines += ["", "Event-timed forward (one Python call between two events: host overhead included), ms:", "",
              "| shape | dtype | " + " | ".join(names) + " | torch | launch floor |", "|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | " +
                     " | ".join(f"{r[f'{n}_fwd_event_ms']:.4f}" for n in names) +
                     f" | {r['torch_fwd_event_ms']:.4f} | {r['launch_floor_event_ms']:.4f} |")
    lines += ["", "Backward (event-timed, ms) against writing its output once:", "",
              "| shape | dtype | " + " | ".join(f"{n} bwd" for n in names) + " | write d_table | " + b + " bwd / write | " +
              " | ".join(f"{n} sparse" for n in names) + " | write touched | " + b + " sparse / write | " + a + " = " + b +
              " bitwise |", "|---|---|" + "---|" * (2 * len(names) + 5)]
    for r in rows:
        if "write_d_table_ms" not in r:
            continue
        lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | " +
                     " | ".join(f"{r[f'{n}_bwd_ms']:.3f}" for n in names) +
                     f" | {r['write_d_table_ms']:.3f} | {r[f'{b}_bwd_ms'] / r['write_d_table_ms']:.2f} | " +
                     " | ".join(f"{r[f'{n}_sparse_bwd_ms']:.3f}" for n in names) +
                     f" | {r['write_touched_rows_ms']:.3f} | {r[f'{b}_sparse_bwd_ms'] / r['write_touched_rows_ms']:.2f} | "
                     f"{r.get('bwd_bitwise_equal', '-')} |")
    inter = [r for r in rows if f"{a}_bwd_interleaved_ms" in r]
    if inter:
        lines += ["", "Dense backward event-timed again, the builds taking turns call by call (medians of 5x the "
                  "calls), ms and / write d_table:", "",
                  "| shape | dtype | " + " | ".join(f"{n} bwd | / write" for n in names) + " |",
                  "|---|---|" + "---|" * (2 * len(names))]
        for r in inter:
            w = r["write_d_table_ms"]
            lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | " +
                         " | ".join(f"{r[f'{n}_bwd_interleaved_ms']:.3f} | {r[f'{n}_bwd_interleaved_ms'] / w:.2f}"
                                    for n in names) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", required=True, help="libpkm_cuda.so builds, comma-separated (first = baseline)")
    parser.add_argument("--names", default="old,new", help="their names, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--cases", default=None, help="indices into CASES (default: all)")
    parser.add_argument("--profile", action="store_true", help="kernel breakdown of the backward calls")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    paths = args.libs.split(",")
    names = args.names.split(",")[:len(paths)]
    libs = {name: pkm_capi.PkmLib(path) for name, path in zip(names, paths)}
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / (harness.cuda_event_ms(lambda: dst.copy_(src), 20) * 1e-3) / 1e12
    del src, dst
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "copy_TBps": copy_tbps, "libs": dict(zip(names, paths)),
            "command": "python " + " ".join(sys.argv)}
    cases = CASES if args.cases is None else [CASES[int(i)] for i in args.cases.split(",")]
    rows = []
    for B, K, D, N, dtypes, with_bwd in cases:
        for dt in dtypes:
            row = case(libs, B, K, D, N, dt, with_bwd, args.iters, args.profile and with_bwd and D <= 256)
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = (f"# libpkm_cuda A/B ({', '.join(names)}) beside PyTorch on {meta['gpu']}\n\n"
            f"Run {meta['date']} UTC, torch {meta['torch']}, CUDA {meta['cuda']}, device-to-device copy "
            f"{copy_tbps:.2f} TB/s (read + write). Uniform random indices, per-sample weights, sum. "
            f"Forward: device time by CUDA graph replay (20 calls per graph), TB/s of gathered rows; floors: "
            f"launch = the same graph of a 1-element zero_, bytes = gathered bytes / copy rate.\n"
            f"Command: `{meta['command']}`\n\n" + table_md(rows, names, copy_tbps) + "\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_kernels_ab_{args.tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, f"gpu_kernels_ab_{args.tag}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
