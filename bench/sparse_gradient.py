"""Benchmark: dense vs row-sparse table gradient, and ParameterServer steps/s.

    .venv/bin/python bench/sparse_gradient.py                  # both parts
    .venv/bin/python bench/sparse_gradient.py --part gradient  # N=2^20 x D=256, B*K = 2^14 .. 2^22
    .venv/bin/python bench/sparse_gradient.py --part ps        # PS cluster, 1 vs 2 table shards

gradient: one training step on a 2^20 x 256 float32 table (1 GiB) — forward,
table gradient, SGD update (dense: assign_sub of the [N, D] gradient; sparse:
scatter_sub of the IndexedSlices of touched rows) — for B*K lookups in bags of
K = 32 uniform random rows. Reports the gradient's bytes (dense N*D*4; sparse
U*(D*4 + 8) for U touched rows) and the step time, median of the repeats, so
the crossover (rows touched / N where dense becomes cheaper) can be read off.
ps: tests/distribute/ps_train.py (in-process loopback cluster, 2 workers,
2 PS) with the table in 1 and in 2 row shards, dense and sparse gradients.
Results: bench/results/sparse_gradient.{json,md}.
"""
import argparse
import json
import os
import subprocess
import sys

from harness import ROOT, interleaved, machine_name, utc_date, write_results

sys.path.insert(0, ROOT)


def gradient_part(args):
    import numpy as np
    import tensorflow as tf

    from pkm_serve import ops

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    n, d, k = args.rows, args.dim, 32
    table = tf.Variable(tf.random.uniform([n, d], -0.1, 0.1, seed=0))
    rng = np.random.default_rng(0)
    results = []

    def make_step(sparse):
        @tf.function
        def step(idx):
            with tf.GradientTape() as tape:
                out = ops.embedding_bag(table, idx, combiner="sum", sparse_gradient=sparse)
                loss = tf.reduce_sum(out * out)
            g = tape.gradient(loss, table)
            if sparse:
                table.scatter_sub(tf.IndexedSlices(1e-6 * g.values, g.indices))
                return tf.size(g.indices, tf.int64)
            table.assign_sub(1e-6 * g)
            return tf.constant(n, tf.int64)
        return step

    steps = {"dense": make_step(False), "sparse": make_step(True)}
    for log2 in range(args.min_log2, args.max_log2 + 1, 2):
        lookups = 1 << log2
        idx = tf.constant(rng.integers(0, n, size=(lookups // k, k)), tf.int64)
        row = {"lookups": lookups, "log2_lookups": log2}
        touched = {mode: int(steps[mode](idx)) for mode in steps}  # warm-up (and trace)
        # dense and sparse alternate: machine noise hits both
        timing = interleaved({mode: (lambda s=steps[mode]: s(idx).numpy()) for mode in steps}, args.repeats,
                             warmup=0)["systems"]
        for mode in ("dense", "sparse"):
            row[f"{mode}_ms"] = timing[mode]["median_ms"]
            row[f"{mode}_times_ms"] = timing[mode]["times_ms"]
            if mode == "sparse":
                row["rows_touched"] = touched["sparse"]
                row["touched_fraction"] = touched["sparse"] / n
                row["sparse_grad_bytes"] = touched["sparse"] * (d * 4 + 8)
            else:
                row["dense_grad_bytes"] = n * d * 4
        row["sparse_over_dense_time"] = row["sparse_ms"] / row["dense_ms"]
        row["sparse_over_dense_bytes"] = row["sparse_grad_bytes"] / row["dense_grad_bytes"]
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def ps_part(args):
    script = os.path.join(ROOT, "tests", "distribute", "ps_train.py")
    out = []
    for sparse in (1, 0):
        for shards in (1, 2):
            path = f"/tmp/pkm_ps_bench_{os.getpid()}.json"
            cmd = [sys.executable, script, path, "--shards", str(shards), "--rows", str(args.ps_rows),
                   "--dim", str(args.ps_dim), "--bag", "32", "--batch", "256", "--steps", str(args.ps_steps),
                   "--sparse", str(sparse), "--lr", "0.05"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=900)
            with open(path) as f:
                r = json.load(f)
            os.unlink(path)
            row = {"sparse_gradient": bool(sparse), "shards": shards, "steps_per_s": r["steps_per_s"],
                   "loss_before": r["loss_before"], "loss_after": r["loss_after"]}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def markdown(report):
    lines = [f"# Dense vs row-sparse table gradient ({report['date']})", "",
             f"Machine: {report['machine']}. {report['note']}", ""]
    g = report.get("gradient")
    if g:
        a = report["args"]
        lines += [f"## One training step, table {a['rows']} x {a['dim']} float32 "
                  f"({a['rows'] * a['dim'] * 4 / 2**30:.2f} GiB), bags of 32, {a['threads']} threads", "",
                  "| B*K lookups | rows touched (of N) | dense grad MB | sparse grad MB | dense step ms | "
                  "sparse step ms | sparse/dense time |",
                  "|---|---|---|---|---|---|---|"]
        for r in g:
            lines.append(f"| 2^{r['log2_lookups']} | {r['rows_touched']} ({100 * r['touched_fraction']:.1f}%) | "
                         f"{r['dense_grad_bytes'] / 1e6:.0f} | {r['sparse_grad_bytes'] / 1e6:.1f} | "
                         f"{r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | {r['sparse_over_dense_time']:.2f}x |")
        lines += ["", "Step = forward + table gradient + SGD update (dense `assign_sub` of [N, D]; sparse "
                  "`scatter_sub` of the touched rows). Median of the repeats (dense and sparse alternating), after one warm-up step.", ""]
    p = report.get("ps")
    if p:
        lines += ["## ParameterServerStrategy, in-process loopback cluster (2 workers, 2 PS)", "",
                  f"Table {report['args']['ps_rows']} x {report['args']['ps_dim']}, batch 256 bags of 32, "
                  "SGD on the PS; all tasks share this machine's cores, so this measures the sharding overhead, "
                  "not the scaling a cluster of machines would give.", "",
                  "| gradient | shards | steps/s | eval loss before -> after (few steps: this measures throughput) |", "|---|---|---|---|"]
        for r in p:
            lines.append(f"| {'sparse' if r['sparse_gradient'] else 'dense'} | {r['shards']} | "
                         f"{r['steps_per_s']:.1f} | {r['loss_before']:.3f} -> {r['loss_after']:.3f} |")
        for sparse in (True, False):
            rs = {r["shards"]: r["steps_per_s"] for r in p if r["sparse_gradient"] == sparse}
            if 1 in rs and 2 in rs:
                lines.append(f"\n{'sparse' if sparse else 'dense'}: 2 shards / 1 shard steps/s = "
                             f"{rs[2] / rs[1]:.2f}x")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "gradient", "ps"), default="all")
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--min-log2", type=int, default=14)
    ap.add_argument("--max-log2", type=int, default=22)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ps-rows", type=int, default=1 << 18)
    ap.add_argument("--ps-dim", type=int, default=64)
    ap.add_argument("--ps-steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--note", default="2-core AMD EPYC VM shared with parallel builds and tests: expect noise.")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    report = {"date": utc_date(), "machine": machine_name(), "note": args.note, "args": vars(args)}
    json_path = os.path.join(args.out, "sparse_gradient.json")
    if args.part != "all" and os.path.exists(json_path):  # keep the other part's last results
        with open(json_path) as f:
            old = json.load(f)
        report.update({k: old[k] for k in ("gradient", "ps") if k in old})
        report["args"] = {**old.get("args", {}), **vars(args)}
    if args.part in ("all", "gradient"):
        report["gradient"] = gradient_part(args)
    if args.part in ("all", "ps"):
        report["ps"] = ps_part(args)
    write_results("sparse_gradient", report, markdown(report), out_dir=args.out)
    print(markdown(report))


if __name__ == "__main__":
    main()
