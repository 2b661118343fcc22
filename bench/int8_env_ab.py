"""In-process A/B of the int8 and float32 bag ops' own times under environment variables the op
library reads at each call (bench only), at bench/int8_forward.py's shapes and with its op timing:
one v1 Session holding CHAIN chained calls per table, run with FULL_TRACE, each bag node's Compute
time from TF's step stats. Variants and tables take turns run by run (the order reversed every
other round), so the machine's drift between processes does not land on one variant.

    .venv/bin/python bench/int8_env_ab.py "VARIANT;VARIANT..." "B K D N[,B K D N...]" [ROUNDS]
      VARIANT: comma-separated NAME=VALUE settings, empty for none; each run unsets every NAME
      any variant sets, then applies its own.
    environment: THREADS (intra-op threads, default 2)
Example: bench/int8_env_ab.py "PKM_FORWARD_LINGER_US=0;" "64 128 512 16384,16 128 512 262144" 24
"""
import os
import sys

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402
import int8_forward  # noqa: E402

from pkm_serve import ops, quantized  # noqa: E402


def ab_one_shape(variants, b, k, d, n, rounds, threads):
    """{(variant index, "fp32" | "int8"): median ms of the bag nodes' Compute}."""
    tf1 = tf.compat.v1
    rng = np.random.default_rng(0)
    table = rng.standard_normal((n, d), dtype=np.float32)
    arrays = (table, *quantized.quantize_rows(table))
    graph = tf.Graph()
    with graph.as_default():
        feeds = [tf1.placeholder(tf.as_dtype(a.dtype), a.shape) for a in arrays]
        t32, values, scales, biases = (tf1.Variable(f, trainable=False) for f in feeds)
        idx = tf1.placeholder(tf.int32, (int8_forward.CHAIN, b, k))
        w = tf1.placeholder(tf.float32, (int8_forward.CHAIN, b, k))
        qt = quantized.QuantizedTable(values, scales, biases)
        outs = {"fp32": int8_forward.chained(lambda i, ww: ops.embedding_bag(t32, i, ww), idx, w),
                "int8": int8_forward.chained(lambda i, ww: quantized.embedding_bag(qt, i, ww), idx, w)}
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=2)
    keys = {key for v in variants for key in v}
    times = {(vi, name): [] for vi in range(len(variants)) for name in outs}
    with tf1.Session(graph=graph, config=config) as sess:
        sess.run(init, dict(zip(feeds, arrays)))
        options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
        for r in range(rounds + 2):
            feed = {idx: rng.integers(0, n, size=(int8_forward.CHAIN, b, k)).astype(np.int32),
                    w: rng.uniform(0.1, 1, size=(int8_forward.CHAIN, b, k)).astype(np.float32)}
            order = list(times)
            for vi, name in order if r % 2 == 0 else order[::-1]:
                for key in keys:
                    os.environ.pop(key, None)
                os.environ.update(variants[vi])
                meta = tf1.RunMetadata()
                sess.run(outs[name], feed, options=options, run_metadata=meta)
                if r >= 2:  # warm-up
                    times[(vi, name)] += harness.op_compute_ms(meta, int8_forward.BAG_OPS)
    for key in keys:
        os.environ.pop(key, None)
    return {key: float(np.median(v)) for key, v in times.items()}


def main(argv) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    names = argv[1].split(";")
    variants = [dict(item.split("=", 1) for item in v.split(",") if item) for v in names]
    shapes = [tuple(int(x) for x in s.split()) for s in argv[2].split(",")]
    rounds = int(argv[3]) if len(argv) == 4 else 24
    threads = int(os.environ.get("THREADS", "2"))
    for b, k, d, n in shapes:
        med = ab_one_shape(variants, b, k, d, n, rounds, threads)
        cells = [f"[{names[vi] or 'none'}] fp32 {med[(vi, 'fp32')]:.3f} ms, int8 {med[(vi, 'int8')]:.3f} ms, "
                 f"int8/fp32 {med[(vi, 'int8')] / med[(vi, 'fp32')]:.3f}; vs first: fp32 "
                 f"{med[(vi, 'fp32')] / med[(0, 'fp32')]:.2f}, int8 {med[(vi, 'int8')] / med[(0, 'int8')]:.2f}"
                 for vi in range(len(variants))]
        print(f"B={b} K={k} D={d} N={n}, {threads} threads, {rounds} rounds:\n  " + "\n  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
