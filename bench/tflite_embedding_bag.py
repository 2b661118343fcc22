"""TFLite benchmark: the fused PkmEmbeddingBag custom op (libpkm_tflite.so
delegate) vs the stock composite model (GATHER/RESHAPE/STRIDED_SLICE/MUL/SUM
as the converter emits it, run by LiteRT with its default XNNPACK delegate),
plus the composite with fuse_composites=true and the int8-table model.

    .venv/bin/python bench/tflite_embedding_bag.py            # full grid
    .venv/bin/python bench/tflite_embedding_bag.py --quick    # small smoke run

Latency: median invoke in one process (LiteRT, 1 and 2 threads), all variants
interleaved round by round on rotating index batches (the 2-core machine is
shared, so every variant sees the same background load).
Memory: each (model, B, D) runs in a fresh subprocess that holds the model in
memory, runs it at B=1, then reports how much its peak RSS (VmHWM) grows when
it is resized to B, allocated and invoked: the arena and scratch that scale
with the batch (set-up, code pages and the model itself excluded).
Writes bench/results/tflite_embedding_bag.{json,md}.
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

from harness import ROOT, interleaved, machine_info, machine_name, run_child, utc_date, write_results

sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from pkm_serve import tflite  # noqa: E402

K = 128


def vm_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def convert_composite(n_small, d):
    """Stock conversion of reduce_sum(gather(table, i) * w[..., None], -2) on a
    small table; the big table is swapped in afterwards (same graph)."""
    import tensorflow as tf
    table = tf.constant(np.zeros((n_small, d), np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                  tf.TensorSpec([None, K], tf.float32)])
    def composite(i, w):
        return tf.reduce_sum(tf.gather(table, i) * w[..., None], axis=-2)

    conv = tf.lite.TFLiteConverter.from_concrete_functions(
        [composite.get_concrete_function()], composite)
    return conv.convert()


def swap_table(model_bytes, table):
    """Replaces the (only) constant float32 [n, d] tensor's data and shape."""
    import flatbuffers
    schema = tflite._schema()  # pylint: disable=protected-access
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    sub = model.subgraphs[0]
    (t,) = [t for t in sub.tensors if t.type == schema.TensorType.FLOAT32 and t.shape is not None
            and len(t.shape) == 2 and t.shape[1] == table.shape[1]
            and model.buffers[t.buffer].data is not None]
    model.buffers[t.buffer].data = np.frombuffer(table.tobytes(), np.uint8)
    t.shape = list(table.shape)
    b = flatbuffers.Builder(table.nbytes + 65536)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def make_inputs(batch, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(batch, K)).astype(np.int32),
            rng.uniform(0.5, 1.5, size=(batch, K)).astype(np.float32)]


def interpreter_for(path, variant, threads):
    if variant == "stock composite (XNNPACK)":
        return tflite.make_interpreter(path, "litert", num_threads=threads, use_delegate=False)
    return tflite.make_interpreter(path, "litert", num_threads=threads,
                                   fuse_composites=variant == "composite + fuse_composites")


def prepared(interp, inputs):
    for d, x in zip(interp.get_input_details(), inputs):
        interp.resize_tensor_input(d["index"], list(x.shape))
    interp.allocate_tensors()
    for d, x in zip(interp.get_input_details(), inputs):
        interp.set_tensor(d["index"], x)
    return interp


def time_interleaved(interps, input_sets, budget_s, min_rounds=5, max_rounds=400):
    """Median invoke time of each interpreter, measured in interleaved rounds
    (the machine is shared and noisy: every variant sees the same background
    load) and with rotating index batches (requests differ, so the gathered
    rows are not all cache-resident from the previous invoke)."""
    keys = list(interps)

    def feed(r):
        for interp in interps.values():
            for d, x in zip(interp.get_input_details(), input_sets[r % len(input_sets)]):
                interp.set_tensor(d["index"], x)

    res = interleaved({i: interps[key].invoke for i, key in enumerate(keys)}, min_rounds, warmup=1,
                      before_round=feed, budget_s=budget_s, max_rounds=max_rounds)
    return {key: res["systems"][i]["median_ms"] for i, key in enumerate(keys)}


def memory_child(path, variant, batch, n):
    """Run in a fresh process: peak-RSS growth of allocate + invoke at batch B
    over the same interpreter already run at B=1 (so code pages, thread pools
    and runtime set-up are excluded; what remains is the arena and scratch
    that scale with the batch). The model is held in memory, so table pages
    touched by invoke do not count either."""
    with open(path, "rb") as f:
        model = f.read()
    interp = interpreter_for(model, variant, 1)
    small, big = make_inputs(1, n), make_inputs(batch, n)
    prepared(interp, small).invoke()
    base = vm_kb("VmHWM")
    prepared(interp, big).invoke()
    return (vm_kb("VmHWM") - base) * 1024


VARIANTS = ("fused custom op", "stock composite (XNNPACK)", "composite + fuse_composites",
            "fused custom op, int8 table")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small tables, short timing")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="seconds of timing per variant and shape")
    parser.add_argument("--memory-child", nargs=4, metavar=("PATH", "VARIANT", "B", "N"))
    args = parser.parse_args()
    if args.memory_child:
        path, variant, b, n = args.memory_child
        print(json.dumps({"bytes": memory_child(path, variant, int(b), int(n))}))
        return

    dims = {256: 65536, 1024: 262144}  # N per D, as in ANCHORS.md
    batches = (1, 64, 512)
    if args.quick:
        dims = {256: 4096, 1024: 4096}
        args.budget = 0.1
    results = []
    tmp = tempfile.mkdtemp(prefix="pkm_tflite_bench_")
    for d, n in dims.items():
        table = np.random.default_rng(1).standard_normal((n, d)).astype(np.float32)
        paths = {
            "fused custom op": os.path.join(tmp, f"custom_{d}.tflite"),
            "stock composite (XNNPACK)": os.path.join(tmp, f"composite_{d}.tflite"),
            "fused custom op, int8 table": os.path.join(tmp, f"custom_int8_{d}.tflite"),
        }
        paths["composite + fuse_composites"] = paths["stock composite (XNNPACK)"]
        custom = tflite.build_embedding_bag_model(table, K)
        with open(paths["fused custom op"], "wb") as f:
            f.write(custom)
        with open(paths["fused custom op, int8 table"], "wb") as f:
            f.write(tflite.quantize_table_int8(custom))
        del custom
        with open(paths["stock composite (XNNPACK)"], "wb") as f:
            f.write(swap_table(convert_composite(16, d), table))
        del table
        sizes = {v: os.path.getsize(p) for v, p in paths.items()}
        for batch in batches:
            input_sets = [make_inputs(batch, n, seed) for seed in range(8)]
            interps = {(variant, threads): prepared(interpreter_for(paths[variant], variant, threads),
                                                    input_sets[0])
                       for variant in VARIANTS for threads in (1, 2)}
            ms = time_interleaved(interps, input_sets, args.budget * len(interps))
            # Same batch every time: the gathered rows stay cache-resident.
            ms_hot = time_interleaved(interps, input_sets[:1], args.budget * len(interps) / 2)
            # Outputs on one fixed batch, compared with the fused custom op.
            outs = {}
            for key, interp in interps.items():
                for dd, x in zip(interp.get_input_details(), input_sets[0]):
                    interp.set_tensor(dd["index"], x)
                interp.invoke()
                outs[key] = interp.get_tensor(interp.get_output_details()[0]["index"]).copy()
            del interps
            ref = outs[(VARIANTS[0], 1)]
            for variant in VARIANTS:
                row = {"D": d, "N": n, "B": batch, "K": K, "variant": variant,
                       "model_bytes": sizes[variant], "ms_1t": ms[(variant, 1)],
                       "ms_2t": ms[(variant, 2)], "ms_1t_hot": ms_hot[(variant, 1)],
                       "ms_2t_hot": ms_hot[(variant, 2)]}
                row["rel_err_vs_fused"] = max(
                    float(np.linalg.norm(outs[(variant, t)] - ref) / max(np.linalg.norm(ref), 1e-30))
                    for t in (1, 2))
                child = run_child(__file__, ["--memory-child", paths[variant], variant, batch, n])
                if "error" in child:
                    raise SystemExit(f"memory child {variant} B={batch}: {child['error']}")
                row["peak_growth_bytes"] = child["bytes"]
                results.append(row)
                print(f"D={d:5d} B={batch:4d} {variant:<30} 1t {row['ms_1t']:9.3f} ms  "
                      f"2t {row['ms_2t']:9.3f} ms  hot 1t {row['ms_1t_hot']:9.3f} ms  peak+ {row['peak_growth_bytes'] / 2**20:8.1f} MiB  "
                      f"model {row['model_bytes'] / 2**20:7.1f} MiB  rel.err {row['rel_err_vs_fused']:.1e}",
                      flush=True)
        for p in set(paths.values()):
            os.remove(p)
    os.rmdir(tmp)
    write_report(results, args.quick)


def write_report(results, quick):
    stem = "tflite_embedding_bag" + ("_quick" if quick else "")
    info = machine_info()
    meta = {"machine": machine_name(info), "cpus": info["cores"], "python": info["python"],
            "date_utc": utc_date(), "load_average_at_end": os.getloadavg()[0]}
    try:
        import ai_edge_litert
        meta["litert"] = getattr(ai_edge_litert, "__version__", "2.3.0")
    except ImportError:
        pass
    def find(d, b, variant):
        return next(r for r in results if r["D"] == d and r["B"] == b and r["variant"] == variant)

    lines = [f"# TFLite EmbeddingBag: fused custom op vs stock composite ({meta['date_utc']})", "",
             f"LiteRT {meta.get('litert', '?')}, {meta['machine']}. K={K}, fp32 unless noted. "
             "Latency = median invoke, variants interleaved on rotating index batches; peak+ = growth of peak RSS when the interpreter, already "
             "run at B=1, is resized to B, allocated and invoked (the arena and scratch that scale "
             "with B; the model and runtime set-up excluded). Produced by "
             "`bench/tflite_embedding_bag.py`. Load average at the end of the run: "
             f"{meta['load_average_at_end']:.1f} (the machine is shared; compare ratios).", "",
             "Columns *hot*: the same batch invoked repeatedly (its rows stay in cache).", "",
             "| D | N | B | variant | 1 thread ms | 2 threads ms | hot 1 thread ms | hot 2 threads ms "
             "| peak+ MiB | model MiB | rel. err vs fused |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['D']} | {r['N']} | {r['B']} | {r['variant']} | {r['ms_1t']:.3f} | "
                     f"{r['ms_2t']:.3f} | {r['ms_1t_hot']:.3f} | {r['ms_2t_hot']:.3f} | "
                     f"{r['peak_growth_bytes'] / 2**20:.1f} | "
                     f"{r['model_bytes'] / 2**20:.1f} | {r['rel_err_vs_fused']:.1e} |")
    lines += ["", "## Ratios (stock composite / fused custom op)", "",
              "| D | B | speed-up 1 thread | speed-up 2 threads | hot 1 thread | hot 2 threads "
              "| peak memory ratio |", "|---|---|---|---|---|---|---|"]
    for d in sorted({r["D"] for r in results}):
        for b in sorted({r["B"] for r in results}):
            fused, stock = find(d, b, VARIANTS[0]), find(d, b, VARIANTS[1])
            # Growth below one page is reported as 4 KiB (RSS is counted in pages).
            mem = stock["peak_growth_bytes"] / max(fused["peak_growth_bytes"], 4096)
            mem_text = f"{mem:.0f}x" if stock["peak_growth_bytes"] >= 4096 else "- (no growth)"
            lines.append(f"| {d} | {b} | {stock['ms_1t'] / fused['ms_1t']:.1f}x | "
                         f"{stock['ms_2t'] / fused['ms_2t']:.1f}x | "
                         f"{stock['ms_1t_hot'] / fused['ms_1t_hot']:.1f}x | "
                         f"{stock['ms_2t_hot'] / fused['ms_2t_hot']:.1f}x | {mem_text} |")
    write_results(stem, {"meta": meta, "results": results}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
