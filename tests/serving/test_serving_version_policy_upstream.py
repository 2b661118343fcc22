"""Version policies as TF Serving applies them: the file-system source aspires
directories by the policy alone (file_system_storage_path_source.cc), and the
availability-preserving policy unloads what is no longer aspired once an aspired
version serves (availability_preserving_policy.cc). Run on fake loaders."""
import shutil

import grpc
from tensorflow_serving.apis import get_model_status_pb2, model_pb2
from tensorflow_serving.config import model_server_config_pb2

from serving_helpers import version_states
from test_serving_manager_fakes import Fakes
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.manager import ModelManager, versions_to_unload

State = get_model_status_pb2.ModelVersionStatus.State


def _manager(fakes, policy_text):
    from google.protobuf import text_format
    cfg = model_server_config_pb2.ModelServerConfig()
    c = cfg.model_config_list.config.add(name="m", base_path=str(fakes.base), model_platform="tensorflow")
    text_format.Parse(policy_text, c.model_version_policy)
    manager = ModelManager(cfg, poll_seconds=-1, loader_factory=fakes.factory)
    manager.poll_once()
    return manager


def _served(manager):
    with manager.serving(model_pb2.ModelSpec(name="m")) as servable:
        return servable.version


def _fakes(tmp_path, versions, failing=()):
    fakes = Fakes(tmp_path / "m")
    for v in versions:
        fakes.add_version(v)
    for v in failing:
        fakes.failures[v] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"version {v} is broken")
    return fakes


def test_latest_two_with_the_newest_broken_serves_only_the_second_newest(tmp_path):
    """latest {num_versions: 2} over 1, 2, 3 aspires 3 and 2; 3 fails, 2 serves, and
    version 1, never aspired, is never loaded (it used to be loaded in 3's place)."""
    fakes = _fakes(tmp_path, [1, 2, 3], failing=[3])
    manager = _manager(fakes, "latest { num_versions: 2 }")
    assert version_states(manager) == {3: State.END, 2: State.AVAILABLE}
    assert ("load-start", 1) not in fakes.events
    assert _served(manager) == 2
    manager.poll_once()   # the broken version stays aspired: still nothing else is loaded
    assert ("load-start", 1) not in fakes.events and fakes.events.count(("load-start", 3)) == 1


def test_latest_two_unloads_the_oldest_when_a_broken_version_arrives(tmp_path):
    fakes = _fakes(tmp_path, [1, 2])
    manager = _manager(fakes, "latest { num_versions: 2 }")
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.AVAILABLE}
    fakes.failures[3] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, "broken")
    fakes.add_version(3)
    for _ in range(2):   # and stays so (1 used to be loaded again on the next poll)
        manager.poll_once()
        assert version_states(manager) == {3: State.END, 2: State.AVAILABLE, 1: State.END}
    assert fakes.events.count(("load-start", 1)) == 1 and ("unload", 2) not in fakes.events


def test_last_serving_version_stays_while_its_successor_fails_even_if_its_directory_went(tmp_path):
    """latest {1}: version 1's directory is replaced by a broken version 2. Upstream keeps
    one unaspired version serving while no aspired one does, whether or not its directory
    is still there (it used to be unloaded, leaving no version at all)."""
    fakes = _fakes(tmp_path, [1])
    manager = _manager(fakes, "latest { num_versions: 1 }")
    fakes.failures[2] = ServingError(grpc.StatusCode.INVALID_ARGUMENT, "broken")
    fakes.add_version(2)
    shutil.rmtree(fakes.base / "1")
    manager.poll_once()
    assert version_states(manager) == {2: State.END, 1: State.AVAILABLE}
    assert _served(manager) == 1


def test_specific_version_whose_directory_disappears_is_unloaded(tmp_path):
    """specific {1, 2}: the source stops aspiring 2 when its directory goes, and version 1
    serves, so upstream unloads 2 (TF Serving 2.21 has no guard for 'specific' versions)."""
    fakes = _fakes(tmp_path, [1, 2])
    manager = _manager(fakes, "specific { versions: [1, 2] }")
    assert version_states(manager) == {2: State.AVAILABLE, 1: State.AVAILABLE}
    shutil.rmtree(fakes.base / "2")
    manager.poll_once()
    assert version_states(manager) == {2: State.END, 1: State.AVAILABLE}
    assert fakes.events[-1] == ("unload", 2)


def test_versions_to_unload_follows_the_availability_preserving_policy():
    assert versions_to_unload(set(), {1, 2}) == [1, 2]         # nothing aspired: all go
    assert versions_to_unload({3}, {1, 2, 3}) == [1, 2]        # an aspired one serves
    assert versions_to_unload({3}, {1, 2}) == [1]              # none serves: keep the newest
    assert versions_to_unload({3, 4}, set()) == []
