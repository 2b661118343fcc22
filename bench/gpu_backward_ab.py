"""Dense backward A/B of libpkm_cuda.so builds at the huge-table shape, in one process on the same
inputs, against the two write floors of its d_table: cudaMemsetAsync (CuPy's runtime binding, else
the driver's cuMemsetD8Async) and torch's zero_. Each build's d_table and d_weights are written into
NaN-filled buffers and compared bitwise with the first build's. Device time by CUDA graph replay
(the builds taking turns, best of 3 rounds of medians), event time around one wrapper call (the
builds taking turns call by call), and with --profile the kernels of one call (torch profiler).
A variant is a build with PkmCudaOptions (--options, one per build: `key=value+key=value` or empty), so
one build can be compared with itself under other options. d_table is compared bitwise with the
first variant's, d_weights as its largest difference relative to the largest |d_weight|. With
--sparse, the row-sparse backward too (event-timed, taking turns) against writing the touched rows.

    python bench/gpu_backward_ab.py --libs A.so,B.so[,...] --names a,b[,...] [--options o1,o2,...]
        --out DIR --tag TAG [--profile] [--sparse]
"""

import argparse
import ctypes
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "kernels", "capi"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import pkm_capi  # noqa: E402
from gpu_kernels_ab import DTYPES, inputs, interleaved_event_ms, kernel_breakdown  # noqa: E402

CASES = {"huge": (65536, 32, 256, 4194304), "narrow": (4096, 128, 256, 262144),
         # more entries than rows (16-bit: the register walk) and a 32 MB bf16 gradient
         "huge_1m": (65536, 32, 256, 1048576),
         # two vectors a lane (16-bit), 32 MB bf16 gradient
         "wide": (32768, 32, 512, 2097152),
         # the huge shape's entries, sort, d_table and touched rows with a half / quarter-sized gradient
         "huge_b32k": (32768, 64, 256, 4194304), "huge_b16k": (16384, 128, 256, 4194304),
         # shapes above with Zipf(1.1) indices (hot rows: the commonest takes ~9% of the entries)
         "huge_zipf": (65536, 32, 256, 4194304), "wide_zipf": (32768, 32, 512, 2097152),
         "narrow_zipf": (4096, 128, 256, 262144), "d64_zipf": (65536, 32, 64, 4194304)}
ZIPF = {"huge_zipf": 1.1, "wide_zipf": 1.1, "narrow_zipf": 1.1, "d64_zipf": 1.1}


def zipf_indices(B, K, N, exponent):
    """[B, K] int64 CUDA indices with P(rank r) ~ r^-exponent, the ranks spread over the table at random."""
    import numpy as np

    rng = np.random.default_rng(1234)
    ranks = np.minimum(rng.zipf(exponent, size=B * K) - 1, N - 1)
    return torch.from_numpy(rng.permutation(N)[ranks].reshape(B, K)).cuda()


def memset_fn():
    """(name, fn(tensor) -> None): a byte memset of the tensor on torch's current stream."""
    try:
        import cupy

        def run(t):
            cupy.cuda.runtime.memsetAsync(t.data_ptr(), 0, t.numel() * t.element_size(),
                                          torch.cuda.current_stream().cuda_stream)
        return "cudaMemsetAsync (cupy.cuda.runtime)", run
    except ImportError:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuMemsetD8Async.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]

        def run(t):
            rc = cuda.cuMemsetD8Async(t.data_ptr(), 0, t.numel() * t.element_size(),
                                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            assert rc == 0, rc
        return "cuMemsetD8Async (libcuda)", run


def parse_options(text):
    """`key=value+key=value` -> {key: int(value)}; '' -> None (the defaults)."""
    if not text:
        return None
    return {k: int(v) for k, v in (item.split("=") for item in text.split("+"))}


def case(libs, options, shape, dtype_name, iters, profile, memset, sparse, zipf=None):
    B, K, D, N = shape
    dtype = DTYPES[dtype_name]
    table, indices, weights, grad = inputs(B, K, D, N, dtype)
    if zipf is not None:
        indices = zipf_indices(B, K, N, zipf)
    row = {"B": B, "K": K, "D": D, "N": N, "dtype": dtype_name, "zipf": zipf,
           "d_table_GB": N * D * table.element_size() / 1e9}
    fns, outs = {}, {}
    for name, lib in libs.items():
        opts = options[name]
        ws = torch.empty(max(1, lib.cuda_backward_workspace_bytes(table, indices, weights, "sum", options=opts)),
                         dtype=torch.uint8, device="cuda")
        out = (torch.full_like(table, float("nan")), torch.full_like(weights, float("nan")))
        fns[name] = lambda lib=lib, ws=ws, out=out, opts=opts: lib.cuda_backward(
            table, indices, grad, weights, "sum", workspace=ws, out=out, options=opts)
        fns[name]()
        outs[name] = out
    first = next(iter(libs))
    w_scale = outs[first][1].float().abs().max().item()
    for name in libs:
        row[f"{name}_d_table_bitwise_equal_to_{first}"] = bool(torch.equal(outs[name][0], outs[first][0]))
        row[f"{name}_d_weights_bitwise_equal_to_{first}"] = bool(torch.equal(outs[name][1], outs[first][1]))
        row[f"{name}_d_weights_max_diff_rel_to_{first}"] = (
            (outs[name][1].float() - outs[first][1].float()).abs().max().item() / max(w_scale, 1e-30))
    row["finite"] = bool(torch.isfinite(outs[first][0]).all() and torch.isfinite(outs[first][1]).all())
    buf = torch.empty(N, D, device="cuda", dtype=dtype)
    floors = {"memset": lambda: memset(buf), "zero_": lambda: buf.zero_()}
    timed = {**fns, **floors}
    graph = {name: [] for name in timed}
    for _ in range(3):
        for name, fn in timed.items():
            graph[name].append(harness.cuda_graph_ms(fn, iters))
    for name in timed:
        row[f"{name}_graph_ms"] = min(graph[name])
    for name, ms in interleaved_event_ms(timed, 5 * iters).items():
        row[f"{name}_event_ms"] = ms
    if profile:
        for name, fn in fns.items():
            row[f"{name}_kernels_ms"] = kernel_breakdown(fn)
    del outs, fns, timed, buf
    if sparse:
        sparse_fns = {name: (lambda lib=lib, opts=options[name]: lib.cuda_sparse_backward(
            table, indices, grad, weights, "sum", options=opts)) for name, lib in libs.items()}
        touched = int(torch.unique(indices).numel())
        rows_buf = torch.empty(touched, D, device="cuda", dtype=dtype)
        sparse_fns["touched_zero_"] = lambda: rows_buf.zero_()
        row["touched_rows"] = touched
        for name, ms in interleaved_event_ms(sparse_fns, 5 * iters).items():
            row[f"{name}_sparse_event_ms"] = ms
        del sparse_fns, rows_buf
    del table, indices, weights, grad
    torch.cuda.empty_cache()
    return row


def table_md(rows, names):
    lines = ["| shape B,K,D,N | dtype | " + " | ".join(names) + " | memset | zero_ | " +
             " | ".join(f"{n} / memset" for n in names) + " | " + " | ".join(f"{n} / zero_" for n in names) +
             " | d_table bitwise = " + names[0] + " | d_weights max diff / max |d_w| |",
             "|---|---|" + "---|" * (3 * len(names) + 4)]
    for kind in ("graph", "event"):
        lines.append(f"| **{kind} ms** | | " + " | " * (3 * len(names) + 3))
        for r in rows:
            m, z = r[f"memset_{kind}_ms"], r[f"zero__{kind}_ms"]
            cells = [f"{r[f'{n}_{kind}_ms']:.3f}" for n in names] + [f"{m:.3f}", f"{z:.3f}"]
            cells += [f"{r[f'{n}_{kind}_ms'] / m:.2f}" for n in names] + [f"{r[f'{n}_{kind}_ms'] / z:.2f}" for n in names]
            eq = all(r[f"{n}_d_table_bitwise_equal_to_{names[0]}"] for n in names)
            dw = max(r[f"{n}_d_weights_max_diff_rel_to_{names[0]}"] for n in names)
            zipf = f" zipf {r['zipf']}" if r.get("zipf") else ""
            lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']}{zipf} | {r['dtype']} | " + " | ".join(cells) +
                         f" | {eq} | {dw:.2g} |")
    sparse = [r for r in rows if "touched_zero__sparse_event_ms" in r]
    if sparse:
        lines += ["", "Row-sparse backward (event-timed, taking turns; one host sync per call) against torch zero_ "
                  "of a [touched rows, D] buffer, ms and ratio:", "",
                  "| shape | dtype | touched rows | " + " | ".join(names) + " | zero_ touched | " +
                  " | ".join(f"{n} / zero_" for n in names) + " |", "|---|---|---|" + "---|" * (2 * len(names) + 1)]
        for r in sparse:
            z = r["touched_zero__sparse_event_ms"]
            lines.append(f"| {r['B']},{r['K']},{r['D']},{r['N']} | {r['dtype']} | {r['touched_rows']} | " +
                         " | ".join(f"{r[f'{n}_sparse_event_ms']:.3f}" for n in names) + f" | {z:.3f} | " +
                         " | ".join(f"{r[f'{n}_sparse_event_ms'] / z:.2f}" for n in names) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libs", required=True, help="libpkm_cuda.so builds, comma-separated (first = baseline)")
    parser.add_argument("--names", required=True, help="their names, comma-separated")
    parser.add_argument("--options", default=None,
                        help="PkmCudaOptions per build, comma-separated, each key=value+key=value or empty")
    parser.add_argument("--sparse", action="store_true", help="the row-sparse backward too")
    parser.add_argument("--cases", default="huge", help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--tag", default="h200")
    args = parser.parse_args()
    paths, names = args.libs.split(","), args.names.split(",")
    assert len(paths) == len(names), "one name per library"
    opt_texts = args.options.split(",") if args.options is not None else [""] * len(paths)
    assert len(opt_texts) == len(paths), "one options entry per library"
    loaded = {path: pkm_capi.PkmLib(path) for path in dict.fromkeys(paths)}
    libs = {name: loaded[path] for name, path in zip(names, paths)}
    options = {name: parse_options(text) for name, text in zip(names, opt_texts)}
    memset_name, memset = memset_fn()
    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sm_count": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "memset": memset_name, "libs": dict(zip(names, paths)),
            "options": {n: o for n, o in options.items()}, "command": "python " + " ".join(sys.argv)}
    rows = []
    for c in args.cases.split(","):
        for dt in args.dtypes.split(","):
            rows.append(case(libs, options, CASES[c], dt, args.iters, args.profile, memset, args.sparse, ZIPF.get(c)))
            print(json.dumps(rows[-1]), flush=True)
    text = (f"# Dense backward A/B ({', '.join(names)}) on {meta['gpu']}\n\n"
            f"Run {meta['date']} UTC, torch {meta['torch']}, CUDA {meta['cuda']}; floors: {memset_name} and "
            f"torch zero_ of a d_table-sized buffer. Uniform random indices (Zipf in the huge_zipf case), per-sample weights (d_weights "
            f"wanted), sum. graph: device time by CUDA graph replay; event: one wrapper call between two events.\n"
            f"Command: `{meta['command']}`\n\n" + table_md(rows, names) + "\n")
    harness.write_results(f"gpu_backward_ab_{args.tag}", {"meta": meta, "rows": rows}, text, args.out)
    print(text)


if __name__ == "__main__":
    main()
