"""Runs in a fresh venv where `pip install dist/pkm_serve-*.whl[serving,tflite]` is the only
install of pkm_serve (`make wheel-check`): the README's habits must work there, with nothing
of the checkout on sys.path.

1. the README's 30-second tour (fused op, gradient, ragged bags, composite) against numpy;
2. a .keras round trip with both layers, reloaded in a fresh process that only does
   `import pkm_serve`;
3. `pkm-serve export` of a composite SavedModel (+ --tflite), the fused SavedModel reloaded in
   a fresh process and the .tflite run through the installed delegate;
4. `pkm-serve serve` of the export, queried over REST and gRPC, then stopped with SIGTERM.

Exits 0 only if every step agrees with its reference; prints one line per step.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

import numpy as np

BIN = os.path.dirname(sys.executable)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step(name):
    print(f"[wheel-check] {name}", flush=True)


def fresh_python(script, *args):
    """A new interpreter: nothing imported but what `script` imports."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise SystemExit(f"fresh process failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def numpy_bag(table, idx, w=None):
    w = np.ones(idx.shape) if w is None else w
    out = np.zeros((idx.shape[0], table.shape[1]))
    for b in range(idx.shape[0]):
        keep = idx[b] >= 0
        out[b] = (w[b][keep, None] * table[idx[b][keep]].astype(np.float64)).sum(0)
    return out


def check_installed():
    import pkm_serve
    here = os.path.dirname(pkm_serve.__file__)
    if not here.startswith(sys.prefix) or any(
            os.path.realpath(p or os.getcwd()) == CHECKOUT for p in sys.path):
        raise SystemExit(f"pkm_serve comes from {here}, not from the installed wheel")
    for lib in ("_pkm_ops.so", "libpkm_tflite.so"):
        if not os.path.exists(os.path.join(here, "lib", lib)):
            raise SystemExit(f"the wheel lacks lib/{lib}")
    step(f"installed package: {here}")


def check_readme_tour():
    import tensorflow as tf
    from pkm_serve import ops

    table = tf.Variable(tf.random.normal([65536, 512]))
    idx = tf.constant([[3, 17, -1], [42, 42, 7]])
    w = tf.constant([[0.5, 0.5, 0.0], [1.0, 2.0, 1.0]])
    out = ops.embedding_bag(table, idx, w, combiner="sum")
    np.testing.assert_allclose(out.numpy(), numpy_bag(table.numpy(), idx.numpy(), w.numpy()),
                               rtol=1e-5, atol=1e-5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ops.embedding_bag(table, idx, w, combiner="mean") ** 2)
    grad = tape.gradient(loss, table)
    assert isinstance(grad, tf.Tensor) and grad.shape == (65536, 512), type(grad)
    ragged = ops.embedding_bag(table, tf.ragged.constant([[1, 2], [], [3, 4, 5]]))
    t = table.numpy().astype(np.float64)
    np.testing.assert_allclose(ragged.numpy(), np.stack([t[1] + t[2], np.zeros(512),
                                                         t[3] + t[4] + t[5]]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.embedding_bag_composite(table, idx, w).numpy(), out.numpy(),
                               rtol=1e-5, atol=1e-5)
    step("README tour: fused op, dense gradient, ragged bags and composite agree with numpy")


def check_keras_round_trip(work):
    import keras
    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(0)
    x_in = keras.Input((16,))
    bag_in = keras.Input((4,), dtype="int64")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=6, heads=2, knn=3)(x_in) + \
        EmbeddingBag(40, 8, combiner="mean")(bag_in)
    model = keras.Model([x_in, bag_in], y)
    rng = np.random.default_rng(0)
    x, bags = rng.standard_normal((5, 16)).astype(np.float32), rng.integers(-1, 40, (5, 4))
    path = os.path.join(work, "m.keras")
    model.save(path)
    np.savez(os.path.join(work, "keras_in.npz"), x=x, bags=bags)
    fresh_python("""
        import sys, numpy as np
        import pkm_serve
        import keras
        d = np.load(sys.argv[2])
        model = keras.models.load_model(sys.argv[1])
        np.save(sys.argv[3], model([d["x"], d["bags"]], training=False).numpy())
    """, path, os.path.join(work, "keras_in.npz"), os.path.join(work, "keras_out.npy"))
    np.testing.assert_allclose(np.load(os.path.join(work, "keras_out.npy")),
                               model([x, bags], training=False).numpy(), rtol=1e-6, atol=1e-6)
    step(".keras round trip: reloaded in a fresh process with only `import pkm_serve`")


def composite_saved_model(work):
    import tensorflow as tf

    table = np.random.default_rng(1).standard_normal((1000, 32)).astype(np.float32)

    class Composite(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.int32),
                                      tf.TensorSpec([None, 6], tf.float32)])
        def serve(self, indices, weights):
            rows = tf.gather(self.table, indices)
            return {"out": tf.reduce_sum(rows * weights[..., None], axis=1)}

    module = Composite()
    src = os.path.join(work, "composite")
    tf.saved_model.save(module, src, signatures={"serving_default": module.serve})
    return src, table


def check_export(work):
    src, table = composite_saved_model(work)
    dst, tfl = os.path.join(work, "served"), os.path.join(work, "pkm.tflite")
    proc = subprocess.run([os.path.join(BIN, "pkm-serve"), "export", src, dst, "--tflite", tfl],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"pkm-serve export failed:\n{proc.stdout}\n{proc.stderr}")
    if "1 fused" not in proc.stdout:
        raise SystemExit(f"pkm-serve export fused nothing:\n{proc.stdout}")
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 1000, (7, 6)).astype(np.int32)
    w = rng.uniform(0.5, 1.5, (7, 6)).astype(np.float32)
    np.savez(os.path.join(work, "export_in.npz"), idx=idx, w=w)
    out = fresh_python("""
        import json, sys, numpy as np
        import pkm_serve
        import tensorflow as tf
        d = np.load(sys.argv[2])
        model = tf.saved_model.load(sys.argv[1])
        fn = model.signatures["serving_default"]
        ops = sorted({n.op for f in fn.graph.as_graph_def().library.function for n in f.node_def}
                     | {n.op for n in fn.graph.as_graph_def().node})
        out = fn(indices=tf.constant(d["idx"]), weights=tf.constant(d["w"]))["out"].numpy()
        np.save(sys.argv[3], out)
        print(json.dumps({"fused": "PkmEmbeddingBag" in ops}))
    """, os.path.join(dst, "1"), os.path.join(work, "export_in.npz"),
        os.path.join(work, "export_out.npy"))
    assert json.loads(out.strip().splitlines()[-1]) == {"fused": True}, out
    want = numpy_bag(table, idx, w)
    np.testing.assert_allclose(np.load(os.path.join(work, "export_out.npy")), want,
                               rtol=1e-5, atol=1e-5)
    from pkm_serve import tflite
    names = [d["name"] for d in tflite.make_interpreter(tfl).get_input_details()]
    by_name = {n: (idx if "indices" in n else w) for n in names}  # serving_default_<input>:0
    got = tflite.run_tflite(tfl, by_name)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    step("pkm-serve export: site fused; SavedModel reloaded with `import pkm_serve`; "
         ".tflite through the installed delegate; both equal numpy")
    return dst, idx, w, want


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_serve(base, idx, w, want):
    grpc_port, rest_port = free_port(), free_port()
    server = subprocess.Popen([os.path.join(BIN, "pkm-serve"), "serve", f"--port={grpc_port}",
                               f"--rest_api_port={rest_port}", "--model_name=pkm",
                               f"--model_base_path={base}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status_url = f"http://127.0.0.1:{rest_port}/v1/models/pkm"
        deadline = time.time() + 180
        while True:
            if server.poll() is not None:
                raise SystemExit(f"pkm-serve serve exited early:\n{server.stdout.read()}")
            try:
                status = json.load(urllib.request.urlopen(status_url, timeout=5))
                if any(v.get("state") == "AVAILABLE" for v in status["model_version_status"]):
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("pkm-serve serve: model not AVAILABLE within 180 s")
            time.sleep(0.5)
        body = json.dumps({"inputs": {"indices": idx.tolist(), "weights": w.tolist()}}).encode()
        reply = json.load(urllib.request.urlopen(urllib.request.Request(
            status_url + ":predict", data=body, headers={"Content-Type": "application/json"}),
            timeout=30))
        np.testing.assert_allclose(np.asarray(reply["outputs"]), want, rtol=1e-5, atol=1e-5)

        import grpc
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "pkm"
        request.inputs["indices"].CopyFrom(tf.make_tensor_proto(idx))
        request.inputs["weights"].CopyFrom(tf.make_tensor_proto(w))
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=30)
        np.testing.assert_allclose(tf.make_ndarray(response.outputs["out"]), want,
                                   rtol=1e-5, atol=1e-5)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    if code != 0:
        raise SystemExit(f"pkm-serve serve exited with {code} after SIGTERM")
    step("pkm-serve serve: REST :predict and gRPC Predict equal numpy; SIGTERM exit 0")


def main():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    t0 = time.time()
    check_installed()
    with tempfile.TemporaryDirectory(prefix="pkm_wheel_check_") as work:
        check_readme_tour()
        check_keras_round_trip(work)
        base, idx, w, want = check_export(work)
        check_serve(base, idx, w, want)
    step(f"PASSED in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
