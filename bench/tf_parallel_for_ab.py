"""The TF CPU forward's ParallelFor, in one process: claimed blocks (the default for forwards of up
to ~1 ms of rows; kernels/tf/embedding_bag_common.h) against TF's own ParallelFor
(PKM_TF_PARALLEL_FOR=tf, read by the kernels at each call), the two taking turns call by call on
the same inputs. The backward uses TF's ParallelFor either way: fwd+bwd cases show the forward's
share.

Each case is a tf.function of CHAIN calls on different random indices, each taking the previous
one's output as an input (as bench/int8_forward.py's graph timing), timed as a whole and divided
by CHAIN; fwd+bwd cases take the gradient of the chain's last output with respect to the table
and the weights. Medians; ratio = claimed / TF's.

    .venv/bin/python bench/tf_parallel_for_ab.py [--reps 30] [--out bench/results/tf_parallel_for_ab]
"""
import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

from pkm_serve import ops, quantized

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import int8_forward  # noqa: E402  (its chained calls)

# (what, table dtype, B, K, D, N, chain length)
CASES = [
    ("forward", "float32", 1, 128, 512, 262144, 16),
    ("forward", "int8", 1, 128, 512, 262144, 16),
    ("forward", "float32", 16, 128, 512, 262144, 16),
    ("forward", "int8", 16, 128, 512, 262144, 16),
    ("forward", "float32", 64, 128, 512, 262144, 16),
    ("forward", "int8", 64, 128, 512, 262144, 16),
    ("forward", "float32", 64, 32, 1024, 131072, 16),
    ("forward", "int8", 64, 32, 1024, 131072, 16),
    ("forward", "float32", 256, 128, 512, 262144, 16),
    ("forward", "int8", 256, 128, 512, 262144, 16),
    ("forward", "float32", 2048, 128, 512, 65536, 4),   # issue 22's shape
    ("forward", "bfloat16", 2048, 128, 512, 65536, 4),
    ("fwd+bwd", "float32", 64, 128, 512, 65536, 8),
    ("fwd+bwd", "float32", 2048, 128, 512, 65536, 2),
]
MODES = {"claimed": None, "tf": "tf"}


def make_graph(what, dtype, b, d, n, chain, rng):
    table = rng.standard_normal((n, d), dtype=np.float32)
    if dtype == "int8":
        q, scales, biases = quantized.quantize_rows(table)
        qt = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
        del q
        run = lambda t, i, w: quantized.embedding_bag(qt, i, w)  # noqa: E731
        t = None
    else:
        t = tf.constant(table, dtype=getattr(tf, dtype))
        run = lambda t, i, w: ops.embedding_bag(t, i, tf.cast(w, t.dtype))  # noqa: E731
    del table

    def chained(t, idx, w):
        return int8_forward.chained(lambda i, ww: run(t, i, ww), idx, w, chain)

    if what == "forward":
        return tf.function(lambda idx, w: chained(t, idx, w))

    def fwd_bwd(idx, w):
        with tf.GradientTape() as tape:
            tape.watch([t, w])
            loss = tf.reduce_sum(chained(t, idx, w))
        d_t, d_w = tape.gradient(loss, [t, w])
        return tf.reduce_sum(tf.convert_to_tensor(d_t)[:1]) + tf.reduce_sum(d_w)

    return tf.function(fwd_bwd)


def one_case(what, dtype, b, k, d, n, chain, reps, rng):
    graph = make_graph(what, dtype, b, d, n, chain, rng)
    times = {m: [] for m in MODES}
    for rep in range(reps + 3):
        idx = tf.constant(rng.integers(0, n, size=(chain, b, k)).astype(np.int32))
        w = tf.constant(rng.uniform(0.1, 1, size=(chain, b, k)).astype(np.float32))
        for mode in (list(MODES) if rep % 2 == 0 else list(MODES)[::-1]):
            if MODES[mode] is None:
                os.environ.pop("PKM_TF_PARALLEL_FOR", None)
            else:
                os.environ["PKM_TF_PARALLEL_FOR"] = MODES[mode]
            t0 = time.perf_counter()
            graph(idx, w).numpy()
            if rep >= 3:  # warm-up (tracing)
                times[mode].append((time.perf_counter() - t0) / chain)
    os.environ.pop("PKM_TF_PARALLEL_FOR", None)
    med = {m: float(np.median(v)) * 1e3 for m, v in times.items()}
    return {"what": what, "dtype": dtype, "batch": b, "K": k, "D": d, "N": n, "chain": chain,
            "claimed_ms": med["claimed"], "tf_ms": med["tf"], "ratio": med["claimed"] / med["tf"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="bench/results/tf_parallel_for_ab")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = [one_case(*c, args.reps, rng) for c in CASES]
    meta = {"machine": f"{harness.machine_name()} ({harness.SHARED_NOTE})", "date": harness.utc_date(),
            "tf": tf.__version__, "reps": args.reps, "threads": "TF default (intra-op = cores)"}
    lines = ["# TF CPU forward: claimed blocks vs TF's ParallelFor", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['threads']}; medians of {args.reps} repetitions, "
             "the two taking turns call by call in one process (`bench/tf_parallel_for_ab.py`). ms per op "
             "call of a chained tf.function; ratio = claimed / TF's (< 1: claimed is faster).", "",
             "| case | table | B | K | D | N | claimed ms | TF ParallelFor ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['dtype']} | {r['batch']} | {r['K']} | {r['D']} | {r['N']} | "
                     f"{r['claimed_ms']:.3f} | {r['tf_ms']:.3f} | **{r['ratio']:.2f}** |")
    harness.write_results(os.path.basename(args.out), {"meta": meta, "rows": rows}, "\n".join(lines),
                          os.path.dirname(args.out) or ".")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
