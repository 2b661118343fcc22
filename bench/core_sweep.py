"""The core's forward over row widths, bag sizes, dtypes and weightings, two source trees side by side in
one run (bench only): the regression check for a kernel change, across the shapes one change can reach
without touching (round 45's last commit slowed the short rows 3-4x at widths its own A/B did not time).

    git worktree add --detach /tmp/base main
    .venv/bin/python bench/core_sweep.py /tmp/base .              # 99 shapes
    .venv/bin/python bench/core_sweep.py /tmp/base . --quick      # 24 shapes

Each tree's kernels/core is built by bench/build_core.sh and timed by bench/native/core_vs_loop.cc as TF
runs the op (int64 indices, the range in 8 claimed blocks, the same rows every call; B=2048, N=65536,
2 threads; bfloat16 output of bfloat16 rows): float32 D=16-512 and bfloat16 D=32-512, K=1, 8 and 128,
weights of 0.5 / none / mean. Both builds are loaded in one process and called in turn, call by call
(--calls each), in --turns processes per shape; the ratio is B's median over A's. A shape over --flag
is timed again, 2 * turns + 1 processes of 4x the calls, and that second ratio stands (the first is
kept beside it); a row still over --flag is marked. Writes bench/results/core_sweep_<tag>.{json,md}.
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

from harness import ROOT, machine_name, utc_date, write_results

WIDTHS = {"float32": (16, 32, 64, 128, 256, 512), "bfloat16": (32, 64, 128, 256, 512)}
QUICK_WIDTHS = {"float32": (32, 128, 512), "bfloat16": (64, 128, 512)}
BAG_SIZES, QUICK_BAG_SIZES = (1, 8, 128), (8, 128)
WEIGHTINGS = {"weights 0.5": [], "unweighted": ["unweighted"], "mean": ["mean"]}
QUICK_WEIGHTINGS = ("weights 0.5", "unweighted")


def build(tree, work, name):
    lib = os.path.join(work, f"core_{name}.so")
    subprocess.run([os.path.join(ROOT, "bench", "build_core.sh"), tree, lib], check=True)
    return lib


def compare(timer, libs, dtype, d, k, weighting, turns, calls):
    """Both builds on one shape: `turns` processes, each timing them call by call in turn on the same
    inputs; the medians of the turns' medians."""
    cmd = [timer, "2048", str(k), str(d), "65536", dtype, str(calls), "int64", "blocks=8", "rolled",
           *WEIGHTINGS[weighting], "noloop", "--", libs["a"], libs["b"]]
    times = {"a": [], "b": []}
    for _ in range(turns):
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()
                         .splitlines()[-1])
        times["a"].append(out["op_median_ms"])
        times["b"].append(out["b_median_ms"])
    a, b = statistics.median(times["a"]), statistics.median(times["b"])
    return {"a_ms": a, "b_ms": b, "ratio": b / a, "a_turns": times["a"], "b_turns": times["b"],
            "command": " ".join(cmd)}


def sweep(args, timer, libs):
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    rows = []
    for dtype, ds in widths.items():
        for d in ds:
            for k in QUICK_BAG_SIZES if args.quick else BAG_SIZES:
                for weighting in QUICK_WEIGHTINGS if args.quick else WEIGHTINGS:
                    row = {"dtype": dtype, "D": d, "K": k, "weighting": weighting,
                           **compare(timer, libs, dtype, d, k, weighting, args.turns, args.calls)}
                    if row["ratio"] > args.flag:  # noise or not: again, longer
                        row["first"] = {key: row[key] for key in ("a_ms", "b_ms", "ratio")}
                        row.update(compare(timer, libs, dtype, d, k, weighting, 2 * args.turns + 1,
                                           4 * args.calls))
                    rows.append(row)
                    again = f" (first {row['first']['ratio']:.3f}x)" if "first" in row else ""
                    print(f"{dtype} D={d} K={k} {weighting}: {row['a_ms']:.4f} -> {row['b_ms']:.4f} ms "
                          f"({row['ratio']:.3f}x){again}", flush=True)
    return rows


def markdown(report):
    lines = [f"# The core's forward, two trees side by side ({report['date']})", "",
             f"Machine: {report['machine']}. A = `{report['a']}`, B = `{report['b']}`. core_vs_loop as TF runs "
             f"the op (int64 indices, 8 claimed blocks, rolled rows), B=2048 N=65536, 2 threads, both builds "
             f"in one process called in turn; {report['turns']} processes of {report['calls']} calls per build "
             f"and shape, medians; a shape over "
             f"{report['flag']} timed again ({2 * report['turns'] + 1} processes of {4 * report['calls']} calls), "
             f"which stands. Marked: still over {report['flag']}.", "",
             "| dtype | D | K | weighting | A ms | B ms | B / A | first B / A, where timed again |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        mark = " **over**" if r["ratio"] > report["flag"] else ""
        first = f"{r['first']['ratio']:.3f}" if "first" in r else ""
        lines.append(f"| {r['dtype']} | {r['D']} | {r['K']} | {r['weighting']} | {r['a_ms']:.4f} | "
                     f"{r['b_ms']:.4f} | {r['ratio']:.3f}{mark} | {first} |")
    ratios = [r["ratio"] for r in report["rows"]]
    lines += ["", f"B / A over all rows: median {statistics.median(ratios):.3f}, range {min(ratios):.3f}-"
              f"{max(ratios):.3f}; {sum(r > report['flag'] for r in ratios)} rows over {report['flag']}."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree_a", help="the baseline source tree (a checkout of this repository)")
    ap.add_argument("tree_b", help="the tree under test")
    ap.add_argument("--quick", action="store_true", help="fewer widths, bag sizes and weightings")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--calls", type=int, default=24, help="core_vs_loop's calls per turn")
    ap.add_argument("--flag", type=float, default=1.10)
    ap.add_argument("--tag", default=None, help="results name: core_sweep_<tag> (default: the machine)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        timer = os.path.join(work, "core_vs_loop")
        subprocess.run(["g++", "-std=c++17", "-O2", f"-I{ROOT}", os.path.join(ROOT, "bench", "native",
                                                                               "core_vs_loop.cc"),
                        "-o", timer, "-ldl", "-lpthread"], check=True)
        libs = {"a": build(args.tree_a, work, "a"), "b": build(args.tree_b, work, "b")}
        rows = sweep(args, timer, libs)
    describe = {}
    for side, tree in (("a", args.tree_a), ("b", args.tree_b)):
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", tree, "diff", "--quiet"]).returncode != 0
        describe[side] = f"{os.path.abspath(tree)} at {rev.stdout.strip() or '?'}{' (modified)' if dirty else ''}"
    report = {"date": utc_date(), "machine": machine_name(), "a": describe["a"], "b": describe["b"],
              "turns": args.turns, "calls": args.calls, "flag": args.flag, "rows": rows}
    tag = args.tag or machine_name().split(" (")[0].replace(" ", "_").replace("(R)", "").lower()
    paths = write_results(f"core_sweep_{tag}", report, markdown(report), out_dir=args.out)
    print(markdown(report))
    print(paths["md"])


if __name__ == "__main__":
    main()
