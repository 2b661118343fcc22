"""What the model manager keeps of each model and version (manager.py)."""
from tensorflow_serving.apis import get_model_status_pb2

State = get_model_status_pb2.ModelVersionStatus.State


class VersionRecord:
    __slots__ = ("version", "state", "error", "loader", "servable", "fingerprint", "in_flight")

    def __init__(self, version):
        self.version = version
        self.state = State.START
        self.error = None
        self.loader = None
        self.servable = None
        self.fingerprint = None
        self.in_flight = 0   # requests between acquire and release of this version


class ManagedModel:
    def __init__(self, config):
        self.config = config
        self.name = config.name
        self.records = {}          # version -> VersionRecord
        self.labels = {}           # version label -> version, as last accepted (ModelManager._update_labels)
        self.base_path_missing = False
        self.no_versions_logged = False
        self.missing_specific_logged = ()   # 'specific' policy versions last warned of as absent
        self.superseded = False    # a load's retries ended: a newer version took its place (poll again)

    def available_versions(self):
        return sorted(v for v, r in self.records.items() if r.state == State.AVAILABLE)
