"""Benchmark: one PKM training step with Adam, ours vs PyTorch, side by side.

    .venv/bin/python bench/pkm_step_vs_torch.py            # needs torch (bench/requirements.txt)
    .venv/bin/python bench/pkm_step_vs_torch.py --rounds 3 --repeats 5
    .venv/bin/python bench/pkm_step_vs_torch.py --variants ours-lazy,ours-fused   # a subset

The memory: 512^2 keys x 512 values = 134M parameters (537 MB float32), 4 heads,
knn 32, query (key) dim 512, input dim 512, query batch-norm, 256 queries per
step, 2 threads, Adam on every parameter. Variants, each in a fresh process
(134M params x (table + 2 Adam slots) is ~1.6 GB per framework, so one at a
time), interleaved over --rounds so machine noise hits all of them alike:

  ours-lazy     ProductKeyMemory(sparse_gradient=True) + pkm_serve LazyAdam
  ours-fused    ProductKeyMemory(fused_optimizer=True) + pkm_serve LazyAdam: the values'
                Adam update inside the backward op (no gradient rows at all)
  ours-dense    ProductKeyMemory (dense table gradient) + keras Adam
  torch-dense   a PKM on nn.EmbeddingBag(mode="sum", per_sample_weights) + torch.optim.Adam
  torch-fused   the same with Adam(fused=True)
  torch-sparse  nn.EmbeddingBag(sparse=True): SparseAdam on the values, Adam on the rest
                (facebookresearch/XLM's choice for PKM values)

Step = forward + MSE loss + backward + optimizer update. Results:
bench/results/pkm_step_vs_torch.{json,md}.
"""
import argparse
import json
import math
import os
import statistics
import sys

from harness import ROOT, machine_name, run_child, time_calls, utc_date, write_results

VARIANTS = ("ours-lazy", "ours-fused", "ours-dense", "torch-dense", "torch-fused", "torch-sparse")
CONFIG = dict(n_keys=512, v_dim=512, k_dim=512, d_model=512, heads=4, knn=32, batch=256)


def rss_peak_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def time_steps(step, warmup, repeats):
    losses = []
    timing = time_calls(lambda: losses.append(step()), repeats, warmup=warmup)
    return [t / 1e3 for t in timing["times_ms"]], losses


def run_ours(args, mode):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    sys.path.insert(0, ROOT)
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from pkm_serve.layers import ProductKeyMemory
    from pkm_serve.optimizers import LazyAdam

    c = CONFIG
    keras.utils.set_random_seed(0)
    layer = ProductKeyMemory(v_dim=c["v_dim"], k_dim=c["k_dim"], n_keys=c["n_keys"], heads=c["heads"],
                             knn=c["knn"], query_batchnorm=True, sparse_gradient=mode == "lazy",
                             fused_optimizer=mode == "fused")
    layer.build((None, c["d_model"]))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((c["batch"], c["d_model"])), tf.float32)
    y = tf.constant(rng.standard_normal((c["batch"], c["v_dim"])), tf.float32)
    opt = keras.optimizers.Adam(1e-3) if mode == "dense" else LazyAdam(1e-3)
    opt.build(layer.trainable_variables)

    @tf.function
    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x, training=True) - y))
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    n_params = sum(int(np.prod(v.shape)) for v in layer.trainable_variables)
    return time_steps(lambda: float(train()), args.warmup, args.repeats), n_params


class TorchPKM:
    """The same PKM written on torch.nn (no code shared with ours)."""

    def __init__(self, torch, sparse):
        nn, c = torch.nn, CONFIG
        self.torch, self.c = torch, c
        half = c["k_dim"] // 2
        self.query = nn.Linear(c["d_model"], c["heads"] * c["k_dim"])
        self.bn = nn.BatchNorm1d(c["heads"] * c["k_dim"])
        bound = 1.0 / math.sqrt(half)
        self.keys = nn.Parameter(torch.empty(c["heads"], 2, c["n_keys"], half).uniform_(-bound, bound))
        self.values = nn.EmbeddingBag(c["n_keys"] ** 2, c["v_dim"], mode="sum", sparse=sparse)
        nn.init.normal_(self.values.weight, std=c["v_dim"] ** -0.5)

    def dense_parameters(self):
        return list(self.query.parameters()) + list(self.bn.parameters()) + [self.keys]

    def __call__(self, x):
        torch, c = self.torch, self.c
        b, h, knn, n = x.shape[0], c["heads"], c["knn"], c["n_keys"]
        q = self.bn(self.query(x)).view(b, h, 2, c["k_dim"] // 2)
        sub = torch.einsum("bhsd,hsnd->bhsn", q, self.keys)
        best, idx = sub.topk(knn, dim=-1)
        pair = (best[:, :, 0, :, None] + best[:, :, 1, None, :]).reshape(b, h, knn * knn)
        pair_idx = (idx[:, :, 0, :, None] * n + idx[:, :, 1, None, :]).reshape(b, h, knn * knn)
        top, pos = pair.topk(knn, dim=-1)
        slots = pair_idx.gather(-1, pos)
        w = torch.softmax(top, dim=-1)
        return self.values(slots.reshape(b, h * knn), per_sample_weights=w.reshape(b, h * knn))


def run_torch(args, variant):
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = CONFIG
    model = TorchPKM(torch, sparse=variant == "torch-sparse")
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((c["batch"], c["d_model"])), dtype=torch.float32)
    y = torch.tensor(rng.standard_normal((c["batch"], c["v_dim"])), dtype=torch.float32)
    if variant == "torch-sparse":
        opts = [torch.optim.SparseAdam([model.values.weight], lr=1e-3),
                torch.optim.Adam(model.dense_parameters(), lr=1e-3)]
    else:
        opts = [torch.optim.Adam(model.dense_parameters() + [model.values.weight], lr=1e-3,
                                 fused=variant == "torch-fused")]

    def step():
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        for o in opts:
            o.step()
        return float(loss)

    n_params = sum(p.numel() for p in model.dense_parameters()) + model.values.weight.numel()
    return time_steps(step, args.warmup, args.repeats), n_params


def child(args):
    if args.child.startswith("ours"):
        (times, losses), n_params = run_ours(args, mode=args.child.split("-", 1)[1])
    else:
        (times, losses), n_params = run_torch(args, args.child)
    print(json.dumps({"variant": args.child, "times_ms": [1e3 * t for t in times], "losses": losses,
                      "params": n_params, "peak_rss_mb": rss_peak_mb()}))


def markdown(report):
    med = report["median_ms"]
    lines = [f"# PKM training step with Adam, ours vs PyTorch ({report['date']})", "",
             f"Machine: {report['machine']}. {report['note']}", "",
             f"Memory {CONFIG['n_keys']}^2 x {CONFIG['v_dim']} = {report['params'] / 1e6:.0f}M parameters in all, "
             f"{CONFIG['heads']} heads, knn {CONFIG['knn']}, key dim {CONFIG['k_dim']}, input dim "
             f"{CONFIG['d_model']}, query batch-norm, {CONFIG['batch']} queries, {report['args']['threads']} "
             f"threads; {report['args']['rounds']} interleaved rounds x {report['args']['repeats']} timed steps "
             f"(after {report['args']['warmup']} warm-up) per variant.", "",
             "| variant | median step ms | min ms | peak RSS MB |", "|---|---|---|---|"]
    for v in VARIANTS:
        if v in med:
            lines.append(f"| {v} | {med[v]:.1f} | {report['min_ms'][v]:.1f} | {report['peak_rss_mb'][v]:.0f} |")
    # (numerator, denominator, what the ratio is, its goal as a test of the ratio or None)
    ratios = [("ours-lazy", "torch-dense", "issue #18: <= 0.25x", lambda r: r <= 0.25),
              ("ours-lazy", "torch-sparse", "issue #18: faster", lambda r: r < 1),
              ("ours-lazy", "torch-fused", "the best dense torch Adam", None),
              ("ours-fused", "ours-lazy", "the fused update against the unfused one", None),
              ("ours-fused", "torch-fused", "", None), ("ours-dense", "torch-dense", "", None)]
    lines.append("")
    for a, b, what, goal in ratios:
        if a in med and b in med:
            ratio = med[a] / med[b]
            verdict = "" if goal is None else (" (met)" if goal(ratio) else " (NOT met)")
            lines.append(f"- {a} / {b} = {ratio:.3f}x{': ' + what if what else ''}{verdict}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", help="comma-separated subset of " + ", ".join(VARIANTS))
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--note", default="2-core AMD EPYC VM shared with parallel builds and tests: expect noise.")
    args = ap.parse_args()
    if args.child:
        return child(args)
    variants = VARIANTS if args.variants is None else tuple(args.variants.split(","))
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    runs = {v: [] for v in variants}
    report = {"date": utc_date(), "machine": machine_name(), "note": args.note, "args": vars(args),
              "config": CONFIG}
    for r in range(args.rounds):
        for v in variants:
            res = run_child(os.path.abspath(__file__), ["--child", v, "--repeats", args.repeats,
                                                        "--warmup", args.warmup, "--threads", args.threads],
                            timeout=1800)
            if "error" in res:
                raise SystemExit(f"{v} failed: {res['error']}")
            print(f"round {r} {v}: median {statistics.median(res['times_ms']):.1f} ms, "
                  f"peak RSS {res['peak_rss_mb']:.0f} MB, loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}",
                  flush=True)
            runs[v].append(res)
    report["runs"] = runs
    report["median_ms"] = {v: statistics.median(t for r in rs for t in r["times_ms"]) for v, rs in runs.items()}
    report["min_ms"] = {v: min(t for r in rs for t in r["times_ms"]) for v, rs in runs.items()}
    report["peak_rss_mb"] = {v: max(r["peak_rss_mb"] for r in rs) for v, rs in runs.items()}
    report["params"] = runs[variants[0]][0]["params"]
    write_results("pkm_step_vs_torch", report, markdown(report), out_dir=args.out)
    print(markdown(report))


if __name__ == "__main__":
    main()
