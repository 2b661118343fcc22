"""Serving load benchmark: `pkm-serve serve` driven by C load generators on loopback,
beside the same SavedModel called in-process.

  make bench-serving            (installs wrk, h2load, py-spy; then runs this)
  .venv/bin/python bench/serving_load.py [--seconds 4] [--profile-seconds 6] [--out bench/results]

Load generators (C, so that the clients cost little of the shared CPU):
  gRPC  h2load (nghttp2-client) POSTing one pre-encoded PredictRequest in gRPC framing
        to /tensorflow.serving.PredictionService/Predict (per-request latencies from
        its --log-file);
  REST  wrk POSTing {"instances": ...} to /v1/models/pkm:predict (its --latency table).
Grid: batching off and on x batch 1 and 64 x 1, 8, 32 connections, each run bounded by
--seconds. For each: QPS, rows/s, p50/p99, server CPU per request (from
/proc/<pid>/stat) and the load generator's CPU per request (getrusage of children).
Every answer is checked: one request of each kind is compared with the in-process
output before the run, and the server's Prometheus request counter must show no
status other than OK after it.
Profile: py-spy samples the server during a gRPC and a REST run (batch 1,
32 connections, batching on); the top frames go into the report.
Everything listens on 127.0.0.1 only. Results: bench/results/serving_<UTC stamp>.{json,md}.
"""
import argparse
import collections
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from harness import ROOT as REPO, machine_info, machine_name, time_calls, write_results

sys.path.insert(0, REPO)
PREDICT_PATH = "/tensorflow.serving.PredictionService/Predict"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles_ms(samples_s):
    a = np.asarray(samples_s, np.float64) * 1e3
    if not a.size:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "n": int(a.size)}


def process_cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK   # utime + stime


def children_cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def need_tool(name, package):
    if shutil.which(name) is None:
        sys.exit(f"serving_load.py: error: `{name}` not found; `make serving-load-tools` installs "
                 f"Debian's {package}")


# ------------------------------------------------------------------ in-process
def in_process(model_path, queries, seconds):
    """The signature run the server runs (a Session callable), without any server."""
    from pkm_serve.serving.servable import Servable
    sig = Servable("pkm", 1, model_path).signature("")
    result = {}
    for batch, q in queries.items():
        inputs = {"query": q}
        timing = time_calls(lambda: sig.run(inputs), 1, warmup=20, budget_s=seconds)
        r = {"latency": percentiles_ms([ms / 1e3 for ms in timing["times_ms"]])}
        for threads in (1, 2, 32):
            count = [0]
            lock = threading.Lock()
            stop_at = time.monotonic() + seconds / 2

            def work():
                n = 0
                while time.monotonic() < stop_at:
                    sig.run(inputs)
                    n += 1
                with lock:
                    count[0] += n

            t0 = time.monotonic()
            ts = [threading.Thread(target=work) for _ in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            r[f"calls_per_s_{threads}_threads"] = count[0] / (time.monotonic() - t0)
        result[f"batch{batch}"] = r
    return result


# ------------------------------------------------------------------ server
class Server:
    def __init__(self, base, extra, work, name):
        self.port, self.rest_port = free_port(), free_port()
        monitoring = os.path.join(work, "monitoring.config")
        with open(monitoring, "w") as f:
            f.write('prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }\n')
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        self.log_path = os.path.join(work, f"server_{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pkm_serve.serving", f"--port={self.port}",
             f"--rest_api_port={self.rest_port}", "--bind_address=127.0.0.1", "--model_name=pkm",
             f"--model_base_path={base}", "--file_system_poll_wait_seconds=0", "--log_level=WARNING",
             f"--monitoring_config_file={monitoring}", *extra],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + 180
        while time.monotonic() < end:
            with open(self.log_path) as f:
                if "pkm-serve: ready" in f.read():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(open(self.log_path).read()[-3000:])
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("server did not start")

    def status_counts(self):
        url = f"http://127.0.0.1:{self.rest_port}/monitoring/prometheus/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        counts = collections.Counter()
        for m in re.finditer(r'^:tensorflow:serving:request_count_total\{[^}]*status="(\w+)"[^}]*\} (\S+)$',
                             text, re.M):
            counts[m[1]] += float(m[2])
        return counts

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def grpc_frame(request):
    payload = request.SerializeToString()
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def check_answers(server, grpc_request, rest_body, expected):
    """One gRPC and one REST request, compared with the in-process output."""
    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_service_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        resp = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(grpc_request, timeout=30)
    np.testing.assert_allclose(tf.make_ndarray(resp.outputs["output"]), expected, rtol=1e-5, atol=1e-6)
    req = urllib.request.Request(f"http://127.0.0.1:{server.rest_port}/v1/models/pkm:predict",
                                 data=rest_body, headers={"Content-Type": "application/json"})
    body = json.loads(urllib.request.urlopen(req, timeout=30).read())
    np.testing.assert_allclose(np.array([p["output"] for p in body["predictions"]]), expected,
                               rtol=1e-5, atol=1e-6)


def run_h2load(server, frame_path, connections, seconds, work):
    log_path = os.path.join(work, "h2load.log")
    if os.path.exists(log_path):
        os.remove(log_path)
    cmd = ["h2load", "-c", str(connections), "-m", "1", "-t", "1", "-D", str(max(1, round(seconds))),
           "-d", frame_path, "-H", "content-type: application/grpc",
           "-H", "te: trailers", f"--log-file={log_path}", f"http://127.0.0.1:{server.port}{PREDICT_PATH}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"h2load failed: {out.stderr[-2000:]}")
    lat, statuses = [], collections.Counter()
    with open(log_path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                statuses[parts[1]] += 1
                lat.append(int(parts[2]) / 1e6)
    m = re.search(r"finished in ([\d.]+)(m?s)", out.stdout)
    wall = float(m[1]) / (1000 if m[2] == "ms" else 1) if m else seconds
    return {"requests": len(lat), "wall_s": wall, "http_statuses": dict(statuses), **percentiles_ms(lat)}


def _wrk_ms(text):
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def run_wrk(server, body_path, connections, seconds, work):
    script = os.path.join(work, "post.lua")
    with open(script, "w") as f:
        f.write(f'local f = io.open("{body_path}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
                'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
    cmd = ["wrk", "-t", "1", "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--latency", "-s", script,
           f"http://127.0.0.1:{server.rest_port}/v1/models/pkm:predict"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr[-2000:]}")
    text = out.stdout
    requests = int(re.search(r"(\d+) requests in ([\d.]+)(m?s)", text)[1])
    m = re.search(r"(\d+) requests in ([\d.]+)(ms|s)", text)
    wall = float(m[2]) / (1000 if m[3] == "ms" else 1)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.*)", text)
    return {"requests": requests, "wall_s": wall,
            "p50_ms": _wrk_ms(re.search(r"^\s+50%\s+(\S+)", text, re.M)[1]),
            "p99_ms": _wrk_ms(re.search(r"^\s+99%\s+(\S+)", text, re.M)[1]),
            "non_2xx": int(non2xx[1]) if non2xx else 0, "socket_errors": errors[1] if errors else None}


def measure(server, run, batch):
    """One bounded run with the server's and the load generator's CPU around it."""
    before_counts = server.status_counts()
    srv0, cli0, t0 = process_cpu_seconds(server.proc.pid), children_cpu_seconds(), time.monotonic()
    r = run()
    srv1, cli1 = process_cpu_seconds(server.proc.pid), children_cpu_seconds()
    after_counts = server.status_counts()
    delta = {k: after_counts[k] - before_counts.get(k, 0) for k in after_counts}
    n = max(r["requests"], 1)
    r.update(qps=r["requests"] / r["wall_s"], rows_per_s=batch * r["requests"] / r["wall_s"],
             server_cpu_ms_per_request=(srv1 - srv0) * 1e3 / n,
             client_cpu_ms_per_request=(cli1 - cli0) * 1e3 / n,
             run_wall_s=time.monotonic() - t0,
             server_statuses={k: int(v) for k, v in delta.items() if v})
    bad = {k: v for k, v in r["server_statuses"].items() if k != "OK"}
    r["failed"] = int(sum(bad.values())) + r.get("non_2xx", 0)
    return r


# ------------------------------------------------------------------ profile
def profile(server, run, seconds, out_path):
    """py-spy samples the server while `run` loads it; returns the top frames."""
    if shutil.which("py-spy") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")):
        return {"error": "py-spy not installed (pip install -r bench/requirements.txt)"}
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    proc = subprocess.Popen([spy, "record", "-p", str(server.proc.pid), "-d", str(max(1, round(seconds))), "-r", "250",
                             "-f", "raw", "-o", out_path, "--nonblocking", "--gil"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)
    run()
    out, _ = proc.communicate(timeout=seconds + 60)
    if proc.returncode != 0 or not os.path.exists(out_path):
        return {"error": f"py-spy failed: {out[-500:]}"}
    return summarize_profile(out_path)


def summarize_profile(path, top=12):
    """Collapsed stacks (sampled with --gil: only the thread holding the GIL, i.e. the
    server's Python work, which one core at most can do) -> the frames that take most."""
    inclusive, leaf = collections.Counter(), collections.Counter()
    busy = total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = [fr.split(" (")[0] + " (" + fr.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                      if " (" in fr else fr for fr in stack.split(";")]
            total += n
            busy += n
            leaf[frames[-1]] += n
            for fr in set(frames):
                inclusive[fr] += n
    def share(c):
        return [{"frame": k, "share_of_busy": v / busy} for k, v in c.most_common(top)] if busy else []
    return {"samples": total, "top_inclusive": share(inclusive), "top_self": share(leaf)}


# ------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="length of each load run")
    p.add_argument("--profile-seconds", type=float, default=6.0)
    p.add_argument("--connections", default="1,8,32")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--max_batch_size", type=int, default=256)
    p.add_argument("--batch_timeout_micros", type=int, default=0)
    p.add_argument("--num_batch_threads", type=int, default=2)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--k_dim", type=int, default=256)
    p.add_argument("--n_keys", type=int, default=512)
    p.add_argument("--knn", type=int, default=32)
    p.add_argument("--v_dim", type=int, default=512)
    p.add_argument("--machine", default=machine_name() + ", shared with parallel builds and tests",
                   help="how to describe the machine in the report")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = p.parse_args(argv)
    need_tool("h2load", "nghttp2-client")
    need_tool("wrk", "wrk")
    connections = [int(c) for c in args.connections.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2
    from pkm_serve import ops
    from pkm_serve.serving.demo_model import save_pkm_model
    ops.load_library()
    work = tempfile.mkdtemp(prefix="pkm_serving_bench_")
    base = os.path.join(work, "pkm")
    shape = dict(d_model=args.d_model, k_dim=args.k_dim, n_keys=args.n_keys, knn=args.knn, v_dim=args.v_dim)
    save_pkm_model(os.path.join(base, "1"), seed=1, **shape)

    rng = np.random.default_rng(0)
    queries = {b: rng.standard_normal((b, args.d_model)).astype(np.float32) for b in batches}
    expected = {b: tf.saved_model.load(os.path.join(base, "1")).signatures["serving_default"](
        query=tf.constant(q))["output"].numpy() for b, q in queries.items()}
    payloads = {}
    for b, q in queries.items():
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "pkm"
        req.inputs["query"].CopyFrom(tf.make_tensor_proto(q))
        frame_path = os.path.join(work, f"predict_b{b}.grpc")
        with open(frame_path, "wb") as f:
            f.write(grpc_frame(req))
        body = json.dumps({"instances": q.tolist()}).encode()
        body_path = os.path.join(work, f"predict_b{b}.json")
        with open(body_path, "wb") as f:
            f.write(body)
        payloads[b] = (req, frame_path, body, body_path)

    load_before = os.getloadavg()
    print("in-process ...", flush=True)
    local = in_process(os.path.join(base, "1"), queries, args.seconds)

    batching_file = os.path.join(work, "batching.config")
    with open(batching_file, "w") as f:
        f.write(f"max_batch_size {{ value: {args.max_batch_size} }}\n"
                f"batch_timeout_micros {{ value: {args.batch_timeout_micros} }}\n"
                f"num_batch_threads {{ value: {args.num_batch_threads} }}\n"
                "max_enqueued_batches { value: 1000 }\n")
    runs, profiles = [], {}
    for mode, extra in (("batching_off", []),
                        ("batching_on", ["--enable_batching", f"--batching_parameters_file={batching_file}"])):
        server = Server(base, extra, work, mode)
        try:
            for b in batches:
                req, frame_path, body, body_path = payloads[b]
                check_answers(server, req, body, expected[b])
                for c in connections:
                    for api, fn in (("gRPC", lambda: run_h2load(server, frame_path, c, args.seconds, work)),
                                    ("REST", lambda: run_wrk(server, body_path, c, args.seconds, work))):
                        r = measure(server, fn, b)
                        r.update(api=api, batching=mode, batch=b, connections=c)
                        runs.append(r)
                        print(f"{mode:13s} {api} batch {b:3d} x{c:2d} conns: {r['qps']:8.0f} qps "
                              f"p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} ms, server "
                              f"{r['server_cpu_ms_per_request']:.3f} CPU-ms/req, failed {r['failed']}",
                              flush=True)
            if mode == "batching_on" and args.profile_seconds > 0:
                req, frame_path, body, body_path = payloads[1]
                for api, fn in (("gRPC", lambda: run_h2load(server, frame_path, 32, args.profile_seconds, work)),
                                ("REST", lambda: run_wrk(server, body_path, 32, args.profile_seconds, work))):
                    print(f"profiling {api} ...", flush=True)
                    profiles[api] = profile(server, fn, args.profile_seconds,
                                            os.path.join(work, f"profile_{api}.txt"))
        finally:
            server.stop()
    results = {
        "runs": runs, "in_process": local, "profiles": profiles, "config": vars(args), "model_shape": shape,
        "machine": {"description": args.machine, "cpus": os.cpu_count(), **machine_info(), "loadavg_1m_before": load_before[0],
                    "loadavg_1m_after": os.getloadavg()[0]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results.update(_legacy_summary(results))
    report = render(results)
    print(report)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    write_results(f"serving_{stamp}", results, report, out_dir=args.out)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["failed"] for r in runs) else 0


def _find(results, **want):
    for r in results["runs"]:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def _legacy_summary(results):
    """The keys bench/report.py reads (in_process.batch1 / saturated, grpc.<mode>.batch1 and
    .concurrent), filled from this run's gRPC numbers."""
    local = results["in_process"]
    inproc = dict(local)
    if "batch1" in local:
        inproc["batch1"] = dict(local["batch1"], **local["batch1"]["latency"])
        inproc["batch1_concurrent_rows_per_s"] = local["batch1"]["calls_per_s_32_threads"]
    inproc["saturated_rows_per_s"] = max(
        v * int(k[5:]) for k, r in local.items() for kk, v in r.items() if kk.startswith("calls_per_s"))
    grpc_ = {}
    for mode in ("batching_off", "batching_on"):
        one = _find(results, api="gRPC", batching=mode, batch=1, connections=1)
        many = _find(results, api="gRPC", batching=mode, batch=1, connections=32)
        grpc_[mode] = {"batch1": one and {"p50_ms": one["p50_ms"], "p99_ms": one["p99_ms"]},
                       "concurrent": many and {"rows_per_s": many["rows_per_s"], "p50_ms": many["p50_ms"],
                                               "p99_ms": many["p99_ms"], "failures": many["failed"]}}
    return {"in_process": inproc, "grpc": grpc_}


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def render(results):
    m, local = results["machine"], results["in_process"]
    lines = [f"# Serving load benchmark ({results['date']})", "",
             f"Model: PKM {results['model_shape']}, fused PkmEmbeddingBag. Machine: {m['description']} "
             f"({m['cpus']} CPUs, {m['platform']}); server and load generator share it over loopback. "
             f"1-minute load average {m['loadavg_1m_before']:.1f} before, {m['loadavg_1m_after']:.1f} after "
             "(other engineers' processes included: expect noise).", "",
             "Load: h2load (gRPC, one pre-encoded PredictRequest) and wrk (REST JSON), "
             f"{results['config']['seconds']:g} s per cell. CPU columns: milliseconds of CPU per request "
             "(server process; load generator).", "",
             "## In-process (the server's own Session callable, no server)", "",
             "| batch | p50 ms | p99 ms | calls/s 1 thread | calls/s 2 threads | calls/s 32 threads |",
             "|---|---|---|---|---|---|"]
    for key, r in local.items():
        if not isinstance(r, dict) or "latency" not in r:
            continue
        lines.append(f"| {key[5:]} | {r['latency']['p50_ms']:.3f} | {r['latency']['p99_ms']:.3f} | "
                     f"{r['calls_per_s_1_threads']:.0f} | {r['calls_per_s_2_threads']:.0f} | "
                     f"{r['calls_per_s_32_threads']:.0f} |")
    lines += ["", "## Server", "",
              "| batching | API | batch | conns | QPS | rows/s | p50 ms | p99 ms | server CPU ms/req | "
              "load-gen CPU ms/req | QPS / in-process 2-thread calls/s | failed |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        ref = local.get(f"batch{r['batch']}", {}).get("calls_per_s_2_threads")
        lines.append(f"| {r['batching'][9:]} | {r['api']} | {r['batch']} | {r['connections']} | {r['qps']:.0f} | "
                     f"{r['rows_per_s']:.0f} | {_f(r['p50_ms'], '.2f')} | {_f(r['p99_ms'], '.2f')} | "
                     f"{r['server_cpu_ms_per_request']:.3f} | {r['client_cpu_ms_per_request']:.3f} | "
                     f"{_f(r['qps'] / ref if ref else None, '.2f')} | {r['failed']} |")
    headline = [_find(results, api=a, batching="batching_on", batch=1, connections=32) for a in ("gRPC", "REST")]
    if all(headline):
        lines += ["", f"**Batch 1, 32 connections, batching on: gRPC {headline[0]['qps']:.0f} QPS, "
                      f"REST {headline[1]['qps']:.0f} QPS.**"]
    for api, prof in results["profiles"].items():
        lines += ["", f"## Profile: {api}, batch 1, 32 connections, batching on (py-spy)", ""]
        if "error" in prof:
            lines.append(f"not profiled: {prof['error']}")
            continue
        lines += [f"{prof['samples']} samples of the thread holding the GIL (py-spy --gil, 250 Hz): "
                  "the server's Python work.", "",
                  "| frame (inclusive) | share of GIL-holding samples |", "|---|---|"]
        lines += [f"| `{e['frame']}` | {e['share_of_busy']:.0%} |" for e in prof["top_inclusive"]]
        lines += ["", "| frame (self) | share of GIL-holding samples |", "|---|---|"]
        lines += [f"| `{e['frame']}` | {e['share_of_busy']:.0%} |" for e in prof["top_self"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
