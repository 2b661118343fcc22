"""PKM training step, libpkm_cuda builds A/B beside PyTorch's fused Adam, all in ONE process.

The seed PKM of bench/gpu_fused_optimizer.py (512^2 keys x 1024-wide values = 268M parameters,
4 heads x knn 32, query dim 1024; step = forward + MSE + backward + Adam, lr 1e-3). Variants:

  torch-fused    nn.EmbeddingBag(mode="sum", per_sample_weights) + torch.optim.Adam(fused=True)
  <name>         for each --libs build: values read by pkm_cuda_forward, backward =
                 pkm_cuda_fused_update (lazy Adam in place, d_weights out); Adam(fused) on the rest
  <name>+keys    the same with the key selection (3 top-k, sums, gather) by pkm_cuda_product_topk
  <name>-values  the value memory alone (lookup of 128 random rows per query with softmax
                 weights, MSE, backward + fused update): the bag part of the step

Every variant lives in the same process (their own parameters and optimizer state) and the
timed blocks of --steps steps are interleaved over --rounds, so the builds and torch see the
same GPU state. Peak per variant = the memory it holds between steps + the most a step allocates
on top (torch.cuda.max_memory_allocated around that step) + the shared inputs: what a process
running only that variant would report. --profile lists one step's kernels by device time
(torch profiler). The builds' fused updates are also compared bitwise on one call.

    python bench/gpu_pkm_step_ab.py --libs OLD.so,NEW.so --names old,new --out DIR [--profile]
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
import pkm_capi  # noqa: E402
from gpu_fused_optimizer import CONFIG, pkm_forward  # noqa: E402

DEV = "cuda"
LR = 1e-3


def dense_part():
    """The query projection and product keys, the same in every variant (seeded)."""
    c = CONFIG
    torch.manual_seed(0)
    query = torch.nn.Linear(c["d_model"], c["heads"] * c["k_dim"]).to(DEV)
    keys = torch.nn.Parameter(torch.randn(c["heads"], 2, c["n_keys"], c["k_dim"] // 2, device=DEV) / 32)
    return query, keys, list(query.parameters()) + [keys]


def torch_variant():
    query, keys, params = dense_part()
    n_values = CONFIG["n_keys"] ** 2
    values = torch.nn.EmbeddingBag(n_values, CONFIG["v_dim"], mode="sum").to(DEV)
    torch.nn.init.normal_(values.weight, std=CONFIG["v_dim"] ** -0.5)
    opts = [torch.optim.Adam(params + list(values.parameters()), lr=LR, fused=True)]
    return query, keys, (lambda idx, w: values(idx, per_sample_weights=w)), opts


class OursLookup:
    """pkm_cuda_forward + pkm_cuda_fused_update (Adam) of one build, as an autograd function."""

    def __init__(self, lib):
        self.lib = lib
        gen = torch.Generator(device=DEV).manual_seed(1)
        n_values = CONFIG["n_keys"] ** 2
        self.table = torch.randn(n_values, CONFIG["v_dim"], device=DEV, generator=gen) * CONFIG["v_dim"] ** -0.5
        self.m, self.v = torch.zeros_like(self.table), torch.zeros_like(self.table)
        self.step = 0
        me = self

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, idx, w):
                ctx.save_for_backward(idx, w)
                return me.lib.cuda_forward(me.table, idx, w)

            @staticmethod
            def backward(ctx, grad):
                idx, w = ctx.saved_tensors
                me.step += 1
                d_w = me.lib.cuda_fused_update(me.table, idx, grad.contiguous(), "adam", (me.m, me.v), w,
                                               learning_rate=LR, epsilon=1e-8, beta_1=0.9, beta_2=0.999,
                                               step=me.step)
                return None, d_w

        self.apply = Fn.apply


def ours_variant(lib, values_only):
    look = OursLookup(lib)
    if values_only:
        return None, None, look.apply, [], look
    query, keys, params = dense_part()
    return query, keys, look.apply, [torch.optim.Adam(params, lr=LR, fused=True)], look


def product_topk_fn(lib):
    """The key selection by pkm_cuda_product_topk (one kernel each way) as an autograd function."""
    n_keys, knn = CONFIG["n_keys"], CONFIG["knn"]

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scores):
            best, index, pos = lib.cuda_product_topk(scores.detach(), knn)
            ctx.save_for_backward(pos)
            ctx.mark_non_differentiable(index)
            return best, index

        @staticmethod
        def backward(ctx, d_best, _d_index):
            (pos,) = ctx.saved_tensors
            return lib.cuda_product_topk_backward(d_best, pos, n_keys)

    return Fn.apply


def pkm_forward_keys(select, query, keys, lookup, x):
    """pkm_forward (gpu_fused_optimizer.py) with the three top-k, the sums and the gather in `select`."""
    c = CONFIG
    b = x.shape[0]
    q = query(x).view(b, c["heads"], 2, c["k_dim"] // 2)
    s = torch.einsum("bhtd,htnd->bhtn", q, keys)  # [B, H, 2, n_keys]
    best, idx = select(s.reshape(b * c["heads"], 2, c["n_keys"]))
    w = torch.softmax(best.view(b, c["heads"], c["knn"]), dim=-1).reshape(b, -1)
    return lookup(idx.view(b, -1), w)


def make_step(model, inputs, values_only, select=None):
    query, keys, lookup, opts = model[:4]
    x, target, idx, w = inputs

    def forward():
        if values_only:
            return lookup(idx, w)
        if select is not None:
            return pkm_forward_keys(select, query, keys, lookup, x)
        return pkm_forward(torch, query, keys, lookup, x)

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        w.grad = None
        out = forward()
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        for o in opts:
            o.step()
        return loss

    return step


def kernel_breakdown(fn):
    """({kernel: device ms}, total device ms) of one fn() call, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            name = ev.name.replace("(anonymous namespace)::", "").split("(")[0][:90]
            totals[name] = totals.get(name, 0.0) + ev.device_time / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])), sum(totals.values())


def timed_steps(step, n):
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def bitwise_check(libs, batch):
    """One fused update per build on identical copies: table, m, v and d_weights bitwise equal?"""
    gen = torch.Generator(device=DEV).manual_seed(7)
    n, d, k = 65536, CONFIG["v_dim"], CONFIG["heads"] * CONFIG["knn"]
    base = torch.randn(n, d, device=DEV, generator=gen)
    idx = torch.randint(0, n, (batch // 4, k), device=DEV, generator=gen)
    w = torch.rand(batch // 4, k, device=DEV, generator=gen)
    grad = torch.randn(batch // 4, d, device=DEV, generator=gen)
    outs = {}
    for name, lib in libs.items():
        t, m, v = base.clone(), torch.rand_like(base), torch.rand_like(base)
        m.copy_(base.abs() * 0.01)
        v.copy_(base.square() * 0.001)
        d_w = lib.cuda_fused_update(t, idx, grad, "adam", (m, v), w, learning_rate=LR, epsilon=1e-8, beta_1=0.9,
                                    beta_2=0.999, step=3)
        outs[name] = (t, m, v, d_w)
    names = list(libs)
    ref = outs[names[0]]
    return {name: all(torch.equal(a, b) for a, b in zip(ref, outs[name])) for name in names[1:]}


def run_batch(libs, batch, args):
    k = CONFIG["heads"] * CONFIG["knn"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(batch, CONFIG["d_model"], device=DEV, generator=gen)
    target = torch.randn(batch, CONFIG["v_dim"], device=DEV, generator=gen)
    idx = torch.randint(0, CONFIG["n_keys"] ** 2, (batch, k), device=DEV, generator=gen)
    w = torch.softmax(torch.randn(batch, k, device=DEV, generator=gen), -1).requires_grad_(True)
    inputs = (x, target, idx, w)
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    variants = {}
    with_keys = [n for n, lib in libs.items() if hasattr(lib.lib, "pkm_cuda_product_topk")] if args.keys else []
    names = (["torch-fused"] + [n for n in libs] + [f"{n}+keys" for n in with_keys] +
             ([f"{n}-values" for n in libs] if args.values else []))
    for name in names:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        values_only = name.endswith("-values")
        lib_name = name.replace("-values", "").replace("+keys", "")
        model = torch_variant() if name == "torch-fused" else ours_variant(libs[lib_name], values_only)
        select = product_topk_fn(libs[lib_name]) if name.endswith("+keys") else None
        step = make_step(model, inputs, values_only, select)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        variants[name] = {"model": model, "step": step, "values_only": values_only,
                          "held_bytes": torch.cuda.memory_allocated() - before, "times": [], "extra_bytes": 0}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            var = variants[name]
            torch.cuda.synchronize()
            at_start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            var["times"] += timed_steps(var["step"], args.steps)
            var["loss"] = float(var["step"]().detach())
            var["extra_bytes"] = max(var["extra_bytes"], torch.cuda.max_memory_allocated() - at_start)
    rows = []
    for name in names:
        var = variants[name]
        t = sorted(var["times"])
        row = {"batch": batch, "variant": name, "min_ms": t[0], "median_ms": t[len(t) // 2],
               "peak_gb": (var["held_bytes"] + var["extra_bytes"] + input_bytes) / 1e9,
               "held_gb": var["held_bytes"] / 1e9, "step_extra_gb": var["extra_bytes"] / 1e9, "loss": var["loss"]}
        if args.profile:
            kernels, total = kernel_breakdown(var["step"])
            row["kernel_total_ms"] = total
            row["kernels_ms"] = {n: round(v, 4) for n, v in list(kernels.items())[:args.top]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    lib_names = list(libs)
    ours_models = [variants[n]["model"][4] for n in lib_names]
    same = {n: bool(torch.equal(ours_models[0].table, m.table) and torch.equal(ours_models[0].m, m.m))
            for n, m in zip(lib_names[1:], ours_models[1:])}
    for var in variants.values():
        var.clear()
    del variants
    torch.cuda.empty_cache()
    return rows, same


def markdown(meta, results, lib_names):
    state_gb = 3 * CONFIG["n_keys"] ** 2 * CONFIG["v_dim"] * 4 / 1e9
    lines = [f"# PKM training step: builds {', '.join(lib_names)} beside torch fused Adam ({meta['gpu']}), one process",
             "", f"Run {meta['date']} UTC, torch {meta['torch']}, CUDA {meta['cuda']}; float32 throughout "
             f"(matmul precision 'highest'); min / median over {meta['steps']} x {meta['rounds']} interleaved "
             f"steps per variant. Values table + Adam state = {state_gb:.2f} GB (+10% = {1.1 * state_gb:.2f} GB). "
             f"Shared machine. Command: `{meta['command']}`", "",
             "| B | variant | min ms/step | median ms | vs torch-fused (min) | peak GB |", "|---|---|---|---|---|---|"]
    for batch, (rows, _) in results.items():
        ref = next(r for r in rows if r["variant"] == "torch-fused")["min_ms"]
        for r in rows:
            lines.append(f"| {batch} | {r['variant']} | {r['min_ms']:.2f} | {r['median_ms']:.2f} | "
                         f"{r['min_ms'] / ref:.3f}x | {r['peak_gb']:.2f} |")
    for batch, (rows, same) in results.items():
        lines.append("")
        lines.append(f"B={batch}: after every timed step, each build's table and m equal to {lib_names[0]}'s "
                     f"bitwise: {same}; one fused update bitwise equal: {meta['bitwise'].get(str(batch))}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", required=True)
    parser.add_argument("--names", default="old,new")
    parser.add_argument("--batches", default="16384,4096")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--values", action="store_true", help="also the value memory alone per build")
    parser.add_argument("--keys", action="store_true",
                        help="also <build>+keys: the key selection by pkm_cuda_product_topk (builds that have it)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--tag", default="h200_round6")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    paths = args.libs.split(",")
    lib_names = args.names.split(",")[:len(paths)]
    libs = {n: pkm_capi.PkmLib(p) for n, p in zip(lib_names, paths)}
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "steps": args.steps, "rounds": args.rounds,
            "libs": dict(zip(lib_names, paths)), "command": "python " + " ".join(sys.argv), "bitwise": {}}
    results = {}
    for batch in map(int, args.batches.split(",")):
        if len(libs) > 1:
            meta["bitwise"][str(batch)] = bitwise_check(libs, batch)
        results[batch] = run_batch(libs, batch, args)
    text = markdown(meta, results, lib_names)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_pkm_step_{args.tag}.json"), "w") as f:
        json.dump({"meta": meta, "results": {str(b): {"rows": r, "state_equal": s} for b, (r, s) in results.items()}},
                  f, indent=1)
    with open(os.path.join(args.out, f"gpu_pkm_step_{args.tag}.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
