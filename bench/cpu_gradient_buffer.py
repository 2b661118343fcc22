"""Forward+backward with the dense d_params buffer kept between calls (the default) and without it
(PKM_KEEP_GRADIENT_BUFFER=0), each against torch's F.embedding_bag forward+backward in the same
process, at the CPU roofline's main shape (B=2048 K=128 D=512 N=65536, float32, weighted sum, the
gradients of the table and the weights; issue #22's goal: fwd+bwd <= 0.3x torch).

The switch is read once per process, so each round starts one child per setting (in alternating
order); a child runs cpu_roofline.compare (calls of ours and torch alternating, 2 threads each) and
reports its medians and the median per-call ratio. Without the kept buffer, glibc maps each 128 MB
d_params afresh and the OS zero-fills its pages on first touch; torch's fresh `.grad` pays the same.

    python bench/cpu_gradient_buffer.py [--rounds 6]      (about 4 minutes)
Results: bench/results/cpu_gradient_buffer.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

SETTINGS = {"kept": "1", "fresh": "0"}  # PKM_KEEP_GRADIENT_BUFFER


def child(calls: int) -> None:
    import cpu_roofline

    cpu_roofline._frameworks_on_threads()
    b, k, d, n = cpu_roofline.MAIN
    inputs = cpu_roofline.make_inputs(b, k, d, n)
    row = cpu_roofline.compare({"ours": cpu_roofline.ours("float32", *inputs, backward=True),
                                "torch": cpu_roofline.torch_bag("float32", *inputs, True)},
                               calls, b * k * d * 4, stream=1.0)
    out = {key: row[key] for key in ("ours_median_ms", "ours_min_ms", "torch_median_ms", "torch_min_ms")}
    out["ratio ours/torch"] = round(1 / row["ratio torch/ours"], 3)  # compare's baseline is ours
    print(json.dumps(out))


def main(rounds: int, calls: int) -> dict:
    runs = {name: [] for name in SETTINGS}
    for r in range(rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            res = harness.run_child(__file__, ["--child", calls],
                                    env={"PKM_KEEP_GRADIENT_BUFFER": SETTINGS[name]})
            if "error" in res:
                raise SystemExit(f"{name}: {res['error']}")
            runs[name].append(res)
            print(name, json.dumps(res), flush=True)
    summary = {}
    for name, rows in runs.items():
        summary[name] = {"ours_ms": statistics.median(x["ours_median_ms"] for x in rows),
                         "torch_ms": statistics.median(x["torch_median_ms"] for x in rows),
                         "ours/torch": statistics.median(x["ratio ours/torch"] for x in rows),
                         "ours/torch range": [min(x["ratio ours/torch"] for x in rows),
                                              max(x["ratio ours/torch"] for x in rows)]}
    kept_over_fresh = [k["ours_median_ms"] / f["ours_median_ms"] for k, f in zip(runs["kept"], runs["fresh"])]
    report = {"machine": harness.machine_info(), "date": harness.utc_date(), "shape": [2048, 128, 512, 65536],
              "rounds": rounds, "calls_per_child": calls, "runs": runs, "summary": summary,
              "kept/fresh per round": [round(x, 3) for x in kept_over_fresh], "note": harness.SHARED_NOTE}
    lines = [f"# Forward+backward with the dense gradient's buffer kept or fresh ({report['date']})", "",
             f"Machine: {harness.machine_name(report['machine'])}; {harness.SHARED_NOTE}. B=2048 K=128 D=512 "
             f"N=65536 float32, weighted sum, d_params (dense) and d_weights; 2 threads. {rounds} rounds, each one "
             f"child process per setting (alternating order), each child {calls} alternating calls of ours and "
             "torch (medians).", "",
             "| d_params buffer | ours ms | torch ms | ours/torch (median of children) | range |",
             "|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['ours_ms']:.1f} | {s['torch_ms']:.1f} | **{s['ours/torch']:.3f}** | "
                     f"{s['ours/torch range'][0]:.3f}-{s['ours/torch range'][1]:.3f} |")
    lines += ["", f"Ours kept / ours fresh, per round (children of one round): "
              f"{', '.join(f'{x:.2f}' for x in kept_over_fresh)}; median "
              f"**{statistics.median(kept_over_fresh):.2f}**.", "",
              "Command: `python bench/cpu_gradient_buffer.py`."]
    harness.write_results("cpu_gradient_buffer", report, "\n".join(lines))
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
    else:
        main(args.rounds, args.calls)
