"""tensorflow_model_server flags a deployment's command line passes (Kubernetes manifests,
docker-compose, the tensorflow/serving image's entrypoint), which were refused as
"not implemented": each now does what upstream's main.cc / server.cc / aspired_versions_manager
do with it, or is accepted where it changes no answer (and says so in the log)."""
import json
import os
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import get_model_status_pb2, model_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import holding_a_request, ServerProcess, wait_until
from pkm_serve.serving import config
from pkm_serve.serving.loader import Loader
from pkm_serve.serving.manager import ModelManager

State = get_model_status_pb2.ModelVersionStatus.State
BASE = ["--model_base_path=/m"]


def test_tensorflow_session_parallelism_sets_both_pools_as_server_cc():
    """server.cc: with neither intra nor inter parallelism set, both session pools get
    --tensorflow_session_parallelism; with either set, it is ignored; all three: an error."""
    a = config.parse_args(BASE + ["--tensorflow_session_parallelism=3"])
    assert (a.tensorflow_intra_op_parallelism, a.tensorflow_inter_op_parallelism) == (3, 3)
    a = config.parse_args(BASE + ["--tensorflow_session_parallelism=3", "--tensorflow_intra_op_parallelism=2"])
    assert (a.tensorflow_intra_op_parallelism, a.tensorflow_inter_op_parallelism) == (2, 0)
    with pytest.raises(SystemExit):
        config.parse_args(BASE + ["--tensorflow_session_parallelism=3", "--tensorflow_intra_op_parallelism=2",
                                  "--tensorflow_inter_op_parallelism=2"])


@pytest.mark.parametrize("argv, needle", [
    (["--enable_profiler=true"], "--enable_profiler=true cannot be served: the gRPC port has no TensorFlow profiler"),
    (["--enable_profiler"], "--enable_profiler=true cannot be served"),
    (["--xla_cpu_compilation_enabled=false"], "--xla_cpu_compilation_enabled=false cannot be served"),
    (["--saved_model_tags=serve,,gpu"], "has an empty tag"),
    (["--num_load_threads=-1"], "--num_load_threads must be >= 0"),
    (["--per_process_gpu_memory_fraction=nan"], "--per_process_gpu_memory_fraction must be >= 0"),
])
def test_values_that_cannot_be_served_are_usage_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        config.parse_args(BASE + argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------------------------ --num_load_threads
class _Loader(Loader):
    def __init__(self, fail, gate=None):
        self._fail, self._gate, self._servable = fail, gate, None

    def load(self):
        if self._gate is not None:
            self._gate.wait(20)
        if self._fail:
            raise RuntimeError("broken version")
        self._servable = object()

    def servable(self):
        return self._servable

    def unload(self):
        self._servable = None


def _two_models(tmp_path, num_load_threads, gate):
    """Models a and b serving version 1, then a broken version 2 of a (whose load waits for
    `gate`, then fails; no retries); a good version 2 of b appears once a's is loading."""
    cfg = model_server_config_pb2.ModelServerConfig()
    for name in ("a", "b"):
        os.makedirs(tmp_path / name / "1")
        cfg.model_config_list.config.add(name=name, base_path=str(tmp_path / name), model_platform="tensorflow")
    broken = ("a", 2)
    manager = ModelManager(cfg, poll_seconds=0.05, max_num_load_retries=0,
                           loader_factory=lambda name, version, path: _Loader(
                               (name, version) == broken, gate if (name, version) == broken else None),
                           num_load_threads=num_load_threads)
    manager.start()
    os.makedirs(tmp_path / "a" / "2")
    wait_until(lambda: _state(manager, "a", 2) == State.LOADING, seconds=10)
    os.makedirs(tmp_path / "b" / "2")
    return manager


def _state(manager, name, version):
    return {s.version: s.state for s in manager.status(model_pb2.ModelSpec(name=name))}.get(version)


@pytest.mark.parametrize("num_load_threads", [0, 2])
def test_num_load_threads_keeps_a_slow_load_from_delaying_another_model(tmp_path, num_load_threads):
    """aspired_versions_manager: with num_load_threads 0 loads run one after another in the
    manager loop, so b's new version waits until a's (held at a gate here) has ended; with a
    pool of 2, b's loads while a's is still loading."""
    gate = threading.Event()
    manager = _two_models(tmp_path, num_load_threads, gate)
    try:
        if num_load_threads:
            wait_until(lambda: _state(manager, "b", 2) == State.AVAILABLE, seconds=10)
            assert _state(manager, "a", 2) == State.LOADING
        else:
            time.sleep(0.5)   # polls go on meanwhile; b's version cannot load before a's ends
            assert _state(manager, "b", 2) != State.AVAILABLE
        gate.set()
        wait_until(lambda: _state(manager, "b", 2) == State.AVAILABLE, seconds=10)
        wait_until(lambda: _state(manager, "a", 2) == State.END, seconds=10)
        assert _state(manager, "a", 1) == State.AVAILABLE   # a's version 1 still serves
    finally:
        gate.set()
        assert manager.stop(timeout=10)


def test_num_unload_threads_lets_the_poll_go_on_while_a_request_holds_the_old_version(tmp_path):
    """With --num_unload_threads the unload (which waits for the requests that hold the
    version) runs on its own thread: b's new version loads while a request still holds a's
    old one; without it, the poll waited there (up to --drain_seconds)."""
    cfg = model_server_config_pb2.ModelServerConfig()
    for name in ("a", "b"):
        os.makedirs(tmp_path / name / "1")
        cfg.model_config_list.config.add(name=name, base_path=str(tmp_path / name), model_platform="tensorflow")
    manager = ModelManager(cfg, poll_seconds=0.05, unload_drain_seconds=20,
                           loader_factory=lambda *_: _Loader(False), num_unload_threads=1)
    manager.start()
    try:
        with holding_a_request(manager, "a") as release:
            os.makedirs(tmp_path / "a" / "2")
            wait_until(lambda: _state(manager, "a", 1) == State.UNLOADING, seconds=10)
            os.makedirs(tmp_path / "b" / "2")
            wait_until(lambda: _state(manager, "b", 2) == State.AVAILABLE, seconds=10)
            assert _state(manager, "a", 1) == State.UNLOADING   # the request still holds it
            release.set()
            wait_until(lambda: _state(manager, "a", 1) == State.END, seconds=10)
    finally:
        assert manager.stop(timeout=10)


# ------------------------------------------------------------------ one real server
def _save_half_plus_two(path, tags):
    """y = 0.5 x + 2 saved under the MetaGraph tag set `tags` only."""
    import tensorflow as tf
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        y = tf.add(tf.multiply(x, 0.5), 2.0, name="y")
        sig = tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        with tf.compat.v1.Session() as sess:
            builder = tf.compat.v1.saved_model.Builder(str(path))
            builder.add_meta_graph_and_variables(sess, tags, signature_def_map={"serving_default": sig})
            builder.save()


def _http(url, method="GET", body=None, headers=None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


INERT = ["--flush_filesystem_caches=false", "--remove_unused_fields_from_bundle_metagraph=true",
         "--enable_profiler=false", "--xla_cpu_compilation_enabled=true",
         "--enable_grpc_healthcheck_service=true"]


def test_server_with_a_deployments_upstream_flags(tmp_path):
    """A GPU-tagged SavedModel served with --saved_model_tags=serve,gpu, CORS answered as
    TF Serving's REST server does, and the flags that change nothing accepted and logged."""
    _save_half_plus_two(tmp_path / "m" / "1", ["serve", "gpu"])
    server = ServerProcess(tmp_path, "--model_name=m", f"--model_base_path={tmp_path / 'm'}",
                           "--saved_model_tags=serve,gpu", "--rest_api_enable_cors_support=true",
                           "--num_load_threads=2", "--num_unload_threads=2", "--tensorflow_session_parallelism=1",
                           "--per_process_gpu_memory_fraction=0.5", *INERT)
    try:
        x = np.array([1.0, 4.0, -3.0], np.float32)
        status, headers, body = _http(f"{server.rest_url}/v1/models/m:predict", "POST",
                                      json.dumps({"instances": x.tolist()}).encode(),
                                      {"Content-Type": "application/json", "Origin": "https://app.example"})
        assert status == 200, body
        np.testing.assert_allclose(json.loads(body)["predictions"], 0.5 * x.astype(np.float64) + 2.0)
        assert headers["Access-Control-Allow-Origin"] == "*"
        # A browser's preflight before that POST: 200 with the CORS headers, no API call.
        status, headers, _ = _http(f"{server.rest_url}/v1/models/m:predict", "OPTIONS", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert status == 200
        assert headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert "content-type" in headers["Access-Control-Allow-Headers"].lower()
        # An error answer carries them too (the browser must be able to read it).
        status, headers, body = _http(f"{server.rest_url}/v1/models/nope")
        assert status == 404 and headers["Access-Control-Allow-Origin"] == "*", body
        # Outside /v1/ upstream has no handler: a plain 404, preflight or not.
        status, headers, _ = _http(f"{server.rest_url}/other", "OPTIONS", headers={"Origin": "http://a.b"})
        assert status == 404 and "Access-Control-Allow-Origin" not in headers
        # --enable_grpc_healthcheck_service: a Kubernetes gRPC probe's Check answers SERVING.
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(server.target) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        log = server.log()
        for flag in INERT:
            assert f"{flag.split('=')[0]} changes nothing here: " in log, log[-3000:]
    finally:
        assert server.terminate() == 0


def test_default_tags_do_not_load_a_model_saved_without_serve_alone(tmp_path):
    """The tag set must match exactly, as TF's LoadSavedModel: without --saved_model_tags the
    server looks for {serve}, and a {serve, gpu} MetaGraph is not it (which is why such a
    deployment passes the flag)."""
    _save_half_plus_two(tmp_path / "m" / "1", ["serve", "gpu"])
    from pkm_serve.serving.servable import Servable
    with pytest.raises(Exception, match="serve"):
        Servable("m", 1, str(tmp_path / "m" / "1"))
    servable = Servable("m", 1, str(tmp_path / "m" / "1"), tags=["serve", "gpu"], gpu_memory_fraction=0.25)
    try:
        out = servable.signature("serving_default").run({"x": np.array([2.0], np.float32)})
        np.testing.assert_allclose(out["y"], [3.0])
        assert servable.session_config.gpu_options.per_process_gpu_memory_fraction == 0.25
    finally:
        servable.release()


def test_overlapping_loads_leave_tensorflows_logger_level_as_it_was():
    """Two loads whose quiet-logger spans interleave (--num_load_threads): the second saved
    the first's lowered level (ERROR) and restored it last, so TF's warnings stayed muted
    for the rest of the server's life."""
    import logging

    import tensorflow as tf
    from pkm_serve.serving.servable import _quiet_tf_logger
    logger = tf.get_logger()
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        first, second = _quiet_tf_logger(), _quiet_tf_logger()
        first.__enter__()
        second.__enter__()
        assert logger.level == logging.ERROR
        first.__exit__(None, None, None)
        assert logger.level == logging.ERROR   # the second load is still running
        second.__exit__(None, None, None)
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)


def test_a_jit_compile_model_serves_as_with_xla_cpu_compilation_enabled(tmp_path):
    """What --xla_cpu_compilation_enabled=true asks of tensorflow_model_server (without it, a
    jit_compile function fails its first compilation there) is what a version's Session does
    here: the XLA-compiled function answers."""
    import tensorflow as tf
    from pkm_serve.serving.servable import Servable

    class Jit(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)], jit_compile=True)
        def f(self, x):
            return {"y": tf.sin(x) * 2.0 + 1.0}
    module = Jit()
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={"serving_default": module.f})
    servable = Servable("m", 1, str(tmp_path / "1"))
    try:
        x = np.array([0.5, -2.0, 3.0], np.float32)
        out = servable.signature("serving_default").run({"x": x})["y"]
        np.testing.assert_allclose(out, np.sin(x.astype(np.float64)) * 2 + 1, rtol=1e-6, atol=1e-6)
    finally:
        servable.release()


class _CountingLoader(_Loader):
    live = []

    def load(self):
        super().load()
        self.live.append(self)

    def unload(self):
        self.live.remove(self)
        super().unload()


def test_a_version_aspired_again_while_its_unload_waits_is_not_loaded_over_it(tmp_path):
    """With --num_unload_threads, version 1 waits on an unload thread for a request to let
    it go when version 2's directory disappears (1 is aspired again): it was loaded again
    at once, and the pending unload then marked the fresh load END without freeing it (a
    leaked session, and 2 unloaded with nothing serving). Now 1 loads again once its unload
    is done, and every live servable is an AVAILABLE version."""
    _CountingLoader.live = []
    cfg = model_server_config_pb2.ModelServerConfig()
    os.makedirs(tmp_path / "a" / "1")
    cfg.model_config_list.config.add(name="a", base_path=str(tmp_path / "a"), model_platform="tensorflow")
    manager = ModelManager(cfg, poll_seconds=0.05, unload_drain_seconds=20,
                           loader_factory=lambda *_: _CountingLoader(False), num_unload_threads=1)
    manager.start()
    try:
        with holding_a_request(manager, "a") as release:
            os.makedirs(tmp_path / "a" / "2")
            wait_until(lambda: _state(manager, "a", 1) == State.UNLOADING, seconds=10)
            os.rmdir(tmp_path / "a" / "2")
            time.sleep(0.5)   # polls while 1 still unloads
            assert _state(manager, "a", 1) == State.UNLOADING
            assert _state(manager, "a", 2) == State.AVAILABLE   # keeps serving meanwhile
            release.set()
            wait_until(lambda: _state(manager, "a", 1) == State.AVAILABLE
                       and _state(manager, "a", 2) == State.END, seconds=10)
            assert len(_CountingLoader.live) == 1
    finally:
        assert manager.stop(timeout=10)


def test_initial_versions_load_in_parallel_whatever_num_load_threads(tmp_path):
    """load_servables_fast.cc: tensorflow_model_server loads the configured models' first
    versions on num_initial_load_threads (4 x CPUs) threads, then goes back to
    --num_load_threads (0: in turn). Model a's load here only finishes once b's has begun:
    loaded one after another, the start waited 5 s on it and failed."""
    b_started = threading.Event()

    class _WaitsForB(_Loader):
        def __init__(self, name):
            super().__init__(False)
            self.name = name

        def load(self):
            if self.name == "a":
                assert b_started.wait(5), "b's load did not start while a's ran"
            else:
                b_started.set()
            super().load()
    cfg = model_server_config_pb2.ModelServerConfig()
    for name in ("a", "b"):
        os.makedirs(tmp_path / name / "1")
        cfg.model_config_list.config.add(name=name, base_path=str(tmp_path / name), model_platform="tensorflow")
    manager = ModelManager(cfg, poll_seconds=0, loader_factory=lambda name, *_: _WaitsForB(name))
    manager.start()
    assert (_state(manager, "a", 1), _state(manager, "b", 1)) == (State.AVAILABLE, State.AVAILABLE)
    assert manager._model_polls is None   # later polls: in turn, as --num_load_threads=0
    assert manager.stop(timeout=10)
