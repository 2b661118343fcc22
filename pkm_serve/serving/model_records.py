"""What the model manager keeps of each model and version (manager.py)."""
import grpc
from tensorflow_serving.apis import get_model_status_pb2
from tensorflow_serving.config import model_server_config_pb2

from pkm_serve.serving.errors import ServingError, invalid

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
        self.removed = False       # taken out of the config (a load still running unloads its version)

    def available_versions(self):
        return sorted(v for v, r in self.records.items() if r.state == State.AVAILABLE)


def ended_records(model):
    """Copies of the END versions of a model a reload removed, for its namesake re-added:
    TF Serving's GetModelStatus reads ServableStateMonitor's states, kept per model name for
    every version that ever had one, so a re-added model lists its old versions END beside its
    new ones. No fingerprint is copied: a version that failed is tried again, as upstream's
    manager loads a re-aspired version afresh."""
    out = {}
    for version, old in model.records.items():
        if old.state == State.END:
            r = out[version] = VersionRecord(version)
            r.state, r.error = State.END, old.error
    return out


def install_version_labels(models, allow_labels_for_unavailable):
    """Installs every ManagedModel's configured version labels, or none (FAILED_PRECONDITION):
    as TF Serving's ServerCore, a label may only name a version that is available, unless
    allow_labels_for_unavailable and the label is new or keeps its version. The caller holds
    the manager's lock."""
    models = list(models)
    for m in models:
        available = set(m.available_versions())
        for label, version in m.config.version_labels.items():
            if version not in available and not (allow_labels_for_unavailable
                                                 and m.labels.get(label, version) == version):
                raise ServingError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"Request to assign label to version {version} of model {m.name}, "
                                   "which is not currently available for inference")
    for m in models:
        m.labels = dict(m.config.version_labels)


def validate_model_server_config(server_config):
    """Refuses (INVALID_ARGUMENT) a ModelServerConfig the manager cannot serve."""
    if server_config.WhichOneof("config") == "custom_model_config":
        raise invalid("custom_model_config is not supported; use model_config_list")
    names = set()
    for c in server_config.model_config_list.config:
        if not c.name:
            raise invalid("every model config needs a name")
        if c.name in names:
            raise invalid(f"model name '{c.name}' appears twice in the model config")
        names.add(c.name)
        if not c.base_path:
            raise invalid(f"model '{c.name}' has no base_path")
        if c.HasField("logging_config"):
            raise invalid(f"model '{c.name}': logging_config (request logging) is not supported")
        if c.model_type == model_server_config_pb2.OTHER:
            raise invalid(f"model '{c.name}': model_type OTHER is not supported (only TENSORFLOW)")
        _check_platform(c)


def _check_platform(c):
    """ServerCore's GetPlatform: a model names its platform in model_platform or (deprecated)
    model_type, not both and not neither; only "tensorflow" is served here. (A config naming
    neither was served, and then failed to start tensorflow_model_server.)"""
    if c.model_type != model_server_config_pb2.MODEL_TYPE_UNSPECIFIED and c.model_platform:
        raise invalid(f"model '{c.name}': Illegal setting both ModelServerConfig::model_type (deprecated) "
                      "and ModelServerConfig::model_platform.")
    if c.model_type == model_server_config_pb2.MODEL_TYPE_UNSPECIFIED and not c.model_platform:
        raise invalid(f"model '{c.name}': Illegal setting neither ModelServerConfig::model_type (deprecated) "
                      "nor ModelServerConfig::model_platform. (Add model_platform: \"tensorflow\".)")
    if c.model_platform not in ("", "tensorflow"):
        raise invalid(f"model '{c.name}': model_platform '{c.model_platform}' is not "
                      "supported (only 'tensorflow')")
