"""Serving load benchmark: `pkm-serve serve` over gRPC vs the SavedModel called in-process.

  .venv/bin/python bench/serving_load.py [--seconds 8] [--clients 32] [--out bench/results]

Writes a PKM SavedModel (fused PkmEmbeddingBag), then measures, loopback only:
  in-process  batch-1 latency (p50/p99) and saturated throughput (rows/s at the
              best of batch sizes 1..max_batch_size, 1 and 2 calling threads);
  gRPC        batch-1 latency with one client (p50/p99), and throughput with
              --clients concurrent clients sending batch-1 requests, batching
              off and on (TF Serving's BatchingParameters).
Every phase is bounded by a request count and a time limit. Prints ratios
against the in-process numbers and saves JSON + Markdown under --out.
"""
import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(samples_s):
    a = np.asarray(samples_s) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "n": int(a.size)}


# ------------------------------------------------------------------ in-process
def in_process(model_path, d_model, seconds, max_requests, batch_sizes, clients):
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    fn = tf.saved_model.load(model_path).signatures["serving_default"]
    rng = np.random.default_rng(0)
    one = rng.standard_normal((1, d_model)).astype(np.float32)
    for _ in range(50):
        fn(query=one)
    lat = []
    end = time.monotonic() + seconds
    while len(lat) < max_requests and time.monotonic() < end:
        t0 = time.perf_counter()
        fn(query=tf.constant(one))["output"].numpy()
        lat.append(time.perf_counter() - t0)
    result = {"batch1": percentiles(lat), "throughput": {}}
    for bs in batch_sizes:
        q = rng.standard_normal((bs, d_model)).astype(np.float32)
        fn(query=q)
        for threads in (1, 2):
            rows = [0]
            lock = threading.Lock()
            stop_at = time.monotonic() + seconds / 2

            def work():
                n = 0
                while time.monotonic() < stop_at:
                    fn(query=tf.constant(q))["output"].numpy()
                    n += bs
                with lock:
                    rows[0] += n

            t0 = time.monotonic()
            ts = [threading.Thread(target=work) for _ in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            result["throughput"][f"b{bs}_t{threads}"] = rows[0] / (time.monotonic() - t0)
    # The clients' own workload run in-process: `clients` threads calling with batch 1.
    q1 = rng.standard_normal((1, d_model)).astype(np.float32)
    calls = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds / 2

    def batch1_caller():
        n = 0
        while time.monotonic() < stop_at:
            fn(query=tf.constant(q1))["output"].numpy()
            n += 1
        with lock:
            calls[0] += n

    t0 = time.monotonic()
    ts = [threading.Thread(target=batch1_caller) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    result["batch1_concurrent_rows_per_s"] = calls[0] / (time.monotonic() - t0)
    result["saturated_rows_per_s"] = max(result["throughput"].values())
    result["saturated_at"] = max(result["throughput"], key=result["throughput"].get)
    return result


# ------------------------------------------------------------------ server
class Server:
    def __init__(self, base, extra, log_path):
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pkm_serve.serving", f"--port={self.port}", "--model_name=pkm",
             f"--model_base_path={base}", "--file_system_poll_wait_seconds=0", "--log_level=WARNING", *extra],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 180
        while time.monotonic() < end:
            with open(log_path) as f:
                if "pkm-serve: ready" in f.read():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(open(log_path).read()[-3000:])
            time.sleep(0.2)
        raise RuntimeError("server did not start")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def grpc_batch1_latency(target, d_model, seconds, max_requests):
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    q = np.random.default_rng(1).standard_normal((1, d_model)).astype(np.float32)
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.inputs["query"].CopyFrom(tf.make_tensor_proto(q))
    with grpc.insecure_channel(target) as ch:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
        for _ in range(50):
            stub.Predict(req, timeout=30)
        lat = []
        end = time.monotonic() + seconds
        while len(lat) < max_requests and time.monotonic() < end:
            t0 = time.perf_counter()
            resp = stub.Predict(req, timeout=30)
            tf.make_ndarray(resp.outputs["output"])
            lat.append(time.perf_counter() - t0)
    return percentiles(lat)


def grpc_concurrent(target, d_model, clients, seconds, max_requests):
    """`clients` concurrent batch-1 callers on grpc.aio (one event loop keeps client CPU low)."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    q = np.random.default_rng(2).standard_normal((1, d_model)).astype(np.float32)
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    req.inputs["query"].CopyFrom(tf.make_tensor_proto(q))

    async def run():
        async with grpc.aio.insecure_channel(target) as ch:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
            for _ in range(20):
                await stub.Predict(req, timeout=30)
            lat, failures = [], [0]
            end = time.monotonic() + seconds
            budget = [max_requests]

            async def client():
                while time.monotonic() < end and budget[0] > 0:
                    budget[0] -= 1
                    t0 = time.perf_counter()
                    try:
                        await stub.Predict(req, timeout=30)
                        lat.append(time.perf_counter() - t0)
                    except grpc.RpcError:
                        failures[0] += 1

            t0 = time.monotonic()
            await asyncio.gather(*(client() for _ in range(clients)))
            wall = time.monotonic() - t0
            return {"rows_per_s": len(lat) / wall, "failures": failures[0], **percentiles(lat)}

    return asyncio.run(run())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="time limit per phase")
    p.add_argument("--max_requests", type=int, default=20000, help="request limit per phase")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max_batch_size", type=int, default=32)
    p.add_argument("--batch_timeout_micros", type=int, default=0)
    p.add_argument("--num_batch_threads", type=int, default=2)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--k_dim", type=int, default=256)
    p.add_argument("--n_keys", type=int, default=512)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--v_dim", type=int, default=512)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = p.parse_args(argv)

    from pkm_serve.serving.demo_model import save_pkm_model
    work = tempfile.mkdtemp(prefix="pkm_serving_bench_")
    base = os.path.join(work, "pkm")
    shape = dict(d_model=args.d_model, k_dim=args.k_dim, n_keys=args.n_keys, knn=args.knn, v_dim=args.v_dim)
    save_pkm_model(os.path.join(base, "1"), seed=1, **shape)

    load_before = os.getloadavg()
    batch_sizes = sorted({1, 8, args.max_batch_size})
    print("in-process ...", flush=True)
    local = in_process(os.path.join(base, "1"), args.d_model, args.seconds, args.max_requests, batch_sizes,
                       args.clients)

    results = {"in_process": local, "grpc": {}}
    batching_file = os.path.join(work, "batching.config")
    with open(batching_file, "w") as f:
        f.write(f"max_batch_size {{ value: {args.max_batch_size} }}\n"
                f"batch_timeout_micros {{ value: {args.batch_timeout_micros} }}\n"
                f"num_batch_threads {{ value: {args.num_batch_threads} }}\n"
                "max_enqueued_batches { value: 1000 }\n")
    for mode, extra in (("batching_off", []),
                        ("batching_on", ["--enable_batching", f"--batching_parameters_file={batching_file}"])):
        print(f"gRPC server, {mode} ...", flush=True)
        srv = Server(base, extra, os.path.join(work, f"server_{mode}.log"))
        try:
            r = {"batch1": grpc_batch1_latency(f"127.0.0.1:{srv.port}", args.d_model, args.seconds,
                                                args.max_requests)}
            r["concurrent"] = grpc_concurrent(f"127.0.0.1:{srv.port}", args.d_model, args.clients,
                                              args.seconds, args.max_requests)
        finally:
            srv.stop()
        results["grpc"][mode] = r

    sat = local["saturated_rows_per_s"]
    off, on = results["grpc"]["batching_off"], results["grpc"]["batching_on"]
    summary = {
        "batch1_p50_overhead_ms": off["batch1"]["p50_ms"] - local["batch1"]["p50_ms"],
        "throughput_ratio_batching_on": on["concurrent"]["rows_per_s"] / sat,
        "throughput_ratio_batching_off": off["concurrent"]["rows_per_s"] / sat,
        "throughput_ratio_batching_on_vs_in_process_batch1_threads":
            on["concurrent"]["rows_per_s"] / local["batch1_concurrent_rows_per_s"],
    }
    summary["batch1_target_met"] = summary["batch1_p50_overhead_ms"] <= 1.0
    summary["throughput_target_met"] = summary["throughput_ratio_batching_on"] >= 0.8
    results.update(summary=summary, config=vars(args), model_shape=shape,
                   machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(),
                            "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0]},
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    lines = [
        f"# Serving load benchmark ({results['date']})", "",
        f"Model: PKM, {shape}, fused PkmEmbeddingBag. Machine: {os.cpu_count()} CPUs, "
        "server and clients on the same machine (loopback); 1-minute load average "
        f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (other processes included).", "",
        "| what | p50 ms | p99 ms | rows/s |", "|---|---|---|---|",
        f"| in-process, batch 1 | {local['batch1']['p50_ms']:.3f} | {local['batch1']['p99_ms']:.3f} | - |",
        f"| in-process, saturated ({local['saturated_at']}: batch b, t threads) | - | - | {sat:.0f} |",
        f"| in-process, {args.clients} threads calling with batch 1 | - | - | "
        f"{local['batch1_concurrent_rows_per_s']:.0f} |",
    ]
    for mode in ("batching_off", "batching_on"):
        r = results["grpc"][mode]
        lines.append(f"| gRPC {mode}, 1 client, batch 1 | {r['batch1']['p50_ms']:.3f} | {r['batch1']['p99_ms']:.3f} | - |")
        c = r["concurrent"]
        lines.append(f"| gRPC {mode}, {args.clients} clients, batch 1 | {c['p50_ms']:.3f} | {c['p99_ms']:.3f} | "
                     f"{c['rows_per_s']:.0f} (failures {c['failures']}) |")
    lines += ["",
              f"- batch-1 gRPC p50 - in-process p50 = {summary['batch1_p50_overhead_ms']:.3f} ms "
              f"(target <= 1 ms: {'met' if summary['batch1_target_met'] else 'NOT met'})",
              f"- {args.clients}-client throughput / in-process saturated: batching on "
              f"{summary['throughput_ratio_batching_on']:.2f}, off {summary['throughput_ratio_batching_off']:.2f} "
              f"(target >= 0.80 with batching: {'met' if summary['throughput_target_met'] else 'NOT met'})",
              f"- {args.clients}-client throughput with batching / the same {args.clients} batch-1 callers "
              f"in-process: {summary['throughput_ratio_batching_on_vs_in_process_batch1_threads']:.2f}"]
    report = "\n".join(lines) + "\n"
    print(report)
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    with open(os.path.join(args.out, f"serving_{stamp}.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, f"serving_{stamp}.md"), "w") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
