"""The manager's load and unload threads (--num_load_threads, --num_unload_threads)
against shutdown, a config reload and the model_version_available gauge: nothing a
load thread finishes late stays loaded, one (model, version) loads at a time, and the
gauge ends as the version's state (fake loaders, as test_serving_manager_fakes)."""
import os
import threading
import time

import pytest
from tensorflow_serving.apis import get_model_status_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import polled_manager, version_states, wait_until
from test_serving_manager_fakes import Fakes
from pkm_serve.serving.manager import ModelManager
from pkm_serve.serving.metrics import Metrics

State = get_model_status_pb2.ModelVersionStatus.State


@pytest.fixture
def fakes(tmp_path):
    """Fakes of model m with version 1; a gate a failed test left shut is opened at its end."""
    made = Fakes(tmp_path / "m")
    made.add_version(1)
    yield made
    for gate in made.gates.values():
        gate.set()


def _config(fakes, *names, num_versions=1):
    cfg = model_server_config_pb2.ModelServerConfig()
    cfg.model_config_list.SetInParent()
    for name in names:
        c = cfg.model_config_list.config.add(name=name, base_path=str(fakes.base), model_platform="tensorflow")
        c.model_version_policy.latest.num_versions = num_versions
    return cfg


def _start_gated_load(manager, fakes, version):
    """Version `version` appears and starts loading on a load thread, held at its gate."""
    fakes.gates[version] = threading.Event()
    fakes.add_version(version)
    manager.poll_once(wait=False)
    wait_until(lambda: ("load-start", version) in fakes.events)


def test_shutdown_during_a_load_reports_it_and_unloads_the_late_version(fakes):
    """Server.stop's order (stop, then unload_all) while version 2 loads on a load thread:
    unload_all said True at once and the version that loaded afterwards stayed AVAILABLE,
    loaded for good. Now unload_all reports the load still running (False), and the version
    is unloaded as soon as its load ends."""
    manager = polled_manager(fakes.base, loader_factory=fakes.factory, num_load_threads=1)
    _start_gated_load(manager, fakes, 2)
    assert not manager.stop(timeout=0.1)
    t0 = time.monotonic()
    assert manager.unload_all(drain_seconds=0.0, lock_seconds=0.3) is False
    assert time.monotonic() - t0 >= 0.25   # it waited for the load
    assert ("unload", 1) in fakes.events   # what was loaded is unloaded all the same
    fakes.gates[2].set()
    wait_until(lambda: ("unload", 2) in fakes.events)
    wait_until(lambda: version_states(manager) == {1: State.END, 2: State.END})
    assert fakes.events.count(("load-start", 2)) == 1


def test_unload_all_waits_for_a_load_in_flight(fakes):
    """A load that ends within unload_all's time: unload_all waits for it and unloads it too."""
    manager = polled_manager(fakes.base, loader_factory=fakes.factory, num_load_threads=1)
    _start_gated_load(manager, fakes, 2)
    manager.stop_waiting()
    threading.Timer(0.3, fakes.gates[2].set).start()
    assert manager.unload_all(drain_seconds=0.0, lock_seconds=10.0) is True
    assert version_states(manager) == {1: State.END, 2: State.END}
    assert sorted(e for e in fakes.events if e[0] == "unload") == [("unload", 1), ("unload", 2)]
    assert manager.stop(timeout=5)


def test_an_unload_after_the_unload_threads_shut_down_runs_in_the_poll(fakes):
    """A poll that outlives stop() (which shuts the unload threads down) and unloads a
    version: submitting it raised RuntimeError and left the version UNLOADING for good."""
    manager = polled_manager(fakes.base, loader_factory=fakes.factory, num_unload_threads=1)
    manager._unloads.shutdown()   # as stop() does once its wait is over
    fakes.add_version(2)
    manager.poll_once()
    assert version_states(manager) == {1: State.END, 2: State.AVAILABLE}
    assert fakes.events[-1] == ("unload", 1)


def test_a_removed_and_re_added_model_loads_each_version_once_at_a_time(fakes):
    """Model m removed by a reload while versions 3 (loading, held) and 2 are aspired, then added
    back: the removed model's poll went on to load 2 after 3, and the re-added model's poll
    loaded 3 again while the first load of 3 still ran. Now the removed model's poll loads
    nothing more, and the new one waits for it (upstream keys loads by servable)."""
    manager = ModelManager(_config(fakes, "m", num_versions=2), poll_seconds=-1,
                           loader_factory=fakes.factory, num_load_threads=2)
    manager.poll_once()
    fakes.add_version(2)
    manager.poll_once()
    fakes.gates[3] = threading.Event()
    fakes.add_version(3)
    manager.poll_once(wait=False)
    wait_until(lambda: ("load-start", 3) in fakes.events)
    manager.apply_config(_config(fakes, num_versions=2), poll=False)      # m removed
    manager.apply_config(_config(fakes, "m", num_versions=2), poll=False)  # and back
    manager.poll_once(wait=False)
    time.sleep(0.3)
    assert fakes.events.count(("load-start", 3)) == 1   # not a second load of 3 beside the first
    fakes.gates[3].set()
    wait_until(lambda: ("unload", 3) in fakes.events)   # the removed model's late version
    assert manager._model_polls.wait_all(5)
    manager.poll_once()
    # (1, unloaded by the removal, stays listed END, as upstream's state monitor keeps it)
    assert version_states(manager) == {3: State.AVAILABLE, 2: State.AVAILABLE, 1: State.END}
    assert manager.stop(timeout=5)
    starts = [e[1] for e in fakes.events if e[0] == "load-start"]
    assert starts[:3] == [1, 2, 3] and sorted(starts[3:]) == [2, 3]   # the removed model's poll did not go on to 2
    _assert_one_load_at_a_time(fakes.events)


def test_a_removed_models_poll_loads_no_more_versions(fakes):
    """One load thread: the poll loads 3 (held), 2 waits its turn; m is removed by a reload.
    The poll went on to load 2 for a model no longer served; now it stops, and 3, loaded
    after the removal, is unloaded at once."""
    manager = ModelManager(_config(fakes, "m", num_versions=2), poll_seconds=-1,
                           loader_factory=fakes.factory, num_load_threads=1)
    manager.poll_once()
    fakes.gates[3] = threading.Event()
    fakes.add_version(3)
    fakes.add_version(2)
    manager.poll_once(wait=False)
    wait_until(lambda: ("load-start", 3) in fakes.events)
    manager.apply_config(_config(fakes, num_versions=2), poll=False)
    fakes.gates[3].set()
    wait_until(lambda: ("unload", 3) in fakes.events)
    assert manager.stop(timeout=5)
    assert ("load-start", 2) not in fakes.events, fakes.events


def _assert_one_load_at_a_time(events):
    loading = set()
    for step, version in events:
        if step == "load-start":
            assert version not in loading, f"version {version} loaded twice at once: {events}"
            loading.add(version)
        elif step in ("loaded", "load-failed"):
            loading.discard(version)


class _SlowUnloadGauge(Metrics):
    """The unload thread's gauge write held 0.5 s (the thread preempted there)."""

    def __init__(self):
        super().__init__()
        self.unload_writing = threading.Event()

    def version_available(self, model, version, available):
        if not available and threading.current_thread().name.startswith("unload"):
            self.unload_writing.set()
            time.sleep(0.5)
        super().version_available(model, version, available)

    def gauge(self, version):
        return self.version_state.labels("m", str(version))._value.get()


def test_the_available_gauge_ends_as_the_version_state_with_unload_threads(fakes, tmp_path):
    """--num_unload_threads: version 1 unloads on the unload thread (2 replaced it); 2's
    directory goes and 1 loads again while that thread is between marking 1 END and
    setting its gauge to 0. The gauge was set outside the lock, so it ended 0 for the
    version that serves; now it is set with the state."""
    metrics = _SlowUnloadGauge()
    manager = polled_manager(fakes.base, loader_factory=fakes.factory, metrics=metrics, num_unload_threads=1)
    fakes.add_version(2)
    manager.poll_once()
    assert metrics.unload_writing.wait(5)
    os.rename(os.path.join(str(fakes.base), "2"), os.path.join(str(tmp_path), "moved-away"))
    manager.poll_once()
    assert manager.stop(timeout=5)
    assert version_states(manager) == {1: State.AVAILABLE, 2: State.END}
    assert (metrics.gauge(1), metrics.gauge(2)) == (1, 0)


def _open_gates_when(fakes, predicate):
    """Opens every gate once predicate() holds, or after 5 s (the test then fails on it)."""
    try:
        wait_until(predicate, seconds=5)
        return True
    except AssertionError:
        return False
    finally:
        for gate in fakes.gates.values():
            gate.set()


def test_a_models_versions_load_at_once_on_the_load_threads(fakes):
    """latest {num_versions: 2}: versions 3 and 2 appear. Upstream's manager loads each
    version on the --num_load_threads pool; here one model's versions loaded one after
    another (2 waited for 3's load) whatever the threads."""
    manager = ModelManager(_config(fakes, "m", num_versions=2), poll_seconds=-1,
                           loader_factory=fakes.factory, num_load_threads=2)
    manager.poll_once()
    for v in (3, 2):
        fakes.gates[v] = threading.Event()
        fakes.add_version(v)
    manager.poll_once(wait=False)
    both = _open_gates_when(fakes, lambda: {("load-start", 2), ("load-start", 3)} <= set(fakes.events))
    assert both, fakes.events
    wait_until(lambda: version_states(manager) == {3: State.AVAILABLE, 2: State.AVAILABLE, 1: State.END})
    assert manager.stop(timeout=5)


def test_one_load_thread_loads_a_models_versions_in_turn_without_deadlock(fakes):
    """The model's poll takes the only load thread: it runs the version loads itself, in
    turn (newest first), rather than wait for a thread that will never come."""
    manager = ModelManager(_config(fakes, "m", num_versions=2), poll_seconds=-1,
                           loader_factory=fakes.factory, num_load_threads=1)
    manager.poll_once()
    fakes.add_version(3)
    fakes.add_version(2)
    t0 = time.monotonic()
    manager.poll_once()
    assert time.monotonic() - t0 < 5
    starts = [e for e in fakes.events if e[0] == "load-start"]
    assert starts == [("load-start", 1), ("load-start", 3), ("load-start", 2)]
    _assert_one_load_at_a_time(fakes.events)
    assert version_states(manager) == {3: State.AVAILABLE, 2: State.AVAILABLE, 1: State.END}
    assert manager.stop(timeout=5)


def test_the_initial_versions_of_one_model_load_at_once(fakes):
    """Start-up (4 x CPUs initial-load threads, whatever --num_load_threads): the three
    aspired versions of one model load at once, as upstream's initial load."""
    manager = ModelManager(_config(fakes, "m", num_versions=3), poll_seconds=0,
                           loader_factory=fakes.factory, num_load_threads=0)
    for v in (3, 2):
        fakes.add_version(v)
    for v in (1, 2, 3):
        fakes.gates[v] = threading.Event()
    starter = threading.Thread(target=manager.start)
    starter.start()
    all_three = _open_gates_when(fakes, lambda: len([e for e in fakes.events if e[0] == "load-start"]) == 3)
    starter.join(10)
    assert all_three, fakes.events
    assert version_states(manager) == {3: State.AVAILABLE, 2: State.AVAILABLE, 1: State.AVAILABLE}
