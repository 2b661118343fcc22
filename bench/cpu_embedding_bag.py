"""CPU EmbeddingBag benchmark: the fused op against its peers, side by side.

Each (system, shape, mode) runs in a fresh subprocess so that its peak memory
is its own: the child starts the framework's runtime on a tiny problem, builds
its inputs (and traces its tf.function), resets the kernel's peak-RSS counter,
runs once (measuring how much the process grows), then times `--repeats` runs
and reports the median. Systems:

  fused      pkm_serve.ops.embedding_bag (this project), tf.function
  composite  TF gather * w -> reduce_sum, tf.function
  sparse     tf.nn.embedding_lookup_sparse(sp_ids, sp_weights, combiner="sum")
  torch      torch.nn.functional.embedding_bag(mode="sum", per_sample_weights=...)

fwd+bwd computes the gradients of params (dense) and of the weights.
Results: bench/results/cpu_embedding_bag.{json,md}.

    python bench/cpu_embedding_bag.py            # full run (a few minutes)
    python bench/cpu_embedding_bag.py --quick    # small shapes, smoke test
    python bench/cpu_embedding_bag.py --roofline # forward GB/s vs the streaming read (cpu_roofline.py)
    python bench/cpu_embedding_bag.py --roofline-key  # its main shape, three times over
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import harness  # noqa: E402
from pkm_serve._memory import peak_rss_growth  # noqa: E402
RESULTS = harness.RESULTS_DIR

SHAPES = [  # (B, K, D, N, dtype): the PKM-like shape scaled to 2 cores
    (2048, 128, 512, 65536, "float32"),
    (2048, 128, 512, 65536, "bfloat16"),
    (4096, 128, 512, 65536, "float32"),  # the memory comparison shape
]
QUICK_SHAPES = [(256, 32, 64, 4096, "float32"), (256, 32, 64, 4096, "bfloat16")]
SYSTEMS = ["fused", "composite", "sparse", "torch"]


# ---- child: one measurement -------------------------------------------------

def child(system: str, b: int, k: int, d: int, n: int, dtype: str, mode: str, repeats: int) -> dict:
    import numpy as np

    def inputs(b, k, d, n):
        rng = np.random.default_rng(0)
        return (rng.integers(0, n, size=(b, k), dtype=np.int64), rng.uniform(0.0, 1.0, size=(b, k)).astype(np.float32),
                rng.standard_normal((n, d), dtype=np.float32), rng.standard_normal((b, d), dtype=np.float32))

    # Start the framework's runtime (thread pools, kernel caches) on a tiny
    # problem first, so the measured call's growth is the op's own memory.
    build_run(system, dtype, mode, *inputs(8, 4, d, 16))()
    run = build_run(system, dtype, mode, *inputs(b, k, d, n))
    # Peak memory of the first call (nothing cached from an earlier one).
    memory = {}
    with peak_rss_growth(memory, "growth"):
        res = run()
    peak_growth = memory["growth"]
    del res
    timing = harness.time_calls(run, repeats, warmup=1)
    return {"median_ms": timing["median_ms"], "min_ms": timing["min_ms"], "peak_growth_bytes": peak_growth}


def build_run(system, dtype, mode, idx_np, w_np, table_np, grad_np):
    if system == "torch":
        import torch

        torch.set_num_threads(os.cpu_count() or 2)
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        table = torch.from_numpy(table_np).to(tdt).requires_grad_(mode == "fwd+bwd")
        idx = torch.from_numpy(idx_np)
        w = torch.from_numpy(w_np).to(tdt).requires_grad_(mode == "fwd+bwd")
        grad = torch.from_numpy(grad_np).to(tdt)

        def run():
            out = torch.nn.functional.embedding_bag(idx, table, mode="sum", per_sample_weights=w)
            if mode == "fwd+bwd":
                table.grad = None
                w.grad = None
                out.backward(grad)
                return out, table.grad, w.grad
            return out
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        import tensorflow as tf

        from pkm_serve import ops

        tdt = {"float32": tf.float32, "bfloat16": tf.bfloat16}[dtype]
        table = tf.Variable(tf.cast(table_np, tdt))
        idx = tf.constant(idx_np)
        w = tf.cast(tf.constant(w_np), tdt)
        grad = tf.cast(tf.constant(grad_np), tdt)
        if system == "sparse":
            sp_ids = tf.sparse.from_dense(idx + 1)  # no zeros so from_dense keeps every entry
            sp_ids = tf.SparseTensor(sp_ids.indices, sp_ids.values - 1, sp_ids.dense_shape)
            sp_w = tf.SparseTensor(sp_ids.indices, tf.reshape(w, [-1]), sp_ids.dense_shape)

            def forward():
                return tf.nn.embedding_lookup_sparse(table, sp_ids, sp_w, combiner="sum")
        elif system == "fused":
            def forward():
                return ops.embedding_bag(table, idx, w)
        else:
            def forward():
                rows = tf.gather(table, idx)
                return tf.reduce_sum(rows * w[..., None], axis=-2)

        @tf.function
        def run_fn():
            if mode == "fwd":
                return forward()
            with tf.GradientTape() as tape:
                tape.watch(w)
                out = forward()
            d_table, d_w = tape.gradient(out, [table, w], output_gradients=grad)
            if isinstance(d_table, tf.IndexedSlices):  # what an optimizer would densify
                d_table = tf.convert_to_tensor(d_table)
            return out, d_table, d_w  # training needs the output too: keep it in the graph

        run_fn.get_concrete_function()  # trace now: graph building is not the op's memory

        def run():
            res = run_fn()
            tf.nest.map_structure(lambda t: t.numpy() if t.shape.num_elements() < 10 else t[0].numpy(), res)
            return res

    return run


def interleaved(b, k, d, n, dtype, mode, rounds):
    """Ours and torch in one process, called alternately (harness.interleaved):
    host noise (other tenants' memory traffic) hits both alike, so the
    per-round ratio is the fairest speed comparison this machine allows."""
    import numpy as np

    rng = np.random.default_rng(0)
    args = (rng.integers(0, n, size=(b, k), dtype=np.int64), rng.uniform(0.0, 1.0, size=(b, k)).astype(np.float32),
            rng.standard_normal((n, d), dtype=np.float32), rng.standard_normal((b, d), dtype=np.float32))
    systems = {"torch": build_run("torch", dtype, mode, *args), "fused": build_run("fused", dtype, mode, *args)}
    res = harness.interleaved(systems, rounds=rounds, warmup=1, baseline="torch")
    ratio = res["ratios"]["fused/torch"]
    return {"fused_median_ms": res["systems"]["fused"]["median_ms"],
            "torch_median_ms": res["systems"]["torch"]["median_ms"],
            "ratio_median": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"],
            "rounds": res["rounds"]}


# ---- parent: orchestrate, compare, write ---------------------------------------

def run_child(system, shape, mode, repeats):
    b, k, d, n, dtype = shape
    return harness.run_child(__file__, ["--child", system, b, k, d, n, dtype, mode, repeats])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    ap.add_argument("--interleaved-child", nargs=7, help=argparse.SUPPRESS)
    ap.add_argument("--roofline", action="store_true",
                    help="forward vs a 2-thread streaming read and torch, in one process (bench/cpu_roofline.py)")
    ap.add_argument("--roofline-key", action="store_true",
                    help="the roofline's main shape only, three interleaved comparisons (cpu_roofline.py)")
    args = ap.parse_args(argv)
    if args.roofline_key:
        import cpu_roofline

        cpu_roofline.key_shape_repeats()
        return 0
    if args.roofline:
        import cpu_roofline

        cpu_roofline.main()
        return 0
    if args.child:
        system, b, k, d, n, dtype, mode, repeats = args.child
        print(json.dumps(child(system, int(b), int(k), int(d), int(n), dtype, mode, int(repeats))))
        return 0
    if args.interleaved_child:
        b, k, d, n, dtype, mode, rounds = args.interleaved_child
        print(json.dumps(interleaved(int(b), int(k), int(d), int(n), dtype, mode, int(rounds))))
        return 0

    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows = []
    for shape in shapes:
        for mode in ("fwd", "fwd+bwd"):
            for system in SYSTEMS:
                if system == "sparse" and mode == "fwd+bwd":
                    continue  # the composite already covers TF's autodiff path
                r = run_child(system, shape, mode, args.repeats)
                b, k, d, n, dtype = shape
                r.update(system=system, mode=mode, B=b, K=k, D=d, N=n, dtype=dtype)
                elem = 4 if dtype == "float32" else 2
                if "median_ms" in r:
                    r["gathered_GBps"] = b * k * d * elem / (r["median_ms"] / 1e3) / 1e9
                rows.append(r)
                status = (f"{r['median_ms']:8.1f} ms  peak +{r['peak_growth_bytes'] / 2**20:7.0f} MiB"
                          if "median_ms" in r else f"error: {r['error']}")
                print(f"{str(shape):36s} {mode:8s} {system:10s} {status}", flush=True)

    inter = []
    for shape in shapes[:2]:
        for mode in ("fwd", "fwd+bwd"):
            b, k, d, n, dtype = shape
            # torch's OpenMP workers spin after each call by default and would
            # steal the cores from the next (our) call in the same process.
            r = harness.run_child(__file__, ["--interleaved-child", b, k, d, n, dtype, mode, 4 * args.repeats],
                                  env={"OMP_WAIT_POLICY": "PASSIVE"})
            r.update(mode=mode, B=b, K=k, D=d, N=n, dtype=dtype)
            inter.append(r)
            print(f"interleaved {shape} {mode}: {r}", flush=True)

    name = "cpu_embedding_bag_quick" if args.quick else "cpu_embedding_bag"
    report = {"machine": harness.machine_info(), "date": harness.utc_date(), "repeats": args.repeats,
              "rows": rows, "interleaved": inter, "note": harness.SHARED_NOTE}
    md = render_markdown(report)
    harness.write_results(name, report, md, out_dir=args.out)
    print("\n" + md)
    return 0


def render_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# CPU EmbeddingBag benchmark ({report['date']})", "",
             f"Machine: {harness.machine_name(m)} ({', '.join(m['isa'])}); {report.get('note', '')}; "
             f"median of {report['repeats']} runs, all systems with {m['cores']} threads; "
             "peak = growth of the process's peak RSS during the first call.", ""]
    by_key = {}
    for r in report["rows"]:
        by_key.setdefault((r["B"], r["K"], r["D"], r["N"], r["dtype"], r["mode"]), {})[r["system"]] = r
    lines += ["| shape B,K,D,N | dtype | mode | system | ms | gathered GB/s | peak growth | fused speed-up |",
              "|---|---|---|---|---|---|---|---|"]
    for (b, k, d, n, dtype, mode), systems in by_key.items():
        fused = systems.get("fused", {}).get("median_ms")
        for name, r in systems.items():
            if "median_ms" not in r:
                lines.append(f"| {b},{k},{d},{n} | {dtype} | {mode} | {name} | {r['error']} | | | |")
                continue
            ratio = f"{r['median_ms'] / fused:.2f}x" if fused and name != "fused" else ""
            lines.append(f"| {b},{k},{d},{n} | {dtype} | {mode} | {name} | {r['median_ms']:.1f} | "
                         f"{r['gathered_GBps']:.1f} | {r['peak_growth_bytes'] / 2**20:.0f} MiB | {ratio} |")
    lines += ["", "Fused vs torch called alternately in one process (per-round time ratio fused / torch; "
              "< 1 means ours is faster; OMP_WAIT_POLICY=PASSIVE so torch's idle OpenMP workers do not "
              "spin on the cores our next call needs):", "",
              "| shape B,K,D,N | dtype | mode | rounds | fused ms | torch ms | ratio median (min-max) |",
              "|---|---|---|---|---|---|---|"]
    for r in report.get("interleaved", []):
        if "error" in r:
            lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {r['mode']} | {r['error']} | | | |")
            continue
        lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {r['mode']} | {r['rounds']} | "
                     f"{r['fused_median_ms']:.1f} | {r['torch_median_ms']:.1f} | "
                     f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
