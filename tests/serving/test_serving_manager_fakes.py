"""The manager's version transitions on fake loaders (the loader.py seam, TF Serving's
core/loader.h idea): availability-preserving swaps, unload only after in-flight
requests, failed loads, and no import circle in pkm_serve/serving."""
import ast
import os
import threading
import time

import grpc
import pytest
from tensorflow_serving.apis import get_model_status_pb2, model_pb2

from serving_helpers import REPO, polled_manager, version_states, wait_until
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.loader import Loader

State = get_model_status_pb2.ModelVersionStatus.State


class FakeServable:
    def __init__(self, version):
        self.name, self.version = "m", version
        self.released = False


class FakeLoader(Loader):
    """Records every step in `events`; load() may wait on a gate or fail."""

    def __init__(self, version, events, gates, failures):
        self.version, self.events = version, events
        self._gate, self._failure = gates.get(version), failures.get(version)
        self._servable = None

    def load(self):
        self.events.append(("load-start", self.version))
        if self._gate is not None:
            assert self._gate.wait(30), "test never opened the load gate"
        if self._failure is not None:
            self.events.append(("load-failed", self.version))
            raise self._failure
        self._servable = FakeServable(self.version)
        self.events.append(("loaded", self.version))

    def servable(self):
        return self._servable

    def unload(self):
        self.events.append(("unload", self.version))
        self._servable.released = True
        self._servable = None


class Fakes:
    def __init__(self, base):
        self.base = base
        self.events, self.gates, self.failures = [], {}, {}

    def factory(self, name, version, path):
        assert (name, path) == ("m", os.path.join(str(self.base), str(version)))
        return FakeLoader(version, self.events, self.gates, self.failures)

    def add_version(self, version):
        os.makedirs(os.path.join(str(self.base), str(version)))
        with open(os.path.join(str(self.base), str(version), "saved_model.pb"), "w") as f:
            f.write(str(version))


@pytest.fixture
def fakes(tmp_path):
    f = Fakes(tmp_path / "m")
    f.add_version(1)
    return f


def _manager(fakes):
    return polled_manager(fakes.base, loader_factory=fakes.factory)



def _served_version(manager):
    with manager.serving(model_pb2.ModelSpec(name="m")) as servable:
        assert not servable.released
        return servable.version


def test_new_version_loads_before_the_old_one_unloads(fakes):
    """Availability-preserving transition: while version 2 loads, version 1 serves; 1 is
    unloaded only once 2 is AVAILABLE; at no moment is no version available."""
    manager = _manager(fakes)
    assert version_states(manager) == {1: State.AVAILABLE}
    fakes.gates[2] = threading.Event()
    fakes.add_version(2)
    poller = threading.Thread(target=manager.poll_once)
    poller.start()
    wait_until(lambda: ("load-start", 2) in fakes.events)
    assert version_states(manager) == {2: State.LOADING, 1: State.AVAILABLE}
    assert _served_version(manager) == 1
    fakes.gates[2].set()
    poller.join(30)
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.END}
    assert _served_version(manager) == 2
    assert fakes.events == [("load-start", 1), ("loaded", 1), ("load-start", 2), ("loaded", 2),
                            ("unload", 1)]


def test_unload_waits_for_the_requests_that_hold_the_version(fakes):
    manager = _manager(fakes)
    fakes.add_version(2)
    with manager.serving(model_pb2.ModelSpec(name="m")) as v1:
        poller = threading.Thread(target=manager.poll_once)
        poller.start()
        wait_until(lambda: version_states(manager) == {2: State.AVAILABLE, 1: State.UNLOADING})
        time.sleep(0.2)
        assert ("unload", 1) not in fakes.events and not v1.released   # still held here
        assert _served_version(manager) == 2                             # new requests get 2
    poller.join(30)
    assert fakes.events[-1] == ("unload", 1) and v1.released
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.END}


def test_unload_gives_up_waiting_after_the_drain_time(fakes):
    manager = polled_manager(fakes.base, loader_factory=fakes.factory, unload_drain_seconds=0.2)
    fakes.add_version(2)
    with manager.serving(model_pb2.ModelSpec(name="m")):
        t0 = time.monotonic()
        manager.poll_once()   # returns although this request still holds version 1
        assert time.monotonic() - t0 < 5
    assert ("unload", 1) in fakes.events


@pytest.mark.parametrize("failure, code", [
    (ServingError(grpc.StatusCode.INVALID_ARGUMENT, "bad graph"), grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError("loader bug"), grpc.StatusCode.UNKNOWN),
])
def test_failed_load_is_reported_keeps_the_old_version_and_is_retried_on_change(fakes, failure, code):
    manager = _manager(fakes)
    fakes.failures[2] = failure
    fakes.add_version(2)
    manager.poll_once()
    status = {s.version: s for s in manager.status(model_pb2.ModelSpec(name="m"))}
    assert status[2].state == State.END and status[2].status.error_code == code.value[0]
    assert ("bad graph" if code == grpc.StatusCode.INVALID_ARGUMENT else "RuntimeError: loader bug") \
        in status[2].status.error_message
    assert status[1].state == State.AVAILABLE and _served_version(manager) == 1
    manager.poll_once()                        # same files: not retried
    assert fakes.events.count(("load-start", 2)) == 1
    del fakes.failures[2]
    with open(os.path.join(str(fakes.base), "2", "fixed"), "w") as f:
        f.write("x")                           # the directory changed: retried, and now it loads
    manager.poll_once()
    assert fakes.events.count(("load-start", 2)) == 2
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.END} and _served_version(manager) == 2


def test_only_version_failing_leaves_the_model_unavailable_with_the_reason(tmp_path):
    """TF Serving answers NOT_FOUND "Servable not found for request: Latest(m)" (HTTP 404)
    when no version is available; the reason (here the failed load) is appended."""
    fakes = Fakes(tmp_path / "m")
    fakes.add_version(3)
    fakes.failures[3] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, "no signatures")
    manager = _manager(fakes)
    with pytest.raises(ServingError) as err:
        _served_version(manager)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert err.value.message.startswith("Servable not found for request: Latest(m) ")
    from pkm_serve.serving.errors import http_status
    assert http_status(err.value.code) == 404
    assert "version 3: END (no signatures)" in err.value.message


def test_a_factory_that_raises_is_a_failed_load(fakes):
    def factory(name, version, path):
        raise OSError("cannot open")
    manager = polled_manager(fakes.base, loader_factory=factory)
    (s,) = manager.status(model_pb2.ModelSpec(name="m"))
    assert s.state == State.END and "OSError: cannot open" in s.status.error_message


def _imports(path, package):
    """Modules of pkm_serve.serving that the file at path imports (at any level)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else package
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if os.path.exists(_module_path(sub) or "") else base)
    out = {m for m in out if m.startswith("pkm_serve.serving")}
    # Importing pkm_serve.serving.X runs the package's __init__ first: an edge to it too
    # (which is how __init__ importing server.py made a circle).
    return out | ({package} if any(m != package for m in out) else set())


def _module_path(module):
    rel = os.path.join(REPO, *module.split("."))
    for candidate in (rel + ".py", os.path.join(rel, "__init__.py")):
        if os.path.exists(candidate):
            return candidate
    return None


def test_no_import_circle_in_pkm_serve_serving():
    """issue #24: pkm_serve/serving/__init__.py <-> server.py was a circle; no module of the
    package may reach itself through imports (function-level ones included)."""
    pkg_dir = os.path.join(REPO, "pkm_serve", "serving")
    graph = {}
    for f in sorted(os.listdir(pkg_dir)):
        if f.endswith(".py"):
            mod = "pkm_serve.serving" + ("" if f == "__init__.py" else "." + f[:-3])
            graph[mod] = _imports(os.path.join(pkg_dir, f), "pkm_serve.serving")
    assert graph["pkm_serve.serving.__main__"] == {"pkm_serve.serving.server", "pkm_serve.serving"}

    def reach(start):
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(graph.get(m, ()))
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert circles == [], f"modules that import themselves through others: {circles}"


def _labelled(base, labels):
    from tensorflow_serving.config import model_server_config_pb2
    cfg = model_server_config_pb2.ModelServerConfig()
    c = cfg.model_config_list.config.add(name="m", base_path=str(base), model_platform="tensorflow")
    c.model_version_policy.all.SetInParent()
    for label, version in labels.items():
        c.version_labels[label] = version
    return cfg


@pytest.mark.parametrize("allow", [False, True])
def test_version_labels_name_available_versions_unless_allowed(fakes, allow):
    """TF Serving's ServerCore: a label may only name an AVAILABLE version; with
    --allow_version_labels_for_unavailable_models a *new* label may name one not loaded yet,
    but an existing label may not move to it. A refused config leaves every label as it was."""
    from pkm_serve.serving.manager import ModelManager

    fakes.add_version(2)
    manager = ModelManager(_labelled(fakes.base, {"stable": 1}), poll_seconds=-1, loader_factory=fakes.factory,
                           allow_labels_for_unavailable=allow)
    manager.poll_once()  # poll_seconds=-1: start() polls nothing itself
    manager.start()
    spec = model_pb2.ModelSpec(name="m", version_label="stable")
    with manager.serving(spec) as servable:
        assert servable.version == 1
    with pytest.raises(ServingError) as err:  # an existing label moved to a version not on disk
        manager.apply_config(_labelled(fakes.base, {"stable": 9}))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "assign label to version 9 of model m, which is not currently available" in err.value.message
    with manager.serving(spec) as servable:
        assert servable.version == 1
    new_label = _labelled(fakes.base, {"stable": 2, "canary": 9})
    if allow:
        manager.apply_config(new_label)
        with manager.serving(spec) as servable:
            assert servable.version == 2
    else:
        with pytest.raises(ServingError, match="version 9 of model m"):
            manager.apply_config(new_label)
        with manager.serving(spec) as servable:
            assert servable.version == 1  # all or nothing: 'stable' did not move either
    manager.stop()


def test_an_allowed_label_on_an_unloaded_version_survives_the_next_reload(fakes):
    """ServerCore::UpdateModelVersionLabelMap with --allow_version_labels_for_unavailable_models
    refuses only a label *moved* to an unavailable version: a label kept on the version it
    already named is accepted. Every later reload (another label, the config file re-read)
    was refused while version 9 was not loaded."""
    from pkm_serve.serving.manager import ModelManager

    manager = ModelManager(_labelled(fakes.base, {"stable": 1}), poll_seconds=-1, loader_factory=fakes.factory,
                           allow_labels_for_unavailable=True)
    manager.poll_once()
    manager.start()
    manager.apply_config(_labelled(fakes.base, {"stable": 1, "canary": 9}))
    manager.apply_config(_labelled(fakes.base, {"stable": 1, "canary": 9, "beta": 1}))
    with manager.serving(model_pb2.ModelSpec(name="m", version_label="beta")) as servable:
        assert servable.version == 1
    with pytest.raises(ServingError, match="version 8 of model m"):   # moving it is still refused
        manager.apply_config(_labelled(fakes.base, {"stable": 1, "canary": 8}))
    manager.stop()


def test_a_request_without_a_model_name_is_invalid_argument(fakes):
    """ServerCore::ServableRequestFromModelSpec: INVALID_ARGUMENT "ModelSpec has no name
    specified." for Predict, Classify, Regress and metadata (was NOT_FOUND, model '')."""
    manager = _manager(fakes)
    with pytest.raises(ServingError) as err:
        with manager.serving(model_pb2.ModelSpec(name="")):
            pass
    assert (err.value.code, err.value.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   "ModelSpec has no name specified.")
