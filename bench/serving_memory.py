"""Server memory for one PKM/recommender table model served three ways by `pkm-serve serve`.

    .venv/bin/python bench/serving_memory.py [--rows 524288 --dim 256 --bag 32]   # 512 MiB fp32 table
        [--int8-saved-model DIR] [--repeats 2] [--requests 200] [--batch 64] [--machine TEXT]

The source is a composite SavedModel (tf.gather(table, idx) * w[..., None] -> reduce_sum)
with an N x D fp32 table. From it:
  fp32_savedmodel   `pkm-serve export SRC A`: the fused fp32 SavedModel A/1
  int8_savedmodel   `pkm-serve export SRC B --tflite T --quantize-table int8`: B/1, whose
                    fused op reads the table as per-row int8 (or --int8-saved-model DIR,
                    a base directory with numeric versions)
  int8_tflite       T moved to B/1/model.tflite, served with --prefer_tflite_model=true:
                    the per-row int8 table through LiteRT and the pkm_serve delegate
  baseline          a 16-row model: what the server process costs without a table
Each configuration is one server process (gRPC only, batching off): RSS after load and
warmup, then after --requests Predict calls of --batch bags (p50 latency too), and the
peak (VmHWM); answers are checked against numpy on the fp32 table (int8: within 2% of
the output scale). Configurations alternate within each of --repeats rounds, so slow
phases of a shared machine hit every configuration. Writes
bench/results/serving_memory_<machine>_<UTC stamp>.{json,md}.
"""
import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
MiB = 1 << 20

WRITE_SOURCE = r"""
import sys, numpy as np, tensorflow as tf
path, rows, dim, bag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
class Table(tf.Module):
    def __init__(self):
        super().__init__()
        self.table = tf.Variable(np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32))
    @tf.function(input_signature=[tf.TensorSpec([None, bag], tf.int32, name="indices"),
                                  tf.TensorSpec([None, bag], tf.float32, name="weights")])
    def serve(self, indices, weights):
        return {"output": tf.reduce_sum(tf.gather(self.table, indices) * weights[..., None], axis=1)}
m = Table()
tf.saved_model.save(m, path, signatures={"serving_default": m.serve})
"""


def machine_name():
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def run(cmd, log):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if "error" in x.lower()]
    return proc.returncode, time.monotonic() - t0, (lines[-1] if lines else proc.stderr.strip()[-300:])


def prepare(args, work, log):
    """The model directories, by configuration (None + reason where one cannot be made)."""
    py, cli = sys.executable, [sys.executable, "-m", "pkm_serve.cli"]
    src, tiny = os.path.join(work, "src"), os.path.join(work, "tiny_src")
    for path, rows in ((src, args.rows), (tiny, 16)):
        rc, _, err = run([py, "-c", WRITE_SOURCE, path, str(rows), str(args.dim), str(args.bag)], log)
        if rc:
            raise SystemExit(f"writing {path} failed: {err}")
    fp32, int8, tiny_out = (os.path.join(work, name) for name in ("fp32", "int8", "tiny"))
    for stale in (fp32, int8, tiny_out):  # a reused --work must not serve an older version
        shutil.rmtree(stale, ignore_errors=True)
    rc, secs, err = run(cli + ["export", src, fp32], log)
    if rc:
        raise SystemExit(f"export of the fp32 SavedModel failed: {err}")
    dirs = {"fp32_savedmodel": (fp32, []), "_export_seconds": secs}
    # One int8 export gives both int8 servables: the SavedModel with int8 rows, and the
    # .tflite (written beside DST, then moved into its version directory: the exporter
    # writes DST/<version> by renaming a temporary, so that directory must not exist yet).
    tfl = os.path.join(work, "model.tflite")
    rc, _, err = run(cli + ["export", src, int8, "--tflite", tfl, "--quantize-table", "int8"], log)
    if rc:
        raise SystemExit(f"export of the int8 SavedModel + int8 .tflite failed: {err}")
    os.replace(tfl, os.path.join(int8, "1", "model.tflite"))
    dirs["int8_tflite"] = (int8, ["--prefer_tflite_model=true"])
    dirs["int8_savedmodel"] = (os.path.abspath(args.int8_saved_model) if args.int8_saved_model else int8, [])
    if run(cli + ["export", tiny, tiny_out], log)[0] == 0:
        dirs["baseline"] = (tiny_out, [])
    return dirs


def request_for(batch, bag, rows, rng):
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow_serving.apis import predict_pb2
    idx = rng.integers(0, rows, size=(batch, bag)).astype(np.int32)
    w = rng.random((batch, bag)).astype(np.float32)
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "pkm"
    for key, arr, dt in (("indices", idx, types_pb2.DT_INT32), ("weights", w, types_pb2.DT_FLOAT)):
        t = tensor_pb2.TensorProto(dtype=dt, tensor_content=arr.tobytes())
        for d in arr.shape:
            t.tensor_shape.dim.add(size=d)
        req.inputs[key].CopyFrom(t)
    return req, idx, w


def expected_output(rows, dim, idx, w):
    table = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    return np.einsum("bk,bkd->bd", w.astype(np.float64), table[idx].astype(np.float64))


def measure(config, base, extra, args, req, want, work):
    import grpc
    from tensorflow_serving.apis import prediction_service_pb2_grpc
    port, log_path = free_port(), os.path.join(work, f"server_{config}.log")
    cmd = [sys.executable, "-m", "pkm_serve.serving", f"--port={port}", "--model_name=pkm",
           f"--model_base_path={base}", "--file_system_poll_wait_seconds=0", "--log_level=WARNING", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"))
        t0 = time.monotonic()
        try:
            while "pkm-serve: ready" not in open(log_path).read():
                if proc.poll() is not None or time.monotonic() - t0 > 600:
                    raise RuntimeError(f"{config}: server did not start: {open(log_path).read()[-2000:]}")
                time.sleep(0.2)
            ready_s = time.monotonic() - t0
            idle = proc_status(proc.pid)
            lat = []
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = prediction_service_pb2_grpc.PredictionServiceStub(ch)
                for _ in range(args.requests):
                    t = time.perf_counter()
                    resp = stub.Predict(req, timeout=60)
                    lat.append(time.perf_counter() - t)
            out = np.frombuffer(resp.outputs["output"].tensor_content, "<f4") \
                if resp.outputs["output"].tensor_content else np.array(resp.outputs["output"].float_val, np.float32)
            err = float(np.max(np.abs(out.reshape(want.shape) - want)) / np.max(np.abs(want)))
            busy = proc_status(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if err > (2e-2 if "int8" in config else 1e-5):
        raise RuntimeError(f"{config}: answer off by {err:.3g} of the output scale")
    return {"config": config, "ready_s": ready_s, "idle": idle, "after_requests": busy,
            "p50_ms": 1e3 * float(np.median(lat)), "max_err_rel": err}


def render(result):
    lines = [f"# Server memory, one {result['table_mib']:.0f} MiB-table model served three ways",
             "", f"Machine: {result['machine']}. Latencies on a shared machine are noisy; RSS is not.",
             f"Model: N={result['rows']} D={result['dim']} fp32 table, K={result['bag']}; "
             f"{result['requests']} gRPC Predict calls of batch {result['batch']} per run; "
             f"{result['repeats']} interleaved rounds. Command: `{result['command']}`.", "",
             "| configuration | round | ready s | RSS idle MiB | RSS after requests MiB | peak MiB "
             "| anon / file MiB | p50 ms | max err / scale |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "skipped" in r:
            lines.append(f"| {r['config']} | - | {r['skipped']} | | | | | | |")
            continue
        a = r["after_requests"]
        lines.append(f"| {r['config']} | {r['round']} | {r['ready_s']:.1f} | {r['idle']['VmRSS'] / MiB:.0f} | "
                     f"{a['VmRSS'] / MiB:.0f} | {a['VmHWM'] / MiB:.0f} | {a['RssAnon'] / MiB:.0f} / "
                     f"{a['RssFile'] / MiB:.0f} | {r['p50_ms']:.2f} | {r['max_err_rel']:.1e} |")
    base = [r for r in result["runs"] if r["config"] == "baseline" and "skipped" not in r]
    if base:
        b = base[-1]["after_requests"]["VmRSS"]
        lines += ["", "Model cost (RSS after requests minus the baseline's, last round): " + ", ".join(
            f"{r['config']} {(r['after_requests']['VmRSS'] - b) / MiB:.0f} MiB"
            for r in result["runs"] if r.get("round") == result["repeats"] and r["config"] != "baseline")]
    lines += ["", "Sizes on disk: " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in result["sizes"].items()),
              "", "Baseline is a 16-row model: the server's own cost (Python, TensorFlow, gRPC)."]
    return "\n".join(lines) + "\n"


def dir_bytes(path, only=None):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            if only is None or f == only:
                total += os.path.getsize(os.path.join(root, f))
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=524288)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--bag", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--int8-saved-model", default="", help="an int8-table SavedModel base directory")
    p.add_argument("--machine", default="")
    p.add_argument("--work", default="", help="scratch directory (default: a new one under /tmp)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    import tempfile
    work = args.work or tempfile.mkdtemp(prefix="pkm-serving-memory-")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "prepare.log")
    dirs = prepare(args, work, log)
    requests = {}
    for rows in (args.rows, 16):   # (the baseline's table has 16 rows)
        req, idx, w = request_for(args.batch, args.bag, rows, np.random.default_rng(1))
        requests[rows] = (req, expected_output(rows, args.dim, idx, w))
    runs = []
    order = [c for c in ("baseline", "fp32_savedmodel", "int8_tflite", "int8_savedmodel") if c in dirs]
    for rnd in range(1, args.repeats + 1):
        for config in order:
            base, extra = dirs[config]
            if base is None:
                if rnd == 1:
                    runs.append({"config": config, "skipped": extra})
                continue
            r = measure(config, base, extra, args, *requests[16 if config == "baseline" else args.rows], work)
            r["round"] = rnd
            runs.append(r)
            print(f"{config} round {rnd}: RSS {r['after_requests']['VmRSS'] / MiB:.0f} MiB, "
                  f"p50 {r['p50_ms']:.2f} ms", flush=True)
    fp32, int8 = dirs["fp32_savedmodel"][0], dirs["int8_tflite"][0]
    sizes = {"fp32 variables": dir_bytes(os.path.join(fp32, "1", "variables")),
             "int8 model.tflite": dir_bytes(int8, "model.tflite"),
             "int8 SavedModel variables": dir_bytes(os.path.join(dirs["int8_savedmodel"][0], "1", "variables"))}
    machine = args.machine or machine_name()
    result = {"machine": machine, "rows": args.rows, "dim": args.dim, "bag": args.bag, "batch": args.batch,
              "requests": args.requests, "repeats": args.repeats, "table_mib": args.rows * args.dim * 4 / MiB,
              "export_seconds": dirs["_export_seconds"], "sizes": sizes, "runs": runs,
              "command": "python bench/serving_memory.py " + " ".join(
                  shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
    stem = os.path.join(args.out, f"serving_memory_{slug(machine.split(',')[0])}_{stamp}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(render(result))
    print(render(result))
    print(f"wrote {stem}.md/.json (scratch {work})")


if __name__ == "__main__":
    main()
