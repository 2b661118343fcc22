"""A/B of the TF op (forward + backward, eager, CPU) between two builds of
_pkm_ops.so: TF loads one op library per process, so each round runs one child
per build (PKM_SERVE_OPS_LIB), the order alternating (bench/harness.py's
run_child); each child times --repeats calls after a warm-up.

    python bench/tf_op_ab_before_after.py BEFORE.so AFTER.so [--rounds 3] [--name tf_op_ab_struct]
"""
import argparse
import os
import statistics
import sys

from harness import ROOT, machine_info, machine_name, run_child, time_calls, utc_date, write_results

SHAPE = (1024, 32, 128, 65536)  # B, K, D, N


def child(repeats):
    sys.path.insert(0, ROOT)
    import numpy as np
    import tensorflow as tf

    from pkm_serve import ops

    b, k, d, n = SHAPE
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.standard_normal((n, d), dtype=np.float32))
    idx = tf.constant(rng.integers(0, n, (b, k)), tf.int64)
    w = tf.constant(rng.uniform(0, 1, (b, k)).astype(np.float32))

    def step():
        with tf.GradientTape() as tape:
            tape.watch(w)
            out = ops.embedding_bag(table, idx, w)
        tape.gradient(out, [table, w])[1].numpy()

    return time_calls(step, repeats, warmup=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", nargs="?")
    ap.add_argument("after", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--name", default="tf_op_ab_before_after", help="bench/results/<name>.{json,md}")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import json
        print(json.dumps(child(args.child)))
        return
    libs = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    medians = {name: [] for name in libs}
    for r in range(args.rounds):
        for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            res = run_child(__file__, ["--child", args.repeats],
                            env={"PKM_SERVE_OPS_LIB": libs[name], "TF_CPP_MIN_LOG_LEVEL": "2",
                                 "CUDA_VISIBLE_DEVICES": ""})
            if "error" in res:
                raise SystemExit(f"{name}: {res['error']}")
            medians[name].append(res["median_ms"])
            print(name, round(res["median_ms"], 2), flush=True)
    ratios = [a / b for a, b in zip(medians["after"], medians["before"])]
    info = machine_info()
    report = {"date": utc_date(), "machine": info, "shape": dict(zip("BKDN", SHAPE)), "medians_ms": medians,
              "ratio_per_round": ratios, "ratio_median": statistics.median(ratios)}
    b, k, d, n = SHAPE
    md = "\n".join([
        f"# TF op A/B before/after, forward + backward ({report['date']})", "",
        f"Machine: {machine_name(info)}, shared with other engineers' builds and tests (noisy). Eager CPU "
        f"ops.embedding_bag + tape gradient (d_table dense, d_weights), B={b} K={k} D={d} N={n} float32; "
        f"{args.rounds} rounds, one child per build per round (order alternating), median of {args.repeats} "
        "steps each.", "",
        "| build | per-round median ms |", "|---|---|",
        *[f"| {name} | {', '.join(f'{m:.1f}' for m in ms)} |" for name, ms in medians.items()], "",
        f"after / before per round: {', '.join(f'{x:.3f}' for x in ratios)}; median {report['ratio_median']:.3f}.",
        "", f"Command: `.venv/bin/python bench/tf_op_ab_before_after.py {args.before} {args.after} "
        f"--rounds {args.rounds} --repeats {args.repeats} --name {args.name}`"])
    write_results(args.name, report, md)
    print(md)


if __name__ == "__main__":
    main()
