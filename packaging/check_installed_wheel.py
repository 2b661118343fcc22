"""Runs in a fresh venv where `pip install dist/pkm_serve-*.whl[serving,tflite]` is the only
install of pkm_serve (tests/packaging/test_installed_wheel.py, `make wheel-check`): the
README's habits must work there, with nothing of the checkout on sys.path.

0. the op library resolves TF's libraries in the installed tensorflow package, and a fresh
   `import pkm_serve, keras` does not abort;
1. the README's 30-second tour (fused op, gradient, ragged bags, composite) against numpy;
2. .keras round trips (both layers compiled with LazyAdam, an EmbeddingBag with
   RowwiseAdagrad, a mixed_bfloat16 PKM), reloaded in a fresh process that only does
   `import pkm_serve` + keras under the default float32 policy: outputs within 1e-6;
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
    proc = subprocess.run([sys.executable, "-I", "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise SystemExit(f"fresh process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


# The .keras reload process (step 2) starts at step 0: its `import pkm_serve, keras` in a new
# interpreter is step 0's check, and it reads the work dir and model names from stdin once
# step 2 has saved them, so one fresh interpreter serves both steps.
KERAS_RELOAD_SCRIPT = """
    import json, sys, numpy as np
    import pkm_serve, keras
    print("imported", flush=True)
    work, names = sys.stdin.readline().strip(), sys.stdin.readline().split()
    result = {"policy": keras.config.dtype_policy().name}
    for name in names:
        model = keras.models.load_model(f"{work}/{name}.keras")
        inputs = list(np.load(f"{work}/{name}_in.npz").values())
        out = model(inputs if len(inputs) > 1 else inputs[0], training=False)
        np.save(f"{work}/{name}_out.npy", keras.ops.convert_to_numpy(out).astype(np.float32))
        opt = getattr(model, "optimizer", None)
        result[name] = None if opt is None else [
            type(opt).__module__ + "." + type(opt).__name__, int(opt.iterations.numpy())]
    print(json.dumps(result))
"""


class FreshKerasReload:
    """A new interpreter that only does `import pkm_serve, keras`, then reloads .keras files."""

    def __init__(self):
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file: TF's logs never block a pipe
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", textwrap.dedent(KERAS_RELOAD_SCRIPT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)

    def failure(self, what):
        self.proc.kill()
        code = self.proc.wait()
        self.stderr.seek(0)
        return SystemExit(f"fresh process {what} (exit {code}):\n{self.stderr.read()[-4000:]}")

    def wait_imported(self):
        if self.proc.stdout.readline().strip() != "imported":
            raise self.failure("died in `import pkm_serve, keras`")

    def reload(self, work, names):
        try:
            out, _ = self.proc.communicate(f"{work}\n{' '.join(names)}\n", timeout=300)
        except subprocess.TimeoutExpired:
            raise self.failure("timed out reloading .keras files") from None
        if self.proc.returncode:
            raise self.failure("failed reloading .keras files")
        return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def numpy_bag(table, idx, w=None):
    w = np.ones(idx.shape) if w is None else w
    out = np.zeros((idx.shape[0], table.shape[1]))
    for b in range(idx.shape[0]):
        keep = idx[b] >= 0
        out[b] = (w[b][keep, None] * table[idx[b][keep]].astype(np.float64)).sum(0)
    return out


def check_installed(keras_reload):
    import pkm_serve
    here = os.path.dirname(pkm_serve.__file__)
    if not here.startswith(sys.prefix) or any(
            os.path.realpath(p or os.getcwd()) == CHECKOUT for p in sys.path):
        raise SystemExit(f"pkm_serve comes from {here}, not from the installed wheel")
    for lib in ("_pkm_ops.so", "libpkm_tflite.so"):
        if not os.path.exists(os.path.join(here, "lib", lib)):
            raise SystemExit(f"the wheel lacks lib/{lib}")
    # TF's libraries come from the installed tensorflow package, never from a copy of ours.
    tf_dir = os.path.join(os.path.dirname(here), "tensorflow")
    ldd = subprocess.run(["ldd", os.path.join(here, "lib", "_pkm_ops.so")], capture_output=True,
                         text=True, check=True).stdout
    for lib in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2"):
        where = next((line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines()
                      if line.strip().startswith(lib + " ")), None)
        if where is None or os.path.realpath(os.path.dirname(where)) != os.path.realpath(tf_dir):
            raise SystemExit(f"lib/_pkm_ops.so resolves {lib} to {where}, not {tf_dir}:\n{ldd}")
    keras_reload.wait_imported()  # aborted (SIGABRT) with TF's library grafted
    step(f"installed package: {here}; its op library uses {tf_dir}'s TF libraries; "
         "`import pkm_serve, keras` works")


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


def _keras_models():
    """name -> (model, inputs): both layers compiled with LazyAdam; an EmbeddingBag with
    sparse gradients compiled with RowwiseAdagrad; a PKM under mixed_bfloat16. The optimizers
    take one step first, so their state is worth saving."""
    import keras
    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory
    from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad

    rng = np.random.default_rng(0)
    x, bags = rng.standard_normal((5, 16)).astype(np.float32), rng.integers(-1, 40, (5, 4))
    models = {}
    keras.utils.set_random_seed(0)
    x_in, bag_in = keras.Input((16,)), keras.Input((4,), dtype="int64")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=6, heads=2, knn=3)(x_in) + \
        EmbeddingBag(40, 8, combiner="mean")(bag_in)
    models["layers_lazy_adam"] = (keras.Model([x_in, bag_in], y), LazyAdam(0.01), [x, bags])
    bag_in = keras.Input((4,), dtype="int64")
    hidden = EmbeddingBag(40, 8, combiner="sum", sparse_gradient=True)(bag_in)
    models["bag_rowwise_adagrad"] = (keras.Model(bag_in, keras.layers.Dense(8)(hidden)),
                                     RowwiseAdagrad(0.1), [bags])
    for model, optimizer, inputs in models.values():
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        model.train_on_batch(inputs, np.ones((5, 8), np.float32))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(1)
        x_in = keras.Input((16,))
        pkm = keras.Model(x_in, ProductKeyMemory(v_dim=8, k_dim=8, n_keys=6, heads=2, knn=3)(x_in))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    models["pkm_mixed_bfloat16"] = (pkm, None, [x])
    return models


def check_keras_round_trip(work, keras_reload):
    """Every model reloads in one fresh process that imports only pkm_serve and keras (so
    under the default float32 policy: `keras_reload`, started at step 0) and gives the saved
    model's outputs."""
    import keras
    models = _keras_models()
    for name, (model, _, inputs) in models.items():
        model.save(os.path.join(work, f"{name}.keras"))
        np.savez(os.path.join(work, f"{name}_in.npz"), *inputs)
    out = keras_reload.reload(work, list(models))
    result = json.loads(out.strip().splitlines()[-1])
    assert result["policy"] == "float32", result
    for name, (model, optimizer, inputs) in models.items():
        want = keras.ops.convert_to_numpy(
            model(inputs if len(inputs) > 1 else inputs[0], training=False)).astype(np.float32)
        got = np.load(os.path.join(work, f"{name}_out.npy"))
        diff = float(np.abs(got - want).max())
        if diff > 1e-6:
            raise SystemExit(f"{name}.keras reloaded gives other outputs: max |diff| {diff:.3g}")
        if optimizer is not None and result[name] != [
                f"pkm_serve.optimizers.{type(optimizer).__name__}", 1]:
            raise SystemExit(f"{name}.keras reloaded with optimizer {result[name]}")
    step(".keras round trips (LazyAdam, RowwiseAdagrad, mixed_bfloat16 PKM): reloaded in a "
         "fresh process with only `import pkm_serve` + keras under float32, outputs equal")


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
    for announced in ("pkm-serve export: importing TensorFlow",
                      "pkm-serve export: loading the op library from"):
        if announced not in proc.stderr:
            raise SystemExit(f"pkm-serve export did not say {announced!r}:\n{proc.stderr}")
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
    keras_reload = FreshKerasReload()
    try:
        check_installed(keras_reload)
        with tempfile.TemporaryDirectory(prefix="pkm_wheel_check_") as work:
            check_readme_tour()
            check_keras_round_trip(work, keras_reload)
            base, idx, w, want = check_export(work)
            check_serve(base, idx, w, want)
    finally:
        keras_reload.close()
    step(f"PASSED in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
