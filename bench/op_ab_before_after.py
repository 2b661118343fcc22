"""A/B of the op's CPU forward and backward before and after a change: two
builds of the C ABI library (libpkm_capi_cpu.so: the core's fast Forward /
Backward, serial, behind the same descriptor checks every runtime shares)
loaded side by side in one process and called alternately (bench/harness.py).

    python bench/op_ab_before_after.py BEFORE.so AFTER.so [--name op_ab_struct]

Results: bench/results/<name>.{json,md}. Ratio = after / before per round.
"""
import argparse
import ctypes
import os
import sys

import numpy as np

from harness import ROOT, interleaved, machine_info, machine_name, utc_date, write_results

sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
from pkm_capi import PkmBags  # noqa: E402

SHAPES = [(1024, 32, 128, 65536), (256, 128, 512, 65536)]  # B, K, D, N


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))  # RTLD_LOCAL: two builds coexist
    vp, err = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_size_t]
    lib.pkm_cpu_forward.argtypes = [ctypes.POINTER(PkmBags), vp, ctypes.c_int] + err
    lib.pkm_cpu_backward.argtypes = [ctypes.POINTER(PkmBags), vp, vp, vp, ctypes.c_int] + err
    return lib


def problem(b, k, d, n):
    rng = np.random.default_rng(0)
    arrays = {"table": rng.standard_normal((n, d), dtype=np.float32),
              "idx": rng.integers(0, n, (b, k)).astype(np.int64),
              "w": rng.uniform(0, 1, (b, k)).astype(np.float32),
              "grad": rng.standard_normal((b, d), dtype=np.float32),
              "out": np.empty((b, d), np.float32), "d_table": np.empty((n, d), np.float32),
              "d_w": np.empty((b, k), np.float32)}
    bags = PkmBags(table=arrays["table"].ctypes.data, num_rows=n, dim=d, indices=arrays["idx"].ctypes.data,
                   indices_int64=1, num_bags=b, bag_size=k, weights=arrays["w"].ctypes.data)
    return bags, arrays


def calls(lib, bags, a):
    err = ctypes.create_string_buffer(256)

    def forward():
        if lib.pkm_cpu_forward(ctypes.byref(bags), a["out"].ctypes.data, 0, err, len(err)) != 0:
            raise RuntimeError(err.value.decode())

    def backward():
        if lib.pkm_cpu_backward(ctypes.byref(bags), a["grad"].ctypes.data, a["d_table"].ctypes.data,
                                a["d_w"].ctypes.data, 0, err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
    return forward, backward


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--name", default="op_ab_before_after")
    args = ap.parse_args()
    before, after = load(args.before), load(args.after)
    rows = []
    for shape in SHAPES:
        bags, arrays = problem(*shape)
        fb, bb = calls(before, bags, arrays)
        fa, ba = calls(after, bags, arrays)
        for mode, (old, new) in (("forward", (fb, fa)), ("backward", (bb, ba))):
            res = interleaved({"before": old, "after": new}, args.rounds, warmup=2)
            r = res["ratios"]["after/before"]
            rows.append({"B": shape[0], "K": shape[1], "D": shape[2], "N": shape[3], "mode": mode,
                         "before_median_ms": res["systems"]["before"]["median_ms"],
                         "after_median_ms": res["systems"]["after"]["median_ms"],
                         "before_min_ms": res["systems"]["before"]["min_ms"],
                         "after_min_ms": res["systems"]["after"]["min_ms"],
                         "ratio_median": r["median"], "ratio_min": r["min"], "ratio_max": r["max"]})
            print(rows[-1], flush=True)
    info = machine_info()
    report = {"date": utc_date(), "machine": info, "rounds": args.rounds, "rows": rows,
              "before": os.path.basename(args.before), "after": os.path.basename(args.after)}
    lines = [f"# Op A/B before/after ({report['date']})", "",
             f"Machine: {machine_name(info)}, shared with other engineers' builds and tests (noisy: read the "
             f"ratios). C ABI fast CPU path (serial), float32, int64 indices, weights; {args.rounds} "
             "interleaved rounds (order rotating). Ratio = after / before per round.", "",
             "| B | K | D | N | mode | before median ms | after median ms | ratio median (min-max) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['K']} | {r['D']} | {r['N']} | {r['mode']} | {r['before_median_ms']:.2f} | "
                     f"{r['after_median_ms']:.2f} | {r['ratio_median']:.3f} ({r['ratio_min']:.2f}-"
                     f"{r['ratio_max']:.2f}) |")
    lines += ["", f"Command: `.venv/bin/python bench/op_ab_before_after.py {args.before} {args.after}`"]
    write_results(args.name, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
