"""Per-request latency of the linked-op C++ session run beside the Python paths.

  make serving-cc-program && .venv/bin/python bench/serving_cc_latency.py [--rounds 3] [--out bench/results]

Model: the demo's PKM (value table 65536 x 256 float32, 4 heads x top-32 = 128
rows per query), fused by `pkm-serve export`. For batch 1 and 64, measured in
interleaved rounds (C++, Python, gRPC, then again) so background load hits all
three alike:
  C++ session   build/serving_cc/pkm_saved_model_run --repeat: Session::Run of
                the signature in a program that loaded it with
                tensorflow::LoadSavedModel (the op linked in, TF Serving's
                session options): what a linked tensorflow_model_server spends
                in TensorFlow per request, without its gRPC layer;
  Python call   the SavedModel's signature called in-process (what
                `pkm-serve serve` runs per request, without its gRPC layer);
  gRPC          `pkm-serve serve` over loopback gRPC, TF Serving's
                PredictionService stub (request encode + RPC + decode).
Reports medians and p90 per path, ratios to the C++ session run, and saves
JSON + Markdown under --out (serving_cc_latency_<UTC stamp>.{json,md}).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from harness import ROOT as REPO, machine_info, machine_name, time_calls, write_results

sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "serving_cc"))

from serving_cc_helpers import export_demo_pkm, require_program, tensor_file_arg  # noqa: E402
from serving_load import Server  # noqa: E402


def stats_us(samples_us):
    a = np.asarray(samples_us, dtype=np.float64)
    return {"median_us": float(np.median(a)), "p90_us": float(np.percentile(a, 90)), "n": int(a.size)}


def cc_session(model_dir, query, repeat, warmup, workdir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([require_program(), f"--model_dir={model_dir}", "--signature=serving_default",
                           tensor_file_arg("query", query, workdir), f"--repeat={repeat}", f"--warmup={warmup}"],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    result = json.loads(proc.stdout)
    lat = result["latency_us"]
    out = np.asarray(result["outputs"]["output"]["values"], np.float32).reshape(result["outputs"]["output"]["shape"])
    return {"median_us": lat["median"], "p90_us": lat["p90"], "n": lat["runs"]}, out


def python_call(fn, tf, query, repeat, warmup):
    timing = time_calls(lambda: fn(query=tf.constant(query))["output"].numpy(), repeat, warmup=warmup)
    return stats_us([1e3 * ms for ms in timing["times_ms"]])


def grpc_call(stub, tf, predict_pb2, query, repeat, warmup):
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.inputs["query"].CopyFrom(tf.make_tensor_proto(query))
    for _ in range(warmup):
        stub.Predict(req, timeout=60)

    def request():  # encode, call, decode: what a client pays
        r = predict_pb2.PredictRequest()
        r.model_spec.name = "pkm"
        r.inputs["query"].CopyFrom(tf.make_tensor_proto(query))
        tf.make_ndarray(stub.Predict(r, timeout=60).outputs["output"])

    timing = time_calls(request, repeat, warmup=0)
    return stats_us([1e3 * ms for ms in timing["times_ms"]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=200, help="timed calls per path, round and batch (batch 1)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--machine", default=machine_name() + ", shared with other engineers' parallel builds and tests",
                   help="how to describe this machine in the report")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    require_program()

    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    from pkm_serve import ops
    ops.load_library()

    work = tempfile.mkdtemp(prefix="pkm_cc_bench_")
    model_dir = export_demo_pkm(work)          # .../demo_fused/1
    fn = tf.saved_model.load(model_dir).signatures["serving_default"]
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    queries = {b: rng.standard_normal((b, 64)).astype(np.float32) for b in batches}
    load_before = os.getloadavg()

    srv = Server(os.path.dirname(model_dir), [], os.path.join(work, "server.log"))
    rounds = {b: {"cc_session": [], "python_call": [], "grpc": []} for b in batches}
    max_diff = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
            for rnd in range(args.rounds):
                for b in batches:
                    repeat = max(50, args.repeat // max(1, b // 8))
                    print(f"round {rnd + 1}/{args.rounds}, batch {b}, {repeat} calls per path ...", flush=True)
                    cc, cc_out = cc_session(model_dir, queries[b], repeat, args.warmup, work)
                    rounds[b]["cc_session"].append(cc)
                    rounds[b]["python_call"].append(python_call(fn, tf, queries[b], repeat, args.warmup))
                    rounds[b]["grpc"].append(grpc_call(stub, tf, predict_pb2, queries[b], repeat, args.warmup))
                    want = fn(query=tf.constant(queries[b]))["output"].numpy()
                    max_diff[b] = max(max_diff.get(b, 0.0), float(np.abs(cc_out - want).max()))
    finally:
        srv.stop()

    # Per path: the median over rounds of each round's median (and p90).
    summary = {}
    for b in batches:
        summary[b] = {path: {"median_us": float(np.median([r["median_us"] for r in rs])),
                             "p90_us": float(np.median([r["p90_us"] for r in rs]))}
                      for path, rs in rounds[b].items()}
        base = summary[b]["cc_session"]["median_us"]
        for path in summary[b]:
            summary[b][path]["ratio_to_cc"] = summary[b][path]["median_us"] / base
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": "demo PKM (pkm_serve.demo.build_composite_pkm) fused by pkm-serve export: "
                 "values 65536 x 256 float32, 4 heads x top-32, query [B, 64]",
        "summary": {str(b): v for b, v in summary.items()},
        "rounds": {str(b): v for b, v in rounds.items()},
        "cc_vs_python_max_abs_diff": {str(b): v for b, v in max_diff.items()},
        "config": vars(args),
        "machine": {"description": args.machine, "cpus": os.cpu_count(), **machine_info(), "tensorflow": tf.__version__,
                    "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0]},
    }

    lines = [f"# Linked-op C++ session run vs the Python serving paths ({results['date']})", "",
             f"Model: {results['model']}. Machine: {args.machine}; "
             f"1-minute load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after. "
             f"{args.rounds} interleaved rounds; each cell is the median over rounds of the round's median (p90).",
             "", "Command: `.venv/bin/python bench/serving_cc_latency.py " + " ".join(argv or sys.argv[1:]) + "`",
             "", "| batch | path | median µs | p90 µs | × C++ session | round medians, min-max µs |",
             "|---|---|---|---|---|---|"]
    names = {"cc_session": "C++ Session::Run (op linked, LoadSavedModel)",
             "python_call": "Python signature call in-process",
             "grpc": "`pkm-serve serve`, gRPC Predict over loopback"}
    for b in batches:
        for path, v in summary[b].items():
            spread = [r["median_us"] for r in rounds[b][path]]
            lines.append(f"| {b} | {names[path]} | {v['median_us']:.0f} | {v['p90_us']:.0f} | "
                         f"{v['ratio_to_cc']:.2f} | {min(spread):.0f}-{max(spread):.0f} |")
    lines += ["", "C++ outputs vs Python's, max |diff|: " +
              ", ".join(f"batch {b}: {d:.2e}" for b, d in max_diff.items()), "",
              "The C++ row is TensorFlow's time alone (no RPC); a linked `tensorflow_model_server` adds its own "
              "gRPC layer on top, which was not built here. The gRPC row includes client-side encode/decode.",
              ""]
    report = "\n".join(lines)
    print(report)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    write_results(f"serving_cc_latency_{stamp}", results, report, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
