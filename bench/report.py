"""`make bench-report`: gather bench/results/*.json into one Markdown report
with PNG plots of speed-up and memory against the peers, per runtime.

Every benchmark writes its own JSON (its own shape); the small readers below
turn each into comparison rows: (runtime, case, peer, speed-up, memory ratio),
where speed-up = peer time / our time and memory ratio = peer memory / ours,
both from the same run. Missing results files are listed, not invented.

    python bench/report.py [--results bench/results]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(path):
    with open(path) as f:
        return json.load(f)


def _latest(results, pattern):
    paths = sorted(glob.glob(os.path.join(results, pattern)))
    return paths[-1] if paths else None


def _ratio(peer, ours):
    return peer / ours if peer and ours else None


def cpu_rows(results):
    path = os.path.join(results, "cpu_embedding_bag.json")
    if not os.path.exists(path):
        return None, []
    data = _load(path)
    table = {}
    for r in data["rows"]:
        table[(r["B"], r["K"], r["D"], r["N"], r["dtype"], r["mode"], r["system"])] = r
    rows = []
    for (b, k, d, n, dtype, mode, system), r in table.items():
        if system == "fused" or "median_ms" not in r:
            continue
        ours = table.get((b, k, d, n, dtype, mode, "fused"), {})
        if "median_ms" not in ours:
            continue
        rows.append({"runtime": "CPU, TensorFlow op", "case": f"B={b} K={k} D={d} N={n} {dtype} {mode}",
                     "peer": {"torch": "torch F.embedding_bag", "composite": "TF composite",
                              "sparse": "tf.nn.embedding_lookup_sparse"}[system],
                     "ours_ms": ours["median_ms"], "peer_ms": r["median_ms"],
                     "speedup": _ratio(r["median_ms"], ours["median_ms"]),
                     "memory_ratio": _ratio(r["peak_growth_bytes"], ours["peak_growth_bytes"])})
    return path, rows


def gpu_rows(results):
    path = _latest(results, "gpu_embedding_bag_*.json")
    if not path:
        return None, []
    rows = []
    for r in _load(path)["rows"]:
        case = f"B={r['B']} K={r['K']} D={r['D']} N={r['N']} {r['dtype']}"
        for peer, label in (("torch", "torch F.embedding_bag"), ("composite", "torch composite")):
            for mode, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
                peer_ms = r.get(f"{peer}_{key}")
                if not isinstance(peer_ms, (int, float)):
                    continue  # e.g. torch's bf16 backward raises NotImplementedError
                mem = None
                if mode == "fwd+bwd":
                    mem = _ratio(r.get(f"{peer}_peak_GB"), r.get("ours_peak_GB"))
                rows.append({"runtime": "GPU (H200), CUDA kernels", "case": f"{case} {mode}", "peer": label,
                             "ours_ms": r[f"ours_{key}"], "peer_ms": peer_ms,
                             "speedup": _ratio(peer_ms, r[f"ours_{key}"]), "memory_ratio": mem})
    return path, rows


def tflite_rows(results):
    path = os.path.join(results, "tflite_embedding_bag.json")
    if not os.path.exists(path):
        return None, []
    by_shape = {}
    for r in _load(path)["results"]:
        by_shape.setdefault((r["B"], r["K"], r["D"], r["N"]), {})[r["variant"]] = r
    rows = []
    for (b, k, d, n), variants in by_shape.items():
        ours, peer = variants.get("fused custom op"), variants.get("stock composite (XNNPACK)")
        if not ours or not peer or b == 1:
            continue  # B=1 times are microseconds: launch noise, not kernels
        rows.append({"runtime": "TFLite (LiteRT), 1 thread", "case": f"B={b} K={k} D={d} N={n} fp32",
                     "peer": "stock GATHER/MUL/SUM + XNNPACK", "ours_ms": ours["ms_1t"], "peer_ms": peer["ms_1t"],
                     "speedup": _ratio(peer["ms_1t"], ours["ms_1t"]),
                     "memory_ratio": _ratio(peer["peak_growth_bytes"], ours["peak_growth_bytes"])
                     if ours["peak_growth_bytes"] > 65536 else None})
    return path, rows


def export_rows(results):
    path = os.path.join(results, "export_memory.json")
    if not os.path.exists(path):
        return None, []
    data = _load(path)
    s, runs = data["shape"], data["runs"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return path, [{"runtime": "Export: serving the fused SavedModel", "case":
                   f"B={s['batch']} K={s['bag']} D={s['dim']} N={s['rows']} {s['dtype']}",
                   "peer": "original composite SavedModel", "ours_ms": med(runs["fused"]["ms"]),
                   "peer_ms": med(runs["composite"]["ms"]),
                   "speedup": _ratio(med(runs["composite"]["ms"]), med(runs["fused"]["ms"])),
                   "memory_ratio": _ratio(runs["composite"]["growth"], runs["fused"]["growth"])}]


def layer_rows(results):
    path = _latest(results, "pkm_layer_2*.json")
    if not path:
        return None, []
    data = _load(path)
    by = {(r["implementation"], r["mode"]): r for r in data["rows"]}
    rows = []
    for mode in sorted({m for _, m in by}):
        ours, peer = by.get(("fused", mode)), by.get(("composite", mode))
        if ours and peer:
            c = data["config"]
            case = f"{mode}: batch {c['batch']}, d_model {c['d_model']}, {c['n_keys']}^2 slots, {c['heads']}x top-{c['knn']}"
            rows.append({"runtime": "Keras ProductKeyMemory layer", "case": case,
                         "peer": "same layer, composite lookup", "ours_ms": ours["median_ms"],
                         "peer_ms": peer["median_ms"], "speedup": _ratio(peer["median_ms"], ours["median_ms"]),
                         "memory_ratio": _ratio(peer.get("tensor_peak_above_baseline_mb"),
                                                ours.get("tensor_peak_above_baseline_mb"))})
    return path, rows


def serving_rows(results):
    path = _latest(results, "serving_2*.json")
    if not path:
        return None, []
    data = _load(path)
    inproc, grpc_ = data["in_process"], data["grpc"]
    rows = [{"runtime": "Serving: pkm-serve serve (gRPC, loopback)", "case": "batch-1 p50 latency, batching off",
             "peer": "in-process SavedModel call", "ours_ms": grpc_["batching_off"]["batch1"]["p50_ms"],
             "peer_ms": inproc["batch1"]["p50_ms"],
             "speedup": _ratio(inproc["batch1"]["p50_ms"], grpc_["batching_off"]["batch1"]["p50_ms"]),
             "memory_ratio": None}]
    # Throughput as a time ratio: rows/s of ours over rows/s of the peer.
    for peer, key in (("in-process, saturated", "saturated_rows_per_s"),
                      ("in-process, 32 threads x batch 1", "batch1_concurrent_rows_per_s")):
        ours = grpc_["batching_on"]["concurrent"]["rows_per_s"]
        rows.append({"runtime": "Serving: pkm-serve serve (gRPC, loopback)",
                     "case": "32 clients x batch 1, batching on: throughput", "peer": peer,
                     "ours_ms": None, "peer_ms": None, "speedup": _ratio(ours, inproc[key]), "memory_ratio": None})
    return path, rows


READERS = [cpu_rows, gpu_rows, tflite_rows, export_rows, layer_rows, serving_rows]


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, title, fname in (("speedup", "Speed-up of pkm_serve over the peer (peer time / ours)", "speedup.png"),
                              ("memory_ratio", "Memory: peer's peak growth / ours", "memory.png")):
        pts = [r for r in rows if r.get(key)]
        if not pts:
            continue
        runtimes = list(dict.fromkeys(r["runtime"] for r in pts))  # one panel per runtime
        groups = [[r for r in pts if r["runtime"] == rt] for rt in runtimes]
        fig, axes = plt.subplots(len(groups), 1, figsize=(11, 0.3 * len(pts) + 0.9 * len(groups) + 0.6),
                                 gridspec_kw={"height_ratios": [len(g) for g in groups]}, squeeze=False)
        top = max(r[key] for r in pts) * 3
        for ax, runtime, group in zip(axes[:, 0], runtimes, groups):
            values = [r[key] for r in group]
            ax.barh(range(len(group)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
            ax.set_yticks(range(len(group)), [f"{r['case']}  vs {r['peer']}" for r in group], fontsize=7)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.set_xlim(0.5, top)
            ax.axvline(1.0, color="black", linewidth=0.8)
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:.2f}x", va="center", fontsize=7)
            ax.set_title(runtime, fontsize=9, loc="left")
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(fname)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    rows, sources, missing = [], [], []
    for reader in READERS:
        path, got = reader(args.results)
        if path:
            sources.append(os.path.relpath(path, args.results))
            rows += got
        else:
            missing.append(reader.__name__.replace("_rows", ""))
    plots = plot(rows, args.results)
    lines = ["# pkm_serve benchmark report", "",
             "Generated by `make bench-report` from the committed results in this folder "
             f"({', '.join(sources)}). Each ratio compares two systems measured side by side in one run "
             "on the machine that file names; speed-up = peer time / our time, memory = peer's peak "
             "growth / ours.", ""]
    if missing:
        lines += [f"No results for: {', '.join(missing)}.", ""]
    lines += [f"![{p}]({p})" for p in plots] + [""]
    lines += ["| runtime | case | peer | ours ms | peer ms | speed-up | memory ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v, f: (f.format(v) if isinstance(v, (int, float)) else "-")  # noqa: E731
        lines.append(f"| {r['runtime']} | {r['case']} | {r['peer']} | {fmt(r['ours_ms'], '{:.3g}')} | "
                     f"{fmt(r['peer_ms'], '{:.3g}')} | {fmt(r['speedup'], '{:.2f}x')} | "
                     f"{fmt(r['memory_ratio'], '{:.1f}x')} |")
    out = os.path.join(args.results, "REPORT.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(rows)} comparisons) and {', '.join(plots) or 'no plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
