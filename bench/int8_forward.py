"""int8 vs fp32 EmbeddingBag forward at serving batch on CPU, interleaved in one process.

fp32: pkm_serve.ops.embedding_bag on a float32 table; int8: pkm_serve.quantized.embedding_bag
(PkmQuantizedEmbeddingBag) on the same table quantised row-wise (a quarter of the bytes + 8 per
row). Rows are drawn uniformly from a 512 MB (fp32) table, so the lookups miss the caches as a
big served table does. Two timings of each, alternating which goes first; ratios are of medians:
- eager: one eager call (Python wrapper + op dispatch + kernel + .numpy()), new indices per call;
- graph: the op as a served graph runs it: one tf.function holding CHAIN calls on different
  random indices, each taking the previous one's output as an input (its weights + 0 * one
  output value: control dependencies alone are dropped by grappler, which then prunes the
  unused calls), timed as a whole and divided by CHAIN, which spreads the function call's
  fixed cost;
- op: the bag op's own time inside such a graph, as TF's step stats record it (a v1 Session over
  the same CHAIN chained calls, run with FULL_TRACE: each bag node's op_end - op_start, i.e. its
  kernel's Compute, which returns after the intra-op threads' share is done). The graph's other
  ops (slicing each call's indices, the dependency's multiply and add) are left out: they are the
  same for both tables and are not the forward.

    .venv/bin/python bench/int8_forward.py [--reps 30] [--out bench/results/int8_forward]
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

SHAPES = [  # (batch, bag size K, dim D, rows N): K 128 = 4 heads x top-32 of a PKM
    (1, 128, 512, 262144),
    (16, 128, 512, 262144),
    (64, 128, 512, 262144),
    (256, 128, 512, 262144),
    (64, 32, 1024, 131072),
    (64, 128, 512, 16384),   # 32 MB fp32 / 8 MB int8: the int8 table fits the 32 MB L3
    (64, 128, 512, 2048),    # both in cache: the kernels' arithmetic alone
]


CHAIN = 16


def chained(run, idx, w, calls=CHAIN):
    """`calls` calls of run(idx[c], w[c]), each after the previous one (a data dependency), in one graph."""
    out = None
    for c in range(calls):
        wc = w[c] if out is None else w[c] + 0.0 * tf.cast(out[0, 0], w.dtype)
        out = run(idx[c], wc)
    return out


BAG_OPS = ("PkmEmbeddingBag", "PkmQuantizedEmbeddingBag")


def op_times(tables, b, k, n, reps, rng):
    """{name: [per-call ms]}: each bag node's Compute time (step stats) in a v1 graph of CHAIN chained
    calls per name, the names taking turns run by run. tables: numpy (fp32 table, int8 values,
    scales, biases), fed once into the graph's variables: as constants, grappler's passes copy their
    values (the process grew past 24 GB at the 512 MB table)."""
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        feeds = [tf1.placeholder(tf.as_dtype(t.dtype), t.shape) for t in tables]
        t32, values, scales, biases = (tf1.Variable(f, trainable=False) for f in feeds)
        idx = tf1.placeholder(tf.int32, (CHAIN, b, k))
        w = tf1.placeholder(tf.float32, (CHAIN, b, k))
        qt = quantized.QuantizedTable(values, scales, biases)
        outs = {"fp32": chained(lambda i, ww: ops.embedding_bag(t32, i, ww), idx, w),
                "int8": chained(lambda i, ww: quantized.embedding_bag(qt, i, ww), idx, w)}
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph)
    sess.run(init, dict(zip(feeds, tables)))
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    times = {name: [] for name in outs}
    for rep in range(reps + 3):
        feed = {idx: rng.integers(0, n, size=(CHAIN, b, k)).astype(np.int32),
                w: rng.uniform(0.1, 1, size=(CHAIN, b, k)).astype(np.float32)}
        for name in (list(outs) if rep % 2 == 0 else list(outs)[::-1]):
            meta = tf1.RunMetadata()
            sess.run(outs[name], feed, options=options, run_metadata=meta)
            calls = harness.op_compute_ms(meta, BAG_OPS)
            assert len(calls) == CHAIN, f"{name}: {len(calls)} bag nodes traced, expected {CHAIN}"
            if rep >= 3:  # warm-up
                times[name] += calls
    sess.close()
    return times


def one_shape(b, k, d, n, reps, rng):
    table = rng.standard_normal((n, d), dtype=np.float32)
    q, scales, biases = quantized.quantize_rows(table)
    t32 = tf.constant(table)
    qt = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    op_ms = op_times((table, q, scales, biases), b, k, n, reps, rng)
    del table, q
    runs = {"fp32": lambda i, w: ops.embedding_bag(t32, i, w),
            "int8": lambda i, w: quantized.embedding_bag(qt, i, w)}
    graphs = {name: tf.function(lambda i, w, run=run: chained(run, i, w)) for name, run in runs.items()}
    times = {name: [] for name in runs}
    graph_times = {name: [] for name in runs}
    for rep in range(reps + 3):
        idx = tf.constant(rng.integers(0, n, size=(CHAIN, b, k)).astype(np.int32))
        w = tf.constant(rng.uniform(0.1, 1, size=(CHAIN, b, k)).astype(np.float32))
        order = ["fp32", "int8"] if rep % 2 == 0 else ["int8", "fp32"]
        for name in order:
            t0 = time.perf_counter()
            graphs[name](idx, w).numpy()
            if rep >= 3:  # warm-up (tracing)
                graph_times[name].append((time.perf_counter() - t0) / CHAIN)
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
    gmed = {name: float(np.median(v)) * 1e3 for name, v in graph_times.items()}
    omed = {name: float(np.median(v)) for name, v in op_ms.items()}
    return {"op_fp32_ms": omed["fp32"], "op_int8_ms": omed["int8"], "op_ratio": omed["int8"] / omed["fp32"],
            "batch": b, "K": k, "D": d, "N": n, "fp32_ms": med["fp32"], "int8_ms": med["int8"],
            "ratio": med["int8"] / med["fp32"], "graph_fp32_ms": gmed["fp32"], "graph_int8_ms": gmed["int8"],
            "graph_ratio": gmed["int8"] / gmed["fp32"], "fp32_table_MB": n * d * 4 / 2**20,
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
    lines = ["# int8 vs fp32 forward, CPU, serving batch", "",
             f"{meta['machine']}; TF {meta['tf']}; medians of {args.reps} interleaved repetitions "
             f"(`bench/int8_forward.py`). Ratio = int8 / fp32 (goal <= 0.6). graph: per call of {CHAIN} "
             "chained calls in one tf.function (as a served graph runs the op), with the graph's other ops; "
             "op: the bag op's Compute alone in such a graph (TF step stats, FULL_TRACE, v1 Session); eager: "
             "one eager call with its Python wrapper and dispatch.", "",
             "| B | K | D | N | fp32 table | op fp32 ms | op int8 ms | op int8/fp32 | graph fp32 ms | graph int8 ms "
             "| graph int8/fp32 | eager fp32 ms | eager int8 ms | eager int8/fp32 | fp32 GB/s gathered (op) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gbps = r["batch"] * r["K"] * r["D"] * 4 / (r["op_fp32_ms"] / 1e3) / 1e9
        lines.append(f"| {r['batch']} | {r['K']} | {r['D']} | {r['N']} | {r['fp32_table_MB']:.0f} MB | "
                     f"{r['op_fp32_ms']:.3f} | {r['op_int8_ms']:.3f} | **{r['op_ratio']:.2f}** | "
                     f"{r['graph_fp32_ms']:.3f} | {r['graph_int8_ms']:.3f} | {r['graph_ratio']:.2f} | "
                     f"{r['fp32_ms']:.3f} | {r['int8_ms']:.3f} | {r['ratio']:.2f} | {gbps:.1f} |")
    harness.write_results(os.path.basename(args.out), {"meta": meta, "rows": rows}, "\n".join(lines),
                          os.path.dirname(args.out) or ".")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
