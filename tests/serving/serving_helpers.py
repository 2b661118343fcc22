"""Helpers for the serving tests: SavedModels on disk and a server subprocess.

A uniquely named module (not conftest) so that `import serving_helpers` can never
pick up another suite's conftest."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_concurrently(sched, signature, values, width=1, seconds=10.0):
    """{i: outputs or ServingError} of one BatchScheduler request per value (a [1, width] input
    "x" filled with it), all sent at once; each has `seconds` to answer (a deadline that only
    keeps a regression from hanging the test)."""
    import threading

    import numpy as np

    from pkm_serve.serving.errors import ServingError

    out = {}

    def call(i, value):
        try:
            out[i] = sched.run("servable", signature, {"x": np.full((1, width), value, np.float32)},
                               deadline=time.monotonic() + seconds)
        except ServingError as e:
            out[i] = e
    threads = [threading.Thread(target=call, args=(i, v)) for i, v in enumerate(values)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 5)
    return out


def run_staggered(sched, signature, requests, seconds=10.0, stagger=0.05):
    """[outputs or the exception raised] of one BatchScheduler request per input dict of
    `requests`, sent in order `stagger` seconds apart (so that they queue in that order)."""
    import threading

    out = [None] * len(requests)

    def call(i):
        try:
            out[i] = sched.run("s", signature, requests[i], deadline=time.monotonic() + seconds)
        except Exception as e:  # noqa: BLE001 - the caller checks which error
            out[i] = e
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(seconds + 5)
    return out


_PORTS_GIVEN = set()


def free_port():
    """A free localhost port not handed out before in this process: the kernel may give a port just
    released again, so two calls in a row (a server's gRPC and REST ports) could get the same one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class ServerProcess:
    """`python -m pkm_serve.serving ARGS` on free localhost ports; waits for "ready"."""

    def __init__(self, tmp_path, *args, rest=True, name="server", wait_ready=True):
        self.port = free_port()
        self.rest_port = free_port() if rest else 0
        self.log_path = os.path.join(str(tmp_path), f"{name}.log")
        cmd = [sys.executable, "-m", "pkm_serve.serving", f"--port={self.port}",
               f"--rest_api_port={self.rest_port}", *args]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TF_CPP_MIN_LOG_LEVEL="1")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_for_log("pkm-serve: ready")

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_for_log(self, text, timeout=180):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-5000:]}")
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"server did not log {text!r} after {timeout}s:\n{self.log()[-5000:]}")

    @property
    def target(self):
        return f"127.0.0.1:{self.port}"

    @property
    def rest_url(self):
        return f"http://127.0.0.1:{self.rest_port}"

    def terminate(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_batching_server(tmp, saved_models, batching_config, *flags):
    """A ServerProcess serving model `pkm` (the versions of the conftest's saved_models) with
    --enable_batching, `batching_config` (BatchingParameters text) as its parameters file, and `flags`."""
    (tmp / "batching.config").write_text(batching_config)
    base = saved_models[1].rsplit("/", 1)[0]
    return ServerProcess(tmp, "--model_name=pkm", f"--model_base_path={base}", "--file_system_poll_wait_seconds=0",
                         "--enable_batching", f"--batching_parameters_file={tmp / 'batching.config'}", *flags)


def write_model(base, version, seed, fused=True):
    """Writes version `version` atomically (save to a temp dir, then rename), as a
    deployment should, so the poller never sees a half-written directory."""
    from pkm_serve.serving.demo_model import save_pkm_model
    tmp = os.path.join(base, f".tmp-{version}")
    save_pkm_model(tmp, seed=seed, fused=fused)
    os.rename(tmp, os.path.join(base, str(version)))
    return os.path.join(base, str(version))


def write_example_model(path):
    """A TF1-style SavedModel with classify and regress signatures over serialized
    tf.Examples with one float feature x[2]: scores = softmax(x), classes = ["a", "b"],
    regression = x[0] + x[1]."""
    import tensorflow as tf
    with tf.Graph().as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32)})["x"]
        scores = tf.nn.softmax(x, axis=1)
        classes = tf.tile(tf.constant([["a", "b"]]), [tf.shape(x)[0], 1])
        total = tf.reduce_sum(x, axis=1)
        sigs = {"serving_default": tf.compat.v1.saved_model.classification_signature_def(serialized, classes, scores),
                "regress": tf.compat.v1.saved_model.regression_signature_def(serialized, total)}
        save_graph(path, sigs)
    return path


def save_graph(path, signature_def_map):
    """Saves the default (TF1) graph as a SavedModel at `path`, tagged "serve", with those signatures."""
    import tensorflow as tf
    with tf.compat.v1.Session() as sess:
        builder = tf.compat.v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map=signature_def_map)
        builder.save()


def polled_manager(base, name="m", **kwargs):
    """A ModelManager of one model at `base`, polled once by hand (poll_seconds=-1);
    kwargs go to ModelManager (loader_factory=..., warmup=...)."""
    from tensorflow_serving.config import model_server_config_pb2

    from pkm_serve.serving.manager import ModelManager

    cfg = model_server_config_pb2.ModelServerConfig()
    cfg.model_config_list.config.add(name=name, base_path=str(base), model_platform="tensorflow")
    manager = ModelManager(cfg, poll_seconds=-1, **kwargs)
    manager.poll_once()
    return manager


@contextlib.contextmanager
def rest_predict_url(base, name="m"):
    """The REST predict URL of an in-process RestFrontend over a polled_manager of `base`."""
    from pkm_serve.serving.rest_frontend import RestFrontend
    from pkm_serve.serving.service import InferenceService

    manager = polled_manager(base, name)
    frontend = RestFrontend(InferenceService(manager), None, None, address="127.0.0.1", port=0, num_threads=2,
                            timeout_ms=0, max_body_bytes=1 << 20, drain_seconds=1)
    frontend.start()
    try:
        yield f"http://127.0.0.1:{frontend.port}/v1/models/{name}:predict"
    finally:
        frontend.stop()
        manager.stop()


def post_json(url, body):
    """(HTTP status, decoded JSON answer) of POSTing `body` as JSON."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def holding_a_request(manager, name="m"):
    """A request of model `name` held open on a thread (its servable in use) until the block
    ends or the yielded event is set."""
    import threading

    from tensorflow_serving.apis import model_pb2

    release, held = threading.Event(), threading.Event()

    def hold():
        with manager.serving(model_pb2.ModelSpec(name=name)):
            held.set()
            release.wait(20)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5), f"no request of {name} got a servable"
        yield release
    finally:
        release.set()
        holder.join(10)


def version_states(manager, name="m"):
    """{version: state} as the manager reports them."""
    from tensorflow_serving.apis import model_pb2

    return {s.version: s.state for s in manager.status(model_pb2.ModelSpec(name=name))}


def wait_until(predicate, seconds=30, poll=0.005):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(poll)
