"""ModelManager.stop() while work waits queued on the load or unload threads
(--num_load_threads / --num_unload_threads): stop() shuts the pools down, which cancels what they
had not started. A poll waiting for a cancelled model poll must end (it waited for good, holding
the poll lock, so unload_all unloaded nothing), and a queued unload must still free its version
(it stayed UNLOADING with its loader never unloaded)."""
import os
import threading
import time

from tensorflow_serving.apis import get_model_status_pb2, model_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import holding_a_request, wait_until
from pkm_serve.serving.loader import Loader
from pkm_serve.serving.manager import ModelManager

State = get_model_status_pb2.ModelVersionStatus.State


class _Loader(Loader):
    def __init__(self, name, version, events, gates):
        self.key, self._events, self._gates = (name, version), events, gates

    def load(self):
        gate = self._gates.get(self.key)
        if gate is not None:
            gate.wait(20)

    def servable(self):
        return object()

    def unload(self):
        self._events.append(("unload",) + self.key)


def _config(base, *names):
    cfg = model_server_config_pb2.ModelServerConfig()
    for name in names:
        cfg.model_config_list.config.add(name=name, base_path=str(base / name), model_platform="tensorflow")
    return cfg


def _states(manager):
    return {(name, s.version): s.state for name in ("a", "b") if name in manager._models
            for s in manager.status(model_pb2.ModelSpec(name=name))}


def test_a_poll_waiting_for_a_model_poll_that_stop_cancelled_ends(tmp_path):
    """One load thread held by a's version 2; a reload adding b waits for b's poll, queued
    behind it; stop() cancels that poll. The reload returns, and unload_all takes the poll
    lock and unloads a's version 1 while a's version 2 is still loading."""
    for name in ("a", "b"):
        os.makedirs(tmp_path / name / "1")
    events, gates = [], {("a", 2): threading.Event()}
    manager = ModelManager(_config(tmp_path, "a"), poll_seconds=-1, num_load_threads=1,
                           loader_factory=lambda n, v, p: _Loader(n, v, events, gates))
    try:
        manager.poll_once()
        os.makedirs(tmp_path / "a" / "2")
        manager.poll_once(wait=False)   # a's poll takes the only load thread, held at a2's gate
        wait_until(lambda: _states(manager).get(("a", 2)) == State.LOADING)
        reload = threading.Thread(target=manager.apply_config, args=(_config(tmp_path, "a", "b"),), daemon=True)
        reload.start()
        time.sleep(0.2)   # the reload waits for b's poll, queued behind a's
        assert not manager.stop(timeout=0.3)   # a's load still runs
        reload.join(5)
        assert not reload.is_alive(), "the reload waited for good for a poll stop() cancelled"
        assert not manager.unload_all(drain_seconds=0, lock_seconds=2)   # a's load has not ended
        assert ("unload", "a", 1) in events
    finally:
        gates[("a", 2)].set()
    wait_until(lambda: ("unload", "a", 2) in events)   # loaded after stop began: unloaded at once


def test_an_unload_queued_when_stop_shuts_the_unload_threads_down_still_runs(tmp_path):
    """One unload thread; requests hold a's and b's version 1 when versions 2 appear: a1's
    unload waits for its request, b1's waits in the queue. stop() gives up waiting; once the
    requests end both still unload."""
    for name in ("a", "b"):
        os.makedirs(tmp_path / name / "1")
    events = []
    manager = ModelManager(_config(tmp_path, "a", "b"), poll_seconds=-1, num_unload_threads=1,
                           unload_drain_seconds=30, loader_factory=lambda n, v, p: _Loader(n, v, events, {}))
    manager.poll_once()
    with holding_a_request(manager, "a"), holding_a_request(manager, "b"):
        for name in ("a", "b"):
            os.makedirs(tmp_path / name / "2")
        manager.poll_once()
        assert not manager.stop(timeout=0.2)   # an unload is still waiting for its request
    wait_until(lambda: {("unload", "a", 1), ("unload", "b", 1)} <= set(events), seconds=10)
    assert _states(manager) == {("a", 1): State.END, ("a", 2): State.AVAILABLE,
                                ("b", 1): State.END, ("b", 2): State.AVAILABLE}
