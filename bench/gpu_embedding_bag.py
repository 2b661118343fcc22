"""GPU EmbeddingBag benchmark: pkm_serve CUDA kernels vs PyTorch, in one run.

Compares, on the same random inputs and in the same process:
  ours       libpkm_cuda.so (kernels/cuda) through ctypes on torch tensors
  torch      torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=w)
  composite  (table[idx] * w[..., None]).sum(1)   (what the seed model did)
for forward and forward+backward (dense d_params and d_weights), reporting the
median time over CUDA-event-timed repeats, the effective gathered bandwidth
(B*K*D*elem bytes of rows / forward time), and peak device memory of the
forward+backward step above the inputs (table, indices, weights, upstream grad).

    make gpu-standalone
    python bench/gpu_embedding_bag.py --out bench/results   # writes gpu_embedding_bag_<gpu>.{json,md}
"""

import argparse
import json
import os
import platform
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
SHAPES = [  # (B, K, D, N)
    (16384, 128, 1024, 262144),  # the seed's BERT shape
    (8192, 128, 4096, 1048576),
    (65536, 32, 256, 4194304),  # 512-byte half rows; the huge-table backward (N=4M, B*K=2M)
    (512, 128, 1024, 262144),  # a small batch: launch- and tail-bound
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def time_ms(fn, iters, warmup=3):
    """Median milliseconds of fn() over `iters` CUDA-event-timed calls (bench/harness.py)."""
    return harness.cuda_event_ms(fn, iters, warmup)


def peak_extra_bytes(fn):
    """Peak bytes allocated while fn() runs, above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak


def copy_bandwidth_tbps():
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 20)
    del src, dst
    return 2 * 2 * 1024**3 / (ms * 1e-3) / 1e12  # read + write


def bench_case(lib, B, K, D, N, dtype_name, iters, variants, with_peers=True, with_composite=True):
    dtype = DTYPES[dtype_name]
    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=DEV).manual_seed(1234)
    table = torch.randn(N, D, device=DEV, dtype=torch.float32, generator=gen).to(dtype)
    indices = torch.randint(0, N, (B, K), device=DEV, generator=gen)
    weights = torch.rand(B, K, device=DEV, generator=gen).to(dtype)
    grad = torch.randn(B, D, device=DEV, generator=gen).to(dtype)
    gathered = B * K * D * elem
    d_params_bytes = N * D * elem
    row = {"B": B, "K": K, "D": D, "N": N, "dtype": dtype_name, "gathered_GB": gathered / 1e9,
           "d_params_GB": d_params_bytes / 1e9}

    # -- ours ---------------------------------------------------------------
    out = torch.empty(B, D, device=DEV, dtype=dtype)
    for vecs in variants:
        opts = {"forward_vecs_per_lane": vecs}
        ms = time_ms(lambda: lib.cuda_forward(table, indices, weights, "sum", out=out, options=opts), iters)
        row[f"ours_fwd_ms_v{vecs}"] = ms
    ours_fwd = time_ms(lambda: lib.cuda_forward(table, indices, weights, "sum", out=out), iters)
    # Device time alone (CUDA graph replay): the event time above also holds the Python wrapper's
    # host time whenever that exceeds the kernel's.
    row["ours_fwd_graph_ms"] = harness.cuda_graph_ms(
        lambda: lib.cuda_forward(table, indices, weights, "sum", out=out), iters)
    ws_bytes = lib.cuda_backward_workspace_bytes(table, indices, weights, "sum")
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=DEV)

    def ours_step():
        y = lib.cuda_forward(table, indices, weights, "sum")
        return y, lib.cuda_backward(table, indices, grad, weights, "sum", workspace=workspace)

    ours_bwd = time_ms(lambda: lib.cuda_backward(table, indices, grad, weights, "sum", workspace=workspace), iters)
    ours_fb = time_ms(ours_step, iters)
    del workspace

    def ours_step_own_workspace():  # peak includes the workspace it allocates
        y = lib.cuda_forward(table, indices, weights, "sum")
        return y, lib.cuda_backward(table, indices, grad, weights, "sum")

    # Floors: writing d_table once (dense); writing the touched rows (row-sparse).
    d_table_buf = torch.empty(N, D, device=DEV, dtype=dtype)
    write_ms = time_ms(lambda: d_table_buf.zero_(), iters)
    del d_table_buf
    ours_sparse = time_ms(lambda: lib.cuda_sparse_backward(table, indices, grad, weights, "sum"), iters)
    touched = int(torch.unique(indices).numel())
    rows_buf = torch.empty(touched, D, device=DEV, dtype=dtype)
    write_rows_ms = time_ms(lambda: rows_buf.zero_(), iters)
    del rows_buf
    tiny = torch.empty(1, device=DEV)
    launch_ms = time_ms(lambda: tiny.zero_(), iters)
    row["launch_floor_graph_ms"] = harness.cuda_graph_ms(lambda: tiny.zero_(), iters)
    row.update(write_d_table_ms=write_ms, ours_bwd_TBps_written=d_params_bytes / (ours_bwd * 1e-3) / 1e12,
               ours_sparse_bwd_ms=ours_sparse, touched_rows=touched, write_touched_rows_ms=write_rows_ms,
               launch_floor_ms=launch_ms)
    ours_peak = peak_extra_bytes(ours_step_own_workspace)
    ours_bwd_peak = peak_extra_bytes(lambda: lib.cuda_backward(table, indices, grad, weights, "sum"))
    # correctness spot check against torch's forward on a few bags (fp32 math)
    sample = torch.arange(0, B, max(1, B // 64), device=DEV)
    ref = (table[indices[sample]].float() * weights[sample].float().unsqueeze(-1)).sum(1)
    got = lib.cuda_forward(table, indices, weights, "sum")[sample].float()
    rel = ((got - ref).norm() / ref.norm()).item()
    row.update(ours_fwd_ms=ours_fwd, ours_bwd_ms=ours_bwd, ours_fwdbwd_ms=ours_fb,
               ours_fwd_TBps=gathered / (ours_fwd * 1e-3) / 1e12, ours_peak_GB=ours_peak / 1e9, ours_bwd_peak_GB=ours_bwd_peak / 1e9,
               ours_workspace_MB=ws_bytes / 1e6, ours_check_rel_err=rel)

    if not with_peers:
        del table, indices, weights, grad, out
        torch.cuda.empty_cache()
        return row

    # -- torch --------------------------------------------------------------
    torch_fwd = time_ms(lambda: F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights), iters)
    row.update(torch_fwd_ms=torch_fwd, torch_fwd_TBps=gathered / (torch_fwd * 1e-3) / 1e12)
    row["torch_fwd_graph_ms"] = harness.cuda_graph_ms(
        lambda: F.embedding_bag(indices, table, mode="sum", per_sample_weights=weights), iters)
    t_table = table.detach().requires_grad_(True)
    t_weights = weights.detach().requires_grad_(True)

    def torch_step():
        t_table.grad = None
        t_weights.grad = None
        y = F.embedding_bag(indices, t_table, mode="sum", per_sample_weights=t_weights)
        y.backward(grad)
        return y

    try:
        row["torch_fwdbwd_ms"] = time_ms(torch_step, iters)
        t_table.grad = None
        t_weights.grad = None
        row["torch_peak_GB"] = peak_extra_bytes(torch_step) / 1e9
        t_table.grad = None
        t_weights.grad = None
        y = F.embedding_bag(indices, t_table, mode="sum", per_sample_weights=t_weights)
        row["torch_bwd_peak_GB"] = peak_extra_bytes(lambda: y.backward(grad)) / 1e9
        del y
    except (NotImplementedError, RuntimeError) as e:
        row["torch_fwdbwd_ms"] = None
        row["torch_fwdbwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    t_table.grad = None
    t_weights.grad = None
    torch.cuda.empty_cache()

    # -- composite ----------------------------------------------------------
    def composite():
        return (table[indices] * weights.unsqueeze(-1)).sum(1)

    if not with_composite or B * K * D * 4 > 40e9:
        del t_table, t_weights, table, indices, weights, grad, out
        torch.cuda.empty_cache()
        return row
    row["composite_fwd_ms"] = time_ms(composite, max(3, iters // 4))

    def composite_step():
        t_table.grad = None
        t_weights.grad = None
        y = (t_table[indices] * t_weights.unsqueeze(-1)).sum(1)
        y.backward(grad)
        return y

    try:
        row["composite_fwdbwd_ms"] = time_ms(composite_step, max(3, iters // 4))
        row["composite_peak_GB"] = peak_extra_bytes(composite_step) / 1e9
    except torch.OutOfMemoryError as e:
        row["composite_fwdbwd_ms"] = None
        row["composite_fwdbwd_error"] = f"OutOfMemoryError: {str(e)[:120]}"
    del t_table, t_weights, table, indices, weights, grad, out
    torch.cuda.empty_cache()
    return row


def fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def markdown(meta, rows):
    lines = [
        f"# GPU EmbeddingBag: pkm_serve CUDA kernels vs PyTorch ({meta['gpu']})",
        "",
        f"Run {meta['date']} UTC on {meta['gpu']} ({meta['sm_count']} SMs), torch {meta['torch']}, "
        f"CUDA {meta['cuda']}; device-to-device copy {meta['copy_TBps']:.2f} TB/s (read+write). "
        f"Uniform random indices, no padding, per-sample weights, combiner sum. Median of {meta['iters']} "
        "CUDA-event-timed calls. `peak` = peak device memory of one forward+backward step above the inputs "
        "(table, indices, weights, upstream grad): output + d_params + d_weights + temporaries; `bwd peak` = "
        "the same for the backward call alone (forward output already allocated): d_params + d_weights + temporaries.",
        f"Command: `{meta['command']}`",
        "",
        "| shape B,K,D,N | dtype | ours fwd ms (TB/s) | torch fwd ms (TB/s) | composite fwd ms | ours fwd+bwd ms | "
        "torch fwd+bwd ms | composite fwd+bwd ms | ours peak / bwd peak GB (d_params GB) | torch peak / bwd peak GB | "
        "composite peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        torch_fb = fmt(r.get("torch_fwdbwd_ms")) if r.get("torch_fwdbwd_ms") else r.get("torch_fwdbwd_error", "–")
        lines.append(
            f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {r['ours_fwd_ms']:.3f} ({r['ours_fwd_TBps']:.2f}) | "
            f"{r['torch_fwd_ms']:.3f} ({r['torch_fwd_TBps']:.2f}) | {fmt(r.get('composite_fwd_ms'))} | "
            f"{r['ours_fwdbwd_ms']:.3f} | {torch_fb} | {fmt(r.get('composite_fwdbwd_ms'))} | "
            f"{r['ours_peak_GB']:.3f} / {r['ours_bwd_peak_GB']:.3f} ({r['d_params_GB']:.3f}) | "
            f"{fmt(r.get('torch_peak_GB'), '.3f')} / {fmt(r.get('torch_bwd_peak_GB'), '.3f')} | "
            f"{fmt(r.get('composite_peak_GB'), '.2f')} |")
    lines += ["", "Issue 25 view: forward TB/s gathered and ratio to torch; backward TB/s of d_table bytes written, "
              "against writing d_table once (`zero_`); row-sparse backward against writing the touched rows; "
              "launch floor = one tiny kernel (`zero_` of 1 element), CUDA-event timed.", "",
              "| shape B,K,D,N | dtype | fwd TB/s (x torch) | fwd ms / launch floor ms | bwd ms (TB/s written) | "
              "write d_table ms | bwd / write | sparse bwd ms | write touched rows ms | sparse / write |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {r['ours_fwd_TBps']:.2f} "
            f"({r['torch_fwd_ms'] / r['ours_fwd_ms']:.2f}x) | {r['ours_fwd_ms']:.3f} / {r['launch_floor_ms']:.3f} | "
            f"{r['ours_bwd_ms']:.3f} ({r['ours_bwd_TBps_written']:.2f}) | {r['write_d_table_ms']:.3f} | "
            f"{r['ours_bwd_ms'] / r['write_d_table_ms']:.2f} | {r['ours_sparse_bwd_ms']:.3f} | "
            f"{r['write_touched_rows_ms']:.3f} | {r['ours_sparse_bwd_ms'] / r['write_touched_rows_ms']:.2f} |")
    lines += ["", "Forward device time alone (20 calls captured in one CUDA graph, median replay / 20: no Python "
              "or launch-queue overhead), against the floor max(launch floor, gathered bytes / copy rate); "
              "the launch floor is the same graph of a 1-element `zero_`.", "",
              "| shape B,K,D,N | dtype | ours ms (TB/s) | torch ms | torch / ours | launch floor ms | "
              "bytes floor ms | ours / floor |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ours_fwd_graph_ms" not in r or "torch_fwd_graph_ms" not in r:
            continue
        bytes_floor = r["gathered_GB"] * 1e9 / (meta["copy_TBps"] * 1e12) * 1e3
        floor = max(bytes_floor, r["launch_floor_graph_ms"])
        g = r["ours_fwd_graph_ms"]
        lines.append(
            f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {g:.4f} ({r['gathered_GB'] / g:.2f}) | "
            f"{r['torch_fwd_graph_ms']:.4f} | {r['torch_fwd_graph_ms'] / g:.2f}x | {r['launch_floor_graph_ms']:.4f} | "
            f"{bytes_floor:.4f} | {g / floor:.2f} |")
    lines += ["", "Targets (issue 3, seed shape 16384,128,1024,262144):", ""]
    seed = {r["dtype"]: r for r in rows if (r["B"], r["K"], r["D"], r["N"]) == SHAPES[0]}
    if "fp32" in seed:
        r = seed["fp32"]
        ratio = r["ours_fwdbwd_ms"] / r["torch_fwdbwd_ms"] if r.get("torch_fwdbwd_ms") else None
        lines.append(f"- forward fp32 >= 3.4 TB/s gathered: {r['ours_fwd_TBps']:.2f} TB/s "
                     f"({'met' if r['ours_fwd_TBps'] >= 3.4 else 'MISSED'}; copy bandwidth {meta['copy_TBps']:.2f} TB/s)")
        if ratio is not None:
            lines.append(f"- forward+backward fp32 <= 0.5x torch: {ratio:.2f}x ({'met' if ratio <= 0.5 else 'MISSED'})")
        peak = r["ours_bwd_peak_GB"] / r["d_params_GB"]
        lines.append(f"- backward peak <= size(d_params) + 5%: {peak:.3f} x d_params "
                     f"({'met' if peak <= 1.05 else 'MISSED'}); the whole forward+backward step, which also "
                     f"holds the forward output, peaks at {r['ours_peak_GB'] / r['d_params_GB']:.3f} x")
    if "bf16" in seed:
        r = seed["bf16"]
        lines.append(f"- forward bf16 <= 1.4 ms: {r['ours_fwd_ms']:.3f} ms ({'met' if r['ours_fwd_ms'] <= 1.4 else 'MISSED'})")
        lines.append(f"- bf16 backward with per-sample weights: ours {r['ours_bwd_ms']:.3f} ms; torch: "
                     f"{r.get('torch_fwdbwd_error', 'ran')}")
    lines += ["", "Ratios (torch time / ours):", ""]
    for r in rows:
        parts = [f"fwd {r['torch_fwd_ms'] / r['ours_fwd_ms']:.2f}x"]
        if r.get("torch_fwdbwd_ms"):
            parts.append(f"fwd+bwd {r['torch_fwdbwd_ms'] / r['ours_fwdbwd_ms']:.2f}x "
                         f"(ours = {r['ours_fwdbwd_ms'] / r['torch_fwdbwd_ms']:.2f} of torch)")
        parts.append(f"ours bwd alone {r['ours_bwd_ms']:.3f} ms, workspace {r['ours_workspace_MB']:.1f} MB, "
                     f"bwd peak = {r['ours_bwd_peak_GB'] / r['d_params_GB']:.3f} x d_params")
        variants = ", ".join(f"v{k[-1]}={r[k]:.3f}" for k in sorted(r) if k.startswith("ours_fwd_ms_v"))
        parts.append(f"forward vecs_per_lane variants (ms): {variants}")
        lines.append(f"- {r['B']},{r['K']},{r['D']},{r['N']} {r['dtype']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="seed shape only")
    parser.add_argument("--variants", default="1,2,4", help="forward_vecs_per_lane values to time")
    parser.add_argument("--lib", default=None, help="libpkm_cuda.so to load (default: pkm_serve/lib or $PKM_CUDA_LIB)")
    parser.add_argument("--no-peers", action="store_true", help="time only ours (for comparing builds)")
    parser.add_argument("--no-composite", action="store_true", help="skip the composite peer")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="table dtypes to time")
    parser.add_argument("--shapes", default=None, help="indices into SHAPES to time (default: all)")
    parser.add_argument("--tag", default=None, help="results file suffix (default: from the GPU name)")
    args = parser.parse_args(argv)
    lib = pkm_capi.PkmLib(args.lib)
    props = torch.cuda.get_device_properties(0)
    gpu = props.name
    meta = {"gpu": gpu, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "host": platform.node(), "iters": args.iters, "command": "python " + " ".join(sys.argv),
            "copy_TBps": copy_bandwidth_tbps()}
    variants = [int(v) for v in args.variants.split(",") if v]
    rows = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
    for B, K, D, N in shapes:
        for dtype_name in args.dtypes.split(","):
            row = bench_case(lib, B, K, D, N, dtype_name, args.iters, variants, not args.no_peers,
                             not args.no_composite)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or ("h200" if "H200" in gpu else gpu.lower().replace(" ", "_"))
    with open(os.path.join(args.out, f"gpu_embedding_bag_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.no_peers:
        for r in rows:
            print(f"{r['B']},{r['K']},{r['D']},{r['N']} {r['dtype']}: fwd {r['ours_fwd_ms']:.3f} ms "
                  f"({r['ours_fwd_TBps']:.2f} TB/s) bwd {r['ours_bwd_ms']:.3f} ms fwd+bwd {r['ours_fwdbwd_ms']:.3f} ms "
                  f"bwd peak {r['ours_bwd_peak_GB'] / r['d_params_GB']:.3f} x d_params")
        return
    text = markdown(meta, rows)
    with open(os.path.join(args.out, f"gpu_embedding_bag_{tag}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
