"""GPU PKM training step: our fused backward + Adam vs our unfused path vs PyTorch, one run.

The seed PKM: 512^2 keys x 1024-wide values (268M parameters, 1.07 GB fp32), 4 heads x knn 32
(bags of 128 rows with softmax weights), query dim 1024, input dim 1024. Step = forward +
MSE loss + backward + Adam on every parameter (lr 1e-3). Variants, each in a fresh process
(peak memory is its own), interleaved over --rounds:

  ours-fused    values read by pkm_cuda_forward; backward = pkm_cuda_fused_update (lazy Adam
                applied in place, d_weights out; no table gradient); torch Adam(fused) on the rest
  ours-unfused  the same forward; pkm_cuda_sparse_backward (unique rows + gradient rows), then
                a lazy Adam of those rows in torch (index_select / index_copy_)
  torch-dense   nn.EmbeddingBag(mode="sum", per_sample_weights) + torch.optim.Adam
  torch-fused   the same with Adam(fused=True)
  torch-sparse  nn.EmbeddingBag(sparse=True) + SparseAdam on the values, Adam on the rest
  values-*      the value memory alone (lookup of 128 random rows per query with softmax-like
                weights, backward, Adam on the table): ours-fused vs nn.EmbeddingBag + Adam(fused),
                whose peak shows what the op itself holds beyond table + Adam state

    make gpu-standalone && python bench/gpu_fused_optimizer.py      # on a CUDA machine

Writes bench/results/gpu_fused_optimizer_<gpu>.{json,md}: min and median ms per step over
--steps steps, peak device memory (torch.cuda.max_memory_allocated), and the state bound
table + optimizer state of the values.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
VARIANTS = ("ours-fused", "ours-unfused", "torch-dense", "torch-fused", "torch-sparse",
            "values-ours-fused", "values-torch-fused")
CONFIG = dict(n_keys=512, v_dim=1024, k_dim=1024, d_model=1024, heads=4, knn=32)


def build_model(torch, variant, lr):
    c = CONFIG
    dev = "cuda"
    n_values = c["n_keys"] ** 2
    query = torch.nn.Linear(c["d_model"], c["heads"] * c["k_dim"]).to(dev)
    keys = torch.nn.Parameter(torch.randn(c["heads"], 2, c["n_keys"], c["k_dim"] // 2, device=dev) / 32)
    dense_params = list(query.parameters()) + [keys]
    if variant.startswith("torch"):
        values = torch.nn.EmbeddingBag(n_values, c["v_dim"], mode="sum", sparse=variant == "torch-sparse").to(dev)
        torch.nn.init.normal_(values.weight, std=c["v_dim"] ** -0.5)
        if variant == "torch-sparse":
            opts = [torch.optim.Adam(dense_params, lr=lr), torch.optim.SparseAdam(list(values.parameters()), lr=lr)]
        else:
            opts = [torch.optim.Adam(dense_params + list(values.parameters()), lr=lr,
                                     fused=variant == "torch-fused")]
        lookup = lambda idx, w: values(idx, per_sample_weights=w)  # noqa: E731
        return query, keys, lookup, opts
    import pkm_capi

    lib = pkm_capi.PkmLib()
    table = torch.randn(n_values, c["v_dim"], device=dev) * c["v_dim"] ** -0.5
    m, v = torch.zeros_like(table), torch.zeros_like(table)
    state = {"step": 0}
    opts = [torch.optim.Adam(dense_params, lr=lr, fused=True)]

    class Lookup(torch.autograd.Function):
        @staticmethod
        def forward(ctx, idx, w):
            ctx.save_for_backward(idx, w)
            return lib.cuda_forward(table, idx, w)

        @staticmethod
        def backward(ctx, grad):
            idx, w = ctx.saved_tensors
            grad = grad.contiguous()
            state["step"] += 1
            if variant == "ours-fused":
                d_w = lib.cuda_fused_update(table, idx, grad, "adam", (m, v), w, learning_rate=lr, epsilon=1e-8,
                                            beta_1=0.9, beta_2=0.999, step=state["step"])
                return None, d_w
            rows, g, d_w = lib.cuda_sparse_backward(table, idx, grad, w)
            t = state["step"]
            alpha = lr * (1 - 0.999 ** t) ** 0.5 / (1 - 0.9 ** t)
            m_r = m.index_select(0, rows).lerp_(g, 0.1)
            v_r = v.index_select(0, rows).mul_(0.999).addcmul_(g, g, value=0.001)
            m.index_copy_(0, rows, m_r)
            v.index_copy_(0, rows, v_r)
            table.index_copy_(0, rows, table.index_select(0, rows).addcdiv_(m_r, v_r.sqrt_().add_(1e-8), value=-alpha))
            return None, d_w

    return query, keys, Lookup.apply, opts


def pkm_forward(torch, query, keys, lookup, x):
    c = CONFIG
    b = x.shape[0]
    q = query(x).view(b, c["heads"], 2, c["k_dim"] // 2)
    s = torch.einsum("bhtd,htnd->bhtn", q, keys)  # [B, H, 2, n_keys]
    v1, i1 = s[:, :, 0].topk(c["knn"], dim=-1)
    v2, i2 = s[:, :, 1].topk(c["knn"], dim=-1)
    all_s = (v1[..., :, None] + v2[..., None, :]).flatten(-2)
    all_i = (i1[..., :, None] * c["n_keys"] + i2[..., None, :]).flatten(-2)
    best, pos = all_s.topk(c["knn"], dim=-1)
    idx = all_i.gather(-1, pos).reshape(b, -1)
    w = torch.softmax(best, dim=-1).reshape(b, -1)
    return lookup(idx, w)


def child(variant, batch, steps, matmul_precision):
    import torch

    # "high" lets float32 matmuls (the query projection, the key scores) use TF32, in every variant alike.
    torch.set_float32_matmul_precision(matmul_precision)
    torch.manual_seed(0)
    values_only = variant.startswith("values-")
    query, keys, lookup, opts = build_model(torch, variant.replace("values-", ""), lr=1e-3)
    x = torch.randn(batch, CONFIG["d_model"], device="cuda")
    target = torch.randn(batch, CONFIG["v_dim"], device="cuda")
    k = CONFIG["heads"] * CONFIG["knn"]
    idx = torch.randint(0, CONFIG["n_keys"] ** 2, (batch, k), device="cuda")
    w = torch.softmax(torch.randn(batch, k, device="cuda"), -1).requires_grad_(True)
    if values_only:
        del query, keys
        opts = opts[1:] if variant == "values-torch-sparse" else opts
        torch.cuda.empty_cache()

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        out = lookup(idx, w) if values_only else pkm_forward(torch, query, keys, lookup, x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        for o in opts:
            o.step()
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    n_values = CONFIG["n_keys"] ** 2 * CONFIG["v_dim"]
    print(json.dumps({"variant": variant, "batch": batch, "matmul_precision": matmul_precision, "min_ms": min(times),
                      "median_ms": sorted(times)[len(times) // 2], "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                      "values_table_and_adam_gb": 3 * n_values * 4 / 1e9, "loss": float(loss)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "BATCH"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="16384,4096")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--matmul-precision", default="highest", choices=("highest", "high"),
                        help="torch.set_float32_matmul_precision in every variant (high: TF32 matmuls)")
    parser.add_argument("--tag", default=None, help="results file suffix (default: h200 / gpu)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.steps, args.matmul_precision)
    variants = tuple(v for v in args.variants.split(",") if v)
    import harness

    rows = []
    for r in range(args.rounds):
        for batch in map(int, args.batches.split(",")):
            for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                res = harness.run_child(os.path.abspath(__file__), ["--child", variant, batch, "--steps", args.steps,
                                                                     "--matmul-precision", args.matmul_precision])
                res.setdefault("variant", variant)
                res.setdefault("batch", batch)
                res["round"] = r
                print(json.dumps(res), flush=True)
                rows.append(res)
    info = harness.machine_info()
    name = harness.machine_name(info)
    tag = args.tag or ("h200" if any("H200" in g for g in info.get("gpus") or []) else "gpu")
    best = {}
    for row in rows:
        key = (row["batch"], row["variant"])
        if "min_ms" in row and (key not in best or row["min_ms"] < best[key]["min_ms"]):
            best[key] = row
    lines = [f"# PKM training step on the GPU: fused Adam vs unfused vs PyTorch ({name})", "",
             f"Seed PKM (512^2 x 1024 values = 268M params, 4 heads x knn 32, query dim 1024), Adam lr 1e-3; "
             f"min over {args.steps} steps, best of {args.rounds} interleaved rounds, each variant in a fresh process; "
             f"float32 matmul precision {args.matmul_precision!r} in every variant. "
             f"Machine: {info}. Shared machine.", "",
             "| B | variant | min ms/step | median ms | vs torch-fused | peak GB | values table + Adam GB |",
             "|---|---|---|---|---|---|---|"]
    for batch in map(int, args.batches.split(",")):
        ref = best.get((batch, "torch-fused"))
        for variant in variants:
            row = best.get((batch, variant))
            if row is None:
                err = next((x.get("error") for x in rows if x["batch"] == batch and x["variant"] == variant), "")
                lines.append(f"| {batch} | {variant} | error: {err} | | | | |")
                continue
            ratio = f"{row['min_ms'] / ref['min_ms']:.2f}x" if ref else "-"
            lines.append(f"| {batch} | {variant} | {row['min_ms']:.2f} | {row['median_ms']:.2f} | {ratio} | "
                         f"{row['peak_gb']:.2f} | {row['values_table_and_adam_gb']:.2f} |")
    harness.write_results(f"gpu_fused_optimizer_{tag}", {"machine": info, "rows": rows}, "\n".join(lines),
                          out_dir=args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
