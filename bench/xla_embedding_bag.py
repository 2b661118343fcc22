"""The fused op under XLA (tf.function(jit_compile=True)) against the fused op
outside XLA and the composite under XLA, forward+backward.

Each system runs in a fresh subprocess so its peak memory is its own: the child
starts TF (and XLA) on a tiny problem, then makes one measured call at the
full shape (for the jit systems that call also compiles: the growth includes
XLA's compiler), a second measured call (steady state), then times --repeats
calls. A last child alternates fused and fused-under-XLA calls in one process,
so host noise hits both alike, and reports the per-round time ratio.

Target (issue #14): under XLA, growth < d_table + output + 10%, time within
1.2x of the fused op outside XLA. Results: bench/results/xla_embedding_bag.{json,md}.

    python bench/xla_embedding_bag.py            # B=4096 K=128 D=512 N=65536 fp32
    python bench/xla_embedding_bag.py --quick    # small shape, smoke test
    python bench/xla_embedding_bag.py --render   # .md from the committed .json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness import RESULTS_DIR, ROOT, ab, machine_info, run_child, time_calls, utc_date, write_results

sys.path.insert(0, ROOT)
from pkm_serve._memory import peak_rss_growth  # noqa: E402

RESULTS = RESULTS_DIR
SHAPE = (4096, 128, 512, 65536)
QUICK_SHAPE = (256, 32, 64, 4096)
SYSTEMS = {  # name -> (lookup, jit_compile)
    "fused": ("fused", False),
    "fused_xla": ("fused", True),
    "composite_xla": ("composite", True),
}


def build_run(system, b, k, d, n):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import numpy as np
    import tensorflow as tf

    from pkm_serve import ops

    lookup, jit = SYSTEMS[system]
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.standard_normal((n, d), dtype=np.float32))
    idx = tf.constant(rng.integers(0, n, size=(b, k), dtype=np.int64))
    w = tf.constant(rng.uniform(0.0, 1.0, size=(b, k)).astype(np.float32))
    grad = tf.constant(rng.standard_normal((b, d), dtype=np.float32))
    fn = ops.embedding_bag if lookup == "fused" else ops.embedding_bag_composite

    @tf.function(jit_compile=jit)
    def step(idx, w, grad):
        with tf.GradientTape() as tape:
            tape.watch(w)
            out = fn(table, idx, w)
        d_table, d_w = tape.gradient(out, [table, w], output_gradients=grad)
        return out, tf.convert_to_tensor(d_table), d_w

    def run():
        res = step(idx, w, grad)
        res[0][0, 0].numpy()  # wait for the result
        return res

    return run, step


def child(system, b, k, d, n, repeats):
    run_small, _ = build_run(system, 8, 4, d, 16)
    run_small()  # runtime start-up, thread pools, XLA service
    run, _ = build_run(system, b, k, d, n)
    memory = {}
    with peak_rss_growth(memory, "first"):
        res = run()
    del res
    with peak_rss_growth(memory, "steady"):
        res = run()
    del res
    timing = time_calls(run, repeats, warmup=0)
    return {"median_ms": timing["median_ms"], "min_ms": timing["min_ms"],
            "growth_first_call_bytes": memory["first"], "growth_steady_bytes": memory["steady"]}


def interleaved(b, k, d, n, rounds):
    fused, _ = build_run("fused", b, k, d, n)
    jit, _ = build_run("fused_xla", b, k, d, n)
    return ab(jit, fused, rounds, warmup=2, names=("fused_xla", "fused"))


def child_result(args):
    return run_child(__file__, ["--child", *args])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the committed .json")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "interleaved":
            result = interleaved(*map(int, rest))
        else:
            result = child(kind, *map(int, rest))
        print(json.dumps(result))
        return
    if args.render:
        with open(os.path.join(RESULTS, "xla_embedding_bag.json")) as f:
            report = json.load(f)
        with open(os.path.join(RESULTS, "xla_embedding_bag.md"), "w") as f:
            f.write(render(report))
        return
    b, k, d, n = QUICK_SHAPE if args.quick else SHAPE
    budget = int(1.1 * (n * d * 4 + b * d * 4))  # d_table + output + 10%
    results = {}
    for system in SYSTEMS:
        results[system] = child_result([system, b, k, d, n, args.repeats])
        print(system, results[system], flush=True)
    results["interleaved"] = child_result(["interleaved", b, k, d, n, args.rounds])
    print("interleaved", results["interleaved"], flush=True)
    report = {"shape": {"B": b, "K": k, "D": d, "N": n, "dtype": "float32", "mode": "fwd+bwd"},
              "machine": machine_info(), "memory_budget_bytes": budget, "results": results,
              "date": utc_date()}
    if args.quick:
        return
    write_results("xla_embedding_bag", report, render(report))
    print(render(report))


def render(report):
    s, m, r = report["shape"], report["machine"], report["results"]
    mb = lambda x: f"{x / 2**20:.0f} MB"  # noqa: E731
    budget = report["memory_budget_bytes"]
    lines = [f"# XLA (jit_compile=True) EmbeddingBag forward+backward, {report['date']}", "",
             f"B={s['B']} K={s['K']} D={s['D']} N={s['N']} float32; gradients of the table (dense) and the "
             "weights, output kept.",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, shared with parallel builds and "
             "tests of other engineers (noisy: compare the ratios of one run).",
             f"Budget (issue #14): growth < d_table + output + 10% = {mb(budget)}; time within 1.2x of the "
             "fused op outside XLA.", "",
             "| system | median ms | min ms | RSS growth, 1st call (incl. XLA compile) | RSS growth, 2nd call |",
             "|---|---|---|---|---|"]
    for name in SYSTEMS:
        x = r[name]
        if "error" in x:
            lines.append(f"| {name} | error: {x['error']} | | | |")
            continue
        lines.append(f"| {name} | {x['median_ms']:.0f} | {x['min_ms']:.0f} | {mb(x['growth_first_call_bytes'])} | "
                     f"{mb(x['growth_steady_bytes'])} |")
    lines += ["", "The 2nd call reuses the buffers the allocator kept from the 1st, so its growth is ~0 for "
                  "every system; the 1st call is the memory comparison."]
    x = r.get("fused_xla", {})
    if "growth_first_call_bytes" in x:
        verdict = "within" if x["growth_first_call_bytes"] < budget else "OVER"
        lines.append(f"fused under XLA: {mb(x['growth_first_call_bytes'])} growth, {verdict} the {mb(budget)} "
                     "budget (d_weights and XLA's compiler included).")
    i = r["interleaved"]
    if "error" not in i:
        lines += ["", f"Interleaved in one process ({i['rounds']} rounds): fused under XLA "
                      f"{i['fused_xla_median_ms']:.0f} ms vs fused outside XLA {i['fused_median_ms']:.0f} ms, "
                      f"ratio (XLA / outside) median {i['ratio_median']:.2f} (min {i['ratio_min']:.2f}, "
                      f"max {i['ratio_max']:.2f}); target <= 1.2."]
    lines += ["", "Command: `.venv/bin/python bench/xla_embedding_bag.py`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
