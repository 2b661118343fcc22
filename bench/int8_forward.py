"""int8 vs fp32 EmbeddingBag forward at serving batch on CPU, interleaved in one process.

fp32: pkm_serve.ops.embedding_bag on a float32 table; int8: pkm_serve.quantized.embedding_bag
(PkmQuantizedEmbeddingBag) on the same table quantised row-wise (a quarter of the bytes + 8 per
row). Both through TF eager, as a served signature runs them. Rows are drawn uniformly from a
512 MB (fp32) table, so the lookups miss the caches as a big served table does. Each repetition
times one call of each, alternating which goes first; the ratio is of the medians.

    .venv/bin/python bench/int8_forward.py [--reps 30] [--out bench/results/int8_forward]
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

from pkm_serve import ops, quantized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = [  # (batch, bag size K, dim D, rows N): K 128 = 4 heads x top-32 of a PKM
    (1, 128, 512, 262144),
    (16, 128, 512, 262144),
    (64, 128, 512, 262144),
    (256, 128, 512, 262144),
    (64, 32, 1024, 131072),
    (64, 128, 512, 16384),   # 32 MB fp32 / 8 MB int8: the int8 table fits the 32 MB L3
    (64, 128, 512, 2048),    # both in cache: the kernels' arithmetic alone
]


def one_shape(b, k, d, n, reps, rng):
    table = rng.standard_normal((n, d), dtype=np.float32)
    q, scales, biases = quantized.quantize_rows(table)
    t32 = tf.constant(table)
    qt = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    del table, q
    runs = {"fp32": lambda i, w: ops.embedding_bag(t32, i, w),
            "int8": lambda i, w: quantized.embedding_bag(qt, i, w)}
    times = {name: [] for name in runs}
    for rep in range(reps + 3):
        idx = tf.constant(rng.integers(0, n, size=(b, k)).astype(np.int32))
        w = tf.constant(rng.uniform(0.1, 1, size=(b, k)).astype(np.float32))
        order = ["fp32", "int8"] if rep % 2 == 0 else ["int8", "fp32"]
        for name in order:
            t0 = time.perf_counter()
            runs[name](idx, w).numpy()
            if rep >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
    return {"batch": b, "K": k, "D": d, "N": n, "fp32_ms": med["fp32"], "int8_ms": med["int8"],
            "ratio": med["int8"] / med["fp32"], "fp32_table_MB": n * d * 4 / 2**20,
            "int8_table_MB": (n * d + 8 * n) / 2**20,
            "fp32_GBps_gathered": b * k * d * 4 / (med["fp32"] / 1e3) / 1e9}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--out", default="bench/results/int8_forward")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = [one_shape(*s, args.reps, rng) for s in SHAPES]
    meta = {"machine": f"{harness.machine_name()} ({harness.SHARED_NOTE})", "date": harness.utc_date(),
            "tf": tf.__version__, "reps": args.reps, "threads": "TF default (intra-op = cores)"}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["# int8 vs fp32 forward, CPU, serving batch", "",
             f"{meta['machine']}; TF {meta['tf']}; median of {args.reps} interleaved calls each "
             "(`bench/int8_forward.py`). Ratio = int8 / fp32 (goal <= 0.6).", "",
             "| B | K | D | N | fp32 table | fp32 ms | fp32 GB/s gathered | int8 ms | int8/fp32 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['K']} | {r['D']} | {r['N']} | {r['fp32_table_MB']:.0f} MB | "
                     f"{r['fp32_ms']:.3f} | {r['fp32_GBps_gathered']:.1f} | {r['int8_ms']:.3f} | {r['ratio']:.2f} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
