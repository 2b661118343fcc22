"""Version lifecycle in-process: one resolution per request, unload waits for the
requests that hold a version and then frees it (batching queues included), and the
private TF API the servable relies on is still where it was."""
import gc
import threading
import time
import weakref

import numpy as np
import pytest
from google.protobuf import text_format
from tensorflow_serving.apis import get_model_status_pb2, model_pb2, predict_pb2
from tensorflow_serving.config import model_server_config_pb2

import half_plus_two as hpt
from serving_helpers import polled_manager, version_states, wait_until
from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.manager import ModelManager
from pkm_serve.serving.rest_frontend import RestFrontend
from pkm_serve.serving.servable import Signature
from pkm_serve.serving.service import InferenceService

State = get_model_status_pb2.ModelVersionStatus.State
SCALE = {1: 1.0, 2: 5.0}          # version v answers y = SCALE[v] * x + 2


def _manager(base):
    return polled_manager(base, warmup=False)



class _SwapDuringValidation:
    """Patches Signature.validate: after version 1 validated a request, version 2 is polled
    in (another thread) and the request goes on only once 2 is AVAILABLE and 1 UNLOADING."""

    def __init__(self, monkeypatch, manager, base):
        self.manager, self.base = manager, base
        self.poller = None
        original = Signature.validate

        def validate(sig, inputs):
            original(sig, inputs)
            if self.poller is None:
                hpt.write_versioned(str(base), 2, hpt.write_tf2, scale=SCALE[2])
                self.poller = threading.Thread(target=manager.poll_once)
                self.poller.start()
                wait_until(lambda: version_states(manager) == {2: State.AVAILABLE, 1: State.UNLOADING})

        monkeypatch.setattr(Signature, "validate", validate)

    def finish(self):
        self.poller.join(30)
        assert version_states(self.manager) == {2: State.AVAILABLE, 1: State.END}


@pytest.fixture
def base(tmp_path, tf_with_ops):
    hpt.write_versioned(str(tmp_path / "m"), 1, hpt.write_tf2, scale=SCALE[1])
    return tmp_path / "m"


def _predict_request(x):
    import tensorflow as tf
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "m"
    req.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([[x]], np.float32)))
    return req


@pytest.mark.parametrize("batching", [False, True], ids=["direct", "batched"])
def test_grpc_request_validated_against_v1_is_run_by_v1(monkeypatch, base, batching):
    manager = _manager(base)
    with manager.serving(model_pb2.ModelSpec(name="m")) as v1:
        v1_ref = weakref.ref(v1)
    del v1
    batcher = BatchScheduler(text_format.Parse("batch_timeout_micros { value: 1000 }",
                                               protos.BatchingParameters())) if batching else None
    service = InferenceService(manager, batcher)
    swap = _SwapDuringValidation(monkeypatch, manager, base)
    resp = service.predict(_predict_request(2.0))
    assert resp.model_spec.version.value == 1
    assert list(resp.outputs["y"].float_val) == [SCALE[1] * 2.0 + 2]
    swap.finish()
    resp = service.predict(_predict_request(2.0))
    assert (resp.model_spec.version.value, list(resp.outputs["y"].float_val)) == (2, [SCALE[2] * 2.0 + 2])
    if batcher is not None:
        assert not batcher._queues, "batching queues outlive their requests"
        batcher.stop()
    gc.collect()
    assert v1_ref() is None, "something outside the manager still holds unloaded version 1"
    manager.stop()


def test_rest_request_decoded_against_v1_is_run_by_v1(monkeypatch, base):
    manager = _manager(base)
    rest = RestFrontend.__new__(RestFrontend)     # only the handler, no socket
    rest.service = InferenceService(manager)
    swap = _SwapDuringValidation(monkeypatch, manager, base)
    body = rest._predict(model_pb2.ModelSpec(name="m"), {"instances": [[2.0]]}, None)
    assert body == {"predictions": [[SCALE[1] * 2.0 + 2]]}
    swap.finish()
    body = rest._predict(model_pb2.ModelSpec(name="m"), {"instances": [[2.0]]}, None)
    assert body == {"predictions": [[SCALE[2] * 2.0 + 2]]}
    manager.stop()


def test_unload_waits_for_in_flight_requests_then_frees_the_session(base):
    manager = _manager(base)
    spec = model_pb2.ModelSpec(name="m")
    with manager.serving(spec) as v1:
        hpt.write_versioned(str(base), 2, hpt.write_tf2, scale=SCALE[2])
        poller = threading.Thread(target=manager.poll_once)
        poller.start()
        wait_until(lambda: version_states(manager) == {2: State.AVAILABLE, 1: State.UNLOADING})
        time.sleep(0.3)
        assert version_states(manager)[1] == State.UNLOADING     # still held by this request
        sig = v1.signature("")
        out = sig.run({"x": np.array([[3.0]], np.float32)})   # and still runs
        np.testing.assert_array_equal(out["y"], [[SCALE[1] * 3.0 + 2]])
    poller.join(30)
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.END}
    with pytest.raises(ServingError, match="Session has been closed"):   # its session is gone
        sig.run({"x": np.array([[3.0]], np.float32)})
    manager.stop()


def test_no_versions_under_base_path_is_logged_like_tf_serving(tmp_path, caplog):
    cfg = model_server_config_pb2.ModelServerConfig()
    cfg.model_config_list.config.add(name="empty", base_path=str(tmp_path), model_platform="tensorflow")
    manager = ModelManager(cfg, poll_seconds=-1)
    with caplog.at_level("WARNING", logger="pkm_serve.serving"):
        manager.poll_once()
        manager.poll_once()
    expected = (f"No versions of servable empty found under base path {tmp_path}. "
                "Did you forget to name your leaf directory as a number (eg. '/1/')?")
    assert [r.getMessage() for r in caplog.records] == [expected]   # once, not every poll


def _answer(manager, x=3.0):
    with manager.serving(model_pb2.ModelSpec(name="m")) as servable:
        return servable.version, float(servable.signature("").run({"x": np.array([[x]], np.float32)})["y"][0, 0])


def test_base_path_gone_keeps_the_loaded_versions_serving(base, caplog):
    """TF Serving's file-system poll fails with "Could not find base path" and changes no
    aspired version: a base path moved away for a moment must not take the model offline."""
    manager = _manager(base)
    assert _answer(manager) == (1, SCALE[1] * 3.0 + 2)
    moved = base.parent / "m.moved"
    base.rename(moved)
    with caplog.at_level("ERROR", logger="pkm_serve.serving"):
        manager.poll_once()
        manager.poll_once()
    assert version_states(manager) == {1: State.AVAILABLE}
    assert _answer(manager) == (1, SCALE[1] * 3.0 + 2)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and logged[0].startswith(f"Could not find base path {base} for servable m"), logged
    moved.rename(base)
    hpt.write_versioned(str(base), 2, hpt.write_tf2, scale=SCALE[2])
    manager.poll_once()
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.END}
    manager.stop()


def test_reload_config_to_a_missing_base_path_keeps_the_model_serving(base, tmp_path):
    from tensorflow_serving.apis import model_management_pb2
    manager = _manager(base)
    service = InferenceService(manager)
    req = model_management_pb2.ReloadConfigRequest()
    req.config.model_config_list.config.add(name="m", base_path=str(tmp_path / "nowhere"),
                                            model_platform="tensorflow")
    resp = service.reload_config(req)
    # TF Serving's ServerCore waits only for new models; the poll then logs the missing path.
    assert resp.status.error_code == 0
    assert version_states(manager) == {1: State.AVAILABLE}
    assert _answer(manager) == (1, SCALE[1] * 3.0 + 2)
    manager.stop()


def test_private_tf_apis_still_exist(base):
    """servable.make_session_callable uses Session._make_callable_from_options (why: see
    its docstring). If a TF upgrade moves or changes it, this fails, loudly."""
    import tensorflow as tf
    from pkm_serve.serving.servable import make_session_callable
    assert callable(getattr(tf.compat.v1.Session, "_make_callable_from_options", None)), \
        "tf.compat.v1.Session._make_callable_from_options is gone: servable.py needs another runner"
    assert callable(tf.compat.v1.saved_model.loader.load), "the Session SavedModel loader is gone"
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 1], name="x")
        y = tf.multiply(x, 2.0, name="y")
    with tf.compat.v1.Session(graph=g) as sess:
        run = make_session_callable(sess, [x.name], [y.name])
        # A shape the placeholder does not declare: fed as TF Serving feeds it.
        (out,) = run(np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3) * 2.0)


def test_rest_port_comes_from_public_aiohttp_api():
    from aiohttp import web
    assert isinstance(web.AppRunner.addresses, property)


@pytest.mark.parametrize("check", [False, True])
def test_signature_method_name_check_flag(base, check):
    """TF Serving's --enable_signature_method_name_check (default false): off, Regress runs
    a TF2 signature (method_name .../predict); on, it is refused with the method named."""
    from tensorflow_serving.apis import regression_pb2
    manager = _manager(base)
    service = InferenceService(manager, check_signature_method_name=check)
    req = regression_pb2.RegressionRequest()
    req.model_spec.name, req.model_spec.signature_name = "m", "regress_x_to_y"
    req.input.example_list.examples.add().features.feature["x"].float_list.value.append(2.0)
    if check:
        with pytest.raises(ServingError, match="method_name to be tensorflow/serving/regress"):
            service.regress(req)
    else:
        assert [r.value for r in service.regress(req).result.regressions] == [SCALE[1] * 2.0 + 2]
    manager.stop()
