"""In-process A/B of the TF bag op's own time under environment variables the op library reads
at each call (bench only). For a build that switches a code path on a variable (e.g.
PKM_TF_PARALLEL_FOR=tf, or a temporary switch added for an experiment), the variants take turns
session run by session run in one process, so the machine's drift between processes (large on a
shared VM) does not land on one variant.

Each (shape, dtype) is bench/cpu_roofline.py's op-alone session (op_alone_session: 8 chained calls
in a v1 Session on THREADS intra-op threads, traced with FULL_TRACE); each variant's figure is the median
Compute time of its bag nodes over ROUNDS runs (after 2 warm-up rounds), and its ratio to the
first variant's.

    .venv/bin/python bench/tf_op_env_ab.py "VARIANT;VARIANT..." "B K D N[,B K D N...]" DTYPE[,DTYPE]
      VARIANT: comma-separated NAME=VALUE settings, empty for none; each run unsets every NAME
      any variant sets, then applies its own.
    environment: THREADS (default 2), ROUNDS (default 16)
Example: bench/tf_op_env_ab.py ";PKM_TF_PARALLEL_FOR=tf" "2048 8 512 65536" float32,bfloat16
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    import numpy as np

    import cpu_roofline

    threads = int(os.environ.get("THREADS", "2"))
    rounds = int(os.environ.get("ROUNDS", "16"))
    names = argv[1].split(";")
    variants = [dict(item.split("=", 1) for item in v.split(",") if item) for v in names]
    keys = {k for v in variants for k in v}
    shapes = [tuple(int(x) for x in s.split()) for s in argv[2].split(",")]
    for b, k, d, n in shapes:
        idx_np, w_np, table_np, _ = cpu_roofline.make_inputs(b, k, d, n)
        for dtype in argv[3].split(","):
            times = [[] for _ in variants]
            with cpu_roofline.op_alone_session(dtype, idx_np, w_np, table_np, threads) as run:
                for r in range(rounds + 2):
                    for vi, v in enumerate(variants):
                        for key in keys:
                            os.environ.pop(key, None)
                        os.environ.update(v)
                        calls = run()
                        if r >= 2:
                            times[vi] += calls
            for key in keys:
                os.environ.pop(key, None)
            base = float(np.median(times[0]))
            cells = [f"[{names[vi] or 'none'}] {np.median(t):.3f} ms ({np.median(t) / base:.2f})"
                     for vi, t in enumerate(times)]
            print(f"B={b} K={k} D={d} N={n} {dtype}, {threads} threads: " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
