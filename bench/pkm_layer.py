"""Benchmark: ProductKeyMemory layer step time and peak memory, fused vs composite.

    .venv/bin/python bench/pkm_layer.py                 # default CPU-sized config
    .venv/bin/python bench/pkm_layer.py --batch 256 --repeats 5 --out bench/results

Each (implementation, mode) runs in its own fresh process so that memory is
not shared. Two peaks are reported: the TF CPU allocator's peak bytes during
the timed steps above what was live before them (tensors only), and the
process RSS high-water mark from before the first step (reset through
/proc/self/clear_refs) above the RSS then. Modes: "forward" (inference call)
"train" (forward + gradients of every trainable variable + an SGD update),
and "read" (the value read alone, forward + backward: the part the fused op
replaces; the key search and top-k are the same code in both).
Results go to bench/results/pkm_layer_<date>.{json,md}.
"""
import argparse
import datetime
import json
import os
import sys

from harness import ROOT, machine_info, run_child, time_calls, write_results

MODES = ("forward", "train", "read")
DEFAULTS = dict(batch=1024, d_model=256, v_dim=256, k_dim=128, n_keys=256, heads=4, knn=32)


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_one(args):
    """Child process: time one implementation in one mode, print a JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    from pkm_serve._memory import reset_peak_rss
    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(0)
    layer = ProductKeyMemory(
        v_dim=args.v_dim, k_dim=args.k_dim, n_keys=args.n_keys, heads=args.heads,
        knn=args.knn, implementation=args.implementation,
    )
    layer.build((None, args.d_model))
    x = tf.constant(np.random.default_rng(0).standard_normal((args.batch, args.d_model)), tf.float32)
    optimizer = keras.optimizers.SGD(1e-3)

    @tf.function
    def forward():
        return layer(x, training=False)

    @tf.function
    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(layer(x, training=True)))
        grads = tape.gradient(loss, layer.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    # The value read alone (what the fused op replaces): fixed slots and scores
    # from the layer's own key search, forward + gradients of table and scores.
    slots, scores = layer.select_slots(layer.query_bn(layer.query_proj(x), training=False))

    @tf.function
    def read():
        with tf.GradientTape() as tape:
            tape.watch(scores)
            loss = tf.reduce_mean(tf.square(layer.memory(slots, weights=scores)))
        return tape.gradient(loss, [layer.memory.embeddings.value, scores])

    def read_step():
        return read()[1]

    step = {"forward": forward, "train": train, "read": read_step}[args.mode]
    # RSS high-water mark from before the first step: TF's allocator keeps freed
    # buffers, so a reset after warm-up would hide them.
    rss_before = rss_kib("VmRSS")
    reset_peak_rss()
    for _ in range(args.warmup):
        step().numpy()
    # Bytes held by live tensors, from TF's own allocator (steady-state steps only).
    tf.config.experimental.reset_memory_stats("CPU:0")
    tensors_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    timing = time_calls(lambda: step().numpy(), args.repeats, warmup=0)
    peak = rss_kib("VmHWM")
    tensor_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({
        "implementation": args.implementation,
        "mode": args.mode,
        "median_ms": timing["median_ms"],
        "min_ms": timing["min_ms"],
        "times_ms": timing["times_ms"],
        "peak_rss_above_baseline_mb": (peak - rss_before) / 1024,
        "rss_before_mb": rss_before / 1024,
        "tensor_peak_above_baseline_mb": (tensor_peak - tensors_before) / 2**20,
    }))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--implementation", choices=["fused", "composite"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["forward", "train", "read"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.implementation:
        return run_one(args)

    config = {key: getattr(args, key) for key in DEFAULTS}
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    for mode in MODES:
        for implementation in ("fused", "composite"):
            command = ["--implementation", implementation, "--mode", mode, "--repeats", args.repeats,
                       "--warmup", args.warmup]
            for key, value in config.items():
                command += ["--" + key.replace("_", "-"), value]
            row = run_child(os.path.abspath(__file__), command, timeout=3600, env=env)
            if "error" in row:
                sys.exit(f"{implementation}/{mode} failed: {row['error']}")
            rows.append(row)
            print(f"{mode:8s} {implementation:9s} median {row['median_ms']:8.2f} ms  "
                  f"tensor peak +{row['tensor_peak_above_baseline_mb']:7.1f} MB  "
                  f"RSS peak +{row['peak_rss_above_baseline_mb']:7.1f} MB", flush=True)

    def pick(implementation, mode):
        return next(r for r in rows if r["implementation"] == implementation and r["mode"] == mode)

    ratios = {
        mode: {
            "composite_over_fused_time": pick("composite", mode)["median_ms"] / pick("fused", mode)["median_ms"],
            "composite_over_fused_tensor_peak": pick("composite", mode)["tensor_peak_above_baseline_mb"]
            / max(pick("fused", mode)["tensor_peak_above_baseline_mb"], 1e-3),
            "composite_over_fused_rss_peak": pick("composite", mode)["peak_rss_above_baseline_mb"]
            / max(pick("fused", mode)["peak_rss_above_baseline_mb"], 1e-3),
        }
        for mode in MODES
    }
    bag_size = config["heads"] * config["knn"]
    gathered_mb = config["batch"] * bag_size * config["v_dim"] * 4 / 2**20
    report = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": config,
        "bag_size": bag_size,
        "memory_slots": config["n_keys"] ** 2,
        "composite_gather_buffer_mb": gathered_mb,
        "rows": rows,
        "ratios": ratios,
    }
    stem = os.path.join(args.out, "pkm_layer_" + datetime.date.today().isoformat())
    write_results(os.path.basename(stem), report, markdown(report), out_dir=args.out)
    print(f"composite/fused: forward time x{ratios['forward']['composite_over_fused_time']:.2f}, "
          f"train time x{ratios['train']['composite_over_fused_time']:.2f}, "
          f"read time x{ratios['read']['composite_over_fused_time']:.2f}, "
          f"train tensor peak x{ratios['train']['composite_over_fused_tensor_peak']:.2f}")
    print("wrote", stem + ".json", "and", stem + ".md")


def markdown(report):
    c = report["config"]
    lines = [
        f"# ProductKeyMemory layer, fused vs composite ({report['date_utc']})",
        "",
        f"CPU ({report['machine']['cores']} cores), float32. batch={c['batch']}, d_model={c['d_model']}, "
        f"v_dim={c['v_dim']}, k_dim={c['k_dim']}, n_keys={c['n_keys']} ({report['memory_slots']} slots), "
        f"heads={c['heads']}, knn={c['knn']} (bag of {report['bag_size']} slots per row). "
        f"The composite materialises a {report['composite_gather_buffer_mb']:.0f} MB [batch, bag, v_dim] gather.",
        "",
        "| mode | implementation | median ms | min ms | tensor peak (MB) | RSS peak (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['mode']} | {r['implementation']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | "
                     f"{r['tensor_peak_above_baseline_mb']:.1f} | {r['peak_rss_above_baseline_mb']:.1f} |")
    lines.append("")
    for mode, ratio in report["ratios"].items():
        lines.append(f"- {mode}: composite / fused time = {ratio['composite_over_fused_time']:.2f}x, "
                     f"tensor peak = {ratio['composite_over_fused_tensor_peak']:.2f}x, "
                     f"RSS peak = {ratio['composite_over_fused_rss_peak']:.2f}x")
    lines.append("")
    lines.append("`train` = forward + gradients of all trainable variables + SGD update; "
                 "`read` = the value read alone (EmbeddingBag over the selected slots with the "
                 "softmax scores), forward + gradients of table and scores. "
                 "Each row is a fresh process; times are per step, median of the repeats. "
                 "Tensor peak: TF CPU allocator peak during the timed steps, above the bytes live "
                 "before them (tf.config.experimental.get_memory_info). RSS peak: process "
                 "high-water mark from before the first step (includes tracing), above the RSS then.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
