"""`pkm-serve demo`: the whole path, end to end, on CPU, in a few minutes.

1. build a small Product-Key-Memory model written the way users write it
   today, with the *composite* gather -> multiply -> reduce_sum, and save it;
2. `pkm-serve export` fuses it into the PkmEmbeddingBag op (prints the report)
   and writes the serving SavedModel plus fp32 and int8 `.tflite` files;
3. `pkm-serve serve` starts on free localhost ports; TF Serving's own client
   stubs (gRPC) and its REST API query it;
4. LiteRT runs the `.tflite` files with our delegate;
5. one table compares outputs, latency and memory across the five paths;
6. the server is shut down (SIGTERM, drained).

Exit code 0 only if every path agrees with the original model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from pkm_serve._memory import peak_rss_growth, status_bytes
from pkm_serve.product_keys import product_key_search

STEPS = 6


def _step(i: int, text: str):
    print(f"\n[{i}/{STEPS}] {text}", flush=True)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 1. the model, written with the composite ---------------------------------

def build_composite_pkm(tf, d_model=64, k_dim=32, n_keys=256, heads=4, knn=32, v_dim=256, seed=0):
    """A PKM read (Lample et al. 2019) whose value lookup is the composite
    gather * w -> reduce_sum: what the export tool is for."""
    rng = np.random.default_rng(seed)
    half = k_dim // 2

    class CompositePkm(tf.Module):
        def __init__(self):
            super().__init__()
            self.query_proj = tf.Variable(
                rng.normal(0, d_model ** -0.5, (d_model, heads * k_dim)).astype(np.float32), name="query_proj")
            self.sub_keys = tf.Variable(
                rng.uniform(-half ** -0.5, half ** -0.5, (heads, 2, n_keys, half)).astype(np.float32),
                name="sub_keys")
            self.values = tf.Variable(
                rng.normal(0, v_dim ** -0.5, (n_keys * n_keys, v_dim)).astype(np.float32), name="values")

        @tf.function(input_signature=[tf.TensorSpec([None, d_model], tf.float32, name="query")])
        def serve(self, query):
            batch = tf.shape(query)[0]
            q = tf.reshape(tf.matmul(query, self.query_proj), [batch, heads, 2, half])
            indices, weights = product_key_search(q, self.sub_keys, knn)   # [b, heads*knn] each
            # The composite EmbeddingBag: materialises [batch, heads*knn, v_dim].
            rows = tf.gather(self.values, indices)
            return {"output": tf.reduce_sum(rows * weights[..., None], axis=-2)}

    return CompositePkm()


# ---- the demo -------------------------------------------------------------------

def _positive_int(text: str) -> int:
    """--batch 0 ended in 'HTTP Error 400', --repeats 0 in 'no median for empty data', after
    the whole export."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _workdir(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    if os.path.exists(os.path.join(text, "models", "pkm", "1")):
        # The export refused it after the model was built: "pick another --version", a flag
        # the demo does not have.
        raise argparse.ArgumentTypeError(f"{text} holds an earlier demo's models/pkm/1: pass a new "
                                         "or empty --workdir")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags; importing this module does not import TensorFlow."""
    ap = argparse.ArgumentParser(prog="pkm-serve demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=_workdir, help="where models are written (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--batch", type=_positive_int, default=64, help="queries per request (latency rows)")
    ap.add_argument("--memory-batch", type=_positive_int, default=2048,
                    help="queries per call for the memory column (the composite materialises "
                         "batch x 128 x 256 floats)")
    ap.add_argument("--repeats", type=_positive_int, default=20)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    workdir = args.workdir or tempfile.mkdtemp(prefix="pkm_demo_")
    os.makedirs(workdir, exist_ok=True)
    children = []  # processes to stop whatever happens
    try:
        return 0 if _run(args, workdir, children) else 1
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args, workdir, children) -> bool:
    t_start = time.perf_counter()
    import tensorflow as tf

    from pkm_serve import ops

    ops.load_library()
    rng = np.random.default_rng(1)
    query = rng.standard_normal((args.batch, 64)).astype(np.float32)
    big_query = rng.standard_normal((args.memory_batch, 64)).astype(np.float32)

    _step(1, "build a PKM model written with the composite gather -> multiply -> reduce_sum, and save it")
    original_dir = _save_composite_model(tf, workdir)

    _step(2, "pkm-serve export: fuse the composite sites, verify, write the serving SavedModel and .tflite files")
    exported = _export(original_dir, workdir, args.memory_batch)
    if exported is None:
        return False
    result, models_dir, tflite_paths = exported
    ref, rows = _tf_rows(tf, original_dir, result.dst, query, big_query, args.repeats)

    _step(3, "pkm-serve serve on free localhost ports; query it with TF Serving's client stubs and REST")
    server, served_rows = _serve_rows(tf, models_dir, workdir, children, query, args.repeats)
    rows += served_rows

    _step(4, "LiteRT runs the .tflite files with the pkm_serve delegate (fp32 and int8 table)")
    rows += _tflite_rows(tflite_paths, query, args.repeats)

    _step(5, "compare")
    ok = _print_table(rows, ref, result)

    _step(6, "shut the server down (SIGTERM: drains in-flight requests)")
    ok = _shut_down(server) and ok
    print(f"\nDemo {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - t_start:.0f} s "
          f"(work directory {workdir})")
    return ok


# Each phase below returns its table rows: (path, outputs, latency ms, memory bytes, note).

def _save_composite_model(tf, workdir) -> str:
    original_dir = os.path.join(workdir, "original")
    model = build_composite_pkm(tf)
    tf.saved_model.save(model, original_dir, signatures={"serving_default": model.serve})
    print(f"      saved {original_dir} (value table 65536 x 256 float32, 4 heads x top-32 = 128 rows per query)")
    return original_dir


def _export(original_dir, workdir, batch_size):
    """-> (export result, serving models dir, [(label, .tflite path)]), or None if nothing fused."""
    from pkm_serve import tflite as pkm_tflite
    from pkm_serve.export import exporter

    models_dir = os.path.join(workdir, "models", "pkm")
    tflite_fp32 = os.path.join(workdir, "pkm_fp32.tflite")
    tflite_int8 = os.path.join(workdir, "pkm_int8.tflite")
    result = exporter.export_saved_model(original_dir, models_dir, version=1, tflite=tflite_fp32,
                                         batch_size=batch_size)
    print(exporter.format_report(result))
    if not result.fused:
        print("FAILED: the export fused no site")
        return None
    with open(tflite_fp32, "rb") as f:
        int8_bytes = pkm_tflite.quantize_table_int8(f.read())
    with open(tflite_int8, "wb") as f:
        f.write(int8_bytes)
    return result, models_dir, [("TFLite fp32 (LiteRT + delegate)", tflite_fp32),
                                ("TFLite int8 table (LiteRT + delegate)", tflite_int8)]


def _tf_rows(tf, original_dir, fused_dir, query, big_query, repeats):
    """The original and the fused SavedModel in this process -> (reference output, rows)."""
    original = tf.saved_model.load(original_dir).signatures["serving_default"]
    fused = tf.saved_model.load(fused_dir).signatures["serving_default"]
    memory = {}
    with peak_rss_growth(memory, "original"):
        original(query=tf.constant(big_query))
    with peak_rss_growth(memory, "fused"):
        fused(query=tf.constant(big_query))
    ref = original(query=tf.constant(query))["output"].numpy()
    return ref, [
        ("original composite (TF)", ref,
         _median_ms(lambda: original(query=tf.constant(query)), repeats), memory["original"], ""),
        ("fused op (TF SavedModel)", fused(query=tf.constant(query))["output"].numpy(),
         _median_ms(lambda: fused(query=tf.constant(query)), repeats), memory["fused"], ""),
    ]


def _serve_rows(tf, models_dir, workdir, children, query, repeats):
    """Starts the server (left running, in `children`) and queries it -> (server, rows)."""
    grpc_port, rest_port = _free_port(), _free_port()
    server_log_path = os.path.join(workdir, "server.log")
    with open(server_log_path, "w") as server_log:  # a file, not a pipe nobody drains
        server = subprocess.Popen(
            [sys.executable, "-m", "pkm_serve.serving", f"--port={grpc_port}", f"--rest_api_port={rest_port}",
             "--model_name=pkm", f"--model_base_path={models_dir}"],
            stdout=server_log, stderr=subprocess.STDOUT)
    children.append(server)
    served, served_ms, rest_out = _query_server(tf, server, server_log_path, grpc_port, rest_port, query,
                                                repeats)
    try:
        server_rss = status_bytes("VmHWM", pid=server.pid)
    except (OSError, KeyError):
        server_rss = None
    return server, [("served: gRPC Predict", served, served_ms, server_rss, "server process peak RSS"),
                    ("served: REST :predict", rest_out, float("nan"), None, "same server")]


def _tflite_rows(tflite_paths, query, repeats):
    from pkm_serve import tflite as pkm_tflite

    rows = []
    for label, path in tflite_paths:
        interp = pkm_tflite.make_interpreter(path, interpreter="litert", num_threads=2)
        inp = interp.get_input_details()[0]
        interp.resize_tensor_input(inp["index"], list(query.shape))
        mem = {}
        with peak_rss_growth(mem, "tfl"):
            interp.allocate_tensors()
            interp.set_tensor(inp["index"], query)
            interp.invoke()
        out_index = interp.get_output_details()[0]["index"]

        def invoke(interp=interp, inp=inp):
            interp.set_tensor(inp["index"], query)
            interp.invoke()

        ms = _median_ms(invoke, repeats)
        size = os.path.getsize(path)
        rows.append((label, interp.get_tensor(out_index).copy(), ms, mem["tfl"],
                     f"model file {size / 2**20:.0f} MiB (memory-mapped: table pages count once read)"))
    return rows


def _shut_down(server) -> bool:
    server.terminate()
    try:
        code = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        code = "killed after 30 s"
    print(f"      server exited with {code}")
    return code == 0


def _query_server(tf, server, server_log_path, grpc_port, rest_port, query, repeats):
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}",
                               options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        return _query_over_channel(tf, server, server_log_path, channel, grpc_port, rest_port, query, repeats)


def _query_over_channel(tf, server, server_log_path, channel, grpc_port, rest_port, query, repeats):
    import grpc
    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    status_stub = model_service_pb2_grpc.ModelServiceStub(channel)
    deadline = time.time() + 120
    while True:  # wait until the model is AVAILABLE
        if server.poll() is not None:
            with open(server_log_path) as f:
                raise RuntimeError("the server exited during start-up:\n" + f.read())
        try:
            req = get_model_status_pb2.GetModelStatusRequest()
            req.model_spec.name = "pkm"
            status = status_stub.GetModelStatus(req, timeout=2)
            if any(v.state == v.AVAILABLE for v in status.model_version_status):
                break
        except grpc.RpcError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the server did not make the model available within 120 s")
        time.sleep(0.3)
    print(f"      model 'pkm' version 1 AVAILABLE on 127.0.0.1:{grpc_port} (gRPC) and :{rest_port} (REST)")

    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "pkm"
    request.model_spec.signature_name = "serving_default"
    request.inputs["query"].CopyFrom(tf.make_tensor_proto(query))

    def predict():
        return stub.Predict(request, timeout=30)

    served = tf.make_ndarray(predict().outputs["output"])
    ms = _median_ms(predict, repeats)
    body = json.dumps({"inputs": {"query": query.tolist()}}).encode()
    http = urllib.request.Request(f"http://127.0.0.1:{rest_port}/v1/models/pkm:predict", data=body,
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(http, timeout=30) as resp:
        payload = json.loads(resp.read())
    outputs = payload["outputs"]
    rest_out = np.asarray(outputs["output"] if isinstance(outputs, dict) else outputs, np.float32)
    return served, ms, rest_out


def _print_table(rows, ref, result) -> bool:
    scale = float(np.max(np.abs(ref))) or 1.0
    header = f"{'path':40s} {'max |diff| vs original':>24s} {'agree':>6s} {'latency ms':>11s} {'memory':>12s}  note"
    print(header)
    print("-" * len(header))
    ok = True
    for label, out, ms, mem, note in rows:
        out = np.asarray(out, np.float32).reshape(ref.shape)
        diff = float(np.max(np.abs(out - ref)))
        tol = 0.02 * scale if "int8" in label else 1e-4 * scale  # int8 table: within 2% of the output range
        agree = diff <= tol
        ok &= agree
        mem_s = f"{mem / 2**20:,.0f} MiB" if mem is not None else "-"
        ms_s = f"{ms:.2f}" if ms == ms else "-"
        print(f"{label:40s} {diff:24.3g} {'yes' if agree else 'NO':>6s} {ms_s:>11s} {mem_s:>12s}  {note}")
    saved = sum(s.saved_bytes_at_batch or 0 for s in result.fused)
    print(f"\nmemory = growth of the process's peak RSS for one call at batch {result.batch_size} "
          f"(TF rows) or while allocating and invoking (TFLite rows); the export report says the "
          f"fused model no longer materialises {saved / 2**20:,.0f} MiB at that batch.")
    return ok


if __name__ == "__main__":
    sys.exit(main())
