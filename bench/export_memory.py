"""How much a served model grows per request, composite vs fused by `pkm-serve export`.

Two models, each with one composite site:
  weighted  tf.gather(table, idx) * w[..., None] -> reduce_sum(axis=1)
  masked    a Keras text model: Embedding(mask_zero=True) -> GlobalAveragePooling1D
            (the masked mean: tf.where(mask, rows, 0) summed, divided by the mask sum)
Each is exported, then each version is served in its own process: load, warm
up on a tiny batch, reset the peak-RSS counter, run B=4096 K=128 D=512
requests, and record peak RSS growth and latency. Writes
bench/results/export_memory.{json,md}.

    .venv/bin/python bench/export_memory.py [--batch 4096 --bag 128 --dim 512 --rows 65536]
        [--models weighted,masked,tf_keras_masked,keras_rs] [--machine "2-core ... VM"]
        [--name export_memory]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from harness import HERE, RESULTS_DIR as RESULTS, ROOT, machine_info, machine_name, run_child, write_results

SERVE_CHILD = r"""
import json, os, resource, sys
import numpy as np, tensorflow as tf
from harness import time_calls
lib, model_dir, kind, batch, bag, rows, repeats = sys.argv[1:]
batch, bag, rows, repeats = int(batch), int(bag), int(rows), int(repeats)

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def inputs(rng, n):
    if kind in ("weighted", "keras_rs"):
        return {"idx": rng.integers(0, rows, (n, bag)).astype(np.int32),
                "w": rng.uniform(size=(n, bag)).astype(np.float32)}
    # Text: 1..bag real ids per row, then 0 padding (the mask).
    ids = rng.integers(1, rows, (n, bag)).astype(np.int32)
    lengths = rng.integers(1, bag + 1, n)
    ids[np.arange(bag)[None, :] >= lengths[:, None]] = 0
    return {"ids": ids}

tf.load_op_library(lib)
fn = tf.saved_model.load(model_dir).signatures["serving_default"]
rng = np.random.default_rng(0)
first = lambda out: next(iter(out.values())).numpy()
first(fn(**inputs(rng, 8)))
x = {k: tf.constant(v) for k, v in inputs(rng, batch).items()}
rss_before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (peak RSS) to now
    f.write("5")
last = [None]  # only the latest output stays alive, as the peak RSS should see it
timing = time_calls(lambda: last.__setitem__(0, first(fn(**x))), repeats, warmup=0)
out = last[0]
peak = status("VmHWM")
print(json.dumps({"rss_before": rss_before, "peak_rss": peak,
                  "growth": peak - rss_before, "ms": timing["times_ms"],
                  "checksum": float(np.abs(out).sum())}))
"""

MODELS = {
    "weighted": "tf.gather(table, idx) * w[..., None] -> reduce_sum(axis=1)",
    "masked": "Keras Embedding(mask_zero=True) -> GlobalAveragePooling1D (masked mean)",
    "tf_keras_masked": "tf_keras Embedding(mask_zero=True) -> GlobalAveragePooling1D "
                       "(masked mean; tf.saved_model.save)",
    "keras_rs": "keras-rs EmbedReduce(combiner='mean') with weights (weighted mean)",
}


def build_model(path: str, kind: str, rows: int, bag: int, dim: int) -> None:
    import numpy as np
    import tensorflow as tf

    table = np.random.default_rng(1).normal(size=(rows, dim)).astype(np.float32)
    if kind == "tf_keras_masked":
        import tf_keras
        emb = tf_keras.layers.Embedding(rows, dim, mask_zero=True)
        model = tf_keras.Sequential([tf_keras.Input((bag,), dtype="int32", name="ids"), emb,
                                     tf_keras.layers.GlobalAveragePooling1D()])
        emb.embeddings.assign(table)
        tf.saved_model.save(model, path)
        return
    if kind == "keras_rs":
        import keras
        import keras_rs
        idx = keras.Input(shape=(bag,), dtype="int32", name="idx")
        w = keras.Input(shape=(bag,), dtype="float32", name="w")
        layer = keras_rs.layers.EmbedReduce(rows, dim, combiner="mean")
        model = keras.Model([idx, w], layer(idx, w))
        layer.embeddings.assign(table)
        model.export(path, format="tf_saved_model", verbose=False)
        return
    if kind == "masked":
        import keras
        ids = keras.Input(shape=(bag,), dtype="int32", name="ids")
        emb = keras.layers.Embedding(rows, dim, mask_zero=True)
        model = keras.Model(ids, keras.layers.GlobalAveragePooling1D()(emb(ids)))
        emb.embeddings.assign(table)
        model.export(path, format="tf_saved_model", verbose=False)
        return
    # The composite weighted sum, written as the export tests write it.
    sys.path.insert(0, os.path.join(ROOT, "tests", "export"))
    from export_models import save_bag_module
    save_bag_module(path, table, lambda t, idx, w: tf.reduce_sum(
        tf.gather(t, idx) * w[..., None], axis=1), k=bag)


def serve_once(lib: str, model_dir: str, kind: str, args) -> dict:
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": HERE}
    # "-c" as the script: the child is the program text above, in a fresh process.
    res = run_child("-c", [SERVE_CHILD, lib, model_dir, kind, args.batch, args.bag, args.rows, args.repeats],
                    env=env)
    if "error" in res:
        raise RuntimeError(f"serving {model_dir} failed: {res['error']}")
    return res


def bench_model(kind: str, lib: str, tmp: str, args) -> dict:
    from pkm_serve.export import export_saved_model

    src = os.path.join(tmp, kind)
    build_model(src, kind, args.rows, args.bag, args.dim)
    t0 = time.perf_counter()
    result = export_saved_model(src, os.path.join(tmp, kind + "_fused"),
                                batch_size=args.batch, quiet=True)
    export_s = time.perf_counter() - t0
    runs = {"composite": serve_once(lib, src, kind, args),
            "fused": serve_once(lib, result.dst, kind, args)}
    same = abs(runs["composite"]["checksum"] - runs["fused"]["checksum"]) <= \
        1e-4 * runs["composite"]["checksum"]
    median = {k: sorted(r["ms"])[len(r["ms"]) // 2] for k, r in runs.items()}
    return {
        "form": MODELS[kind], "export_seconds": round(export_s, 2),
        "sites_fused": len(result.fused),
        "reported_saved_bytes_at_batch": result.to_json()["saved_bytes_at_batch"],
        "runs": runs, "median_ms": median,
        "growth_ratio_composite_over_fused": runs["composite"]["growth"] /
        max(runs["fused"]["growth"], 1),
        "latency_ratio_composite_over_fused": median["composite"] / median["fused"],
        "outputs_match_checksum": bool(same)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--bag", type=int, default=128)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="weighted,masked")
    p.add_argument("--machine", default=machine_name(),
                   help="machine description written into the results")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--name", default="export_memory", help="results file stem")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    from pkm_serve import ops

    kinds = [k for k in args.models.split(",") if k]
    unknown = [k for k in kinds if k not in MODELS]
    if unknown:
        p.error(f"unknown --models {unknown}; choose from {sorted(MODELS)}")
    lib = ops.library_path()
    with tempfile.TemporaryDirectory(prefix="pkm-export-bench-") as tmp:
        models = {kind: bench_model(kind, lib, tmp, args) for kind in kinds}
    gathered = args.batch * args.bag * args.dim * 4
    report = {
        "shape": {"batch": args.batch, "bag": args.bag, "dim": args.dim, "rows": args.rows,
                  "dtype": "float32"},
        "machine": {"description": args.machine, **machine_info()},
        "gathered_bytes": gathered, "models": models,
    }
    if "weighted" in models:  # the layout bench/report.py reads
        report["runs"] = models["weighted"]["runs"]
    mib = 2 ** 20
    lines = [
        "# Serving memory: composite SavedModel vs `pkm-serve export` output",
        "",
        f"Machine: {args.machine}. B={args.batch} K={args.bag} D={args.dim} N={args.rows} "
        f"float32; {args.repeats} requests per process after a warm-up; peak RSS growth "
        "measured from just before the first request (VmHWM reset via "
        "/proc/self/clear_refs); composite and fused served in separate processes of "
        "the same run.",
        f"The gather alone is {gathered / mib:.0f} MiB per request. \"No longer "
        "materialised\" is what export reports: every [B, K, D] intermediate of the site "
        "(an upper bound, since TF reuses a buffer for the next step when it can).",
        "",
        "| model | form | no longer materialised | version | RSS before | peak RSS | growth | "
        "request ms (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, m in models.items():
        for name, run in m["runs"].items():
            lines.append(f"| {kind} | {m['form']} | "
                         f"{m['reported_saved_bytes_at_batch'] / mib:.0f} MiB | {name} | "
                         f"{run['rss_before'] / mib:.0f} MiB | {run['peak_rss'] / mib:.0f} MiB"
                         f" | {run['growth'] / mib:.0f} MiB | {m['median_ms'][name]:.0f} |")
    lines.append("")
    for kind, m in models.items():
        lines.append(f"- {kind}: growth composite/fused {m['growth_ratio_composite_over_fused']:.1f}x,"
                     f" latency composite/fused {m['latency_ratio_composite_over_fused']:.2f}x, "
                     f"outputs agree: {m['outputs_match_checksum']}, {m['sites_fused']} site(s) "
                     f"fused, export took {m['export_seconds']:.1f} s.")
    write_results(args.name, report, "\n".join(lines) + "\n", out_dir=args.out)
    print("\n".join(lines))
    return 0 if all(m["outputs_match_checksum"] for m in models.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
