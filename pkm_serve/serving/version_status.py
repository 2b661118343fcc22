"""GetModelStatus's answer for one model (get_model_status_impl.cc)."""
from tensorflow_serving.apis import get_model_status_pb2, status_pb2

from pkm_serve.serving.errors import invalid, not_found

END = get_model_status_pb2.ModelVersionStatus.State.END
AVAILABLE = get_model_status_pb2.ModelVersionStatus.State.AVAILABLE


def unknown_label(m, label):
    """ServerCore::GetModelVersionForLabel's error, then the labels the model has."""
    return invalid(f"Unrecognized servable version label: {label} (model '{m.name}' has labels "
                   f"{sorted(m.labels)})")


def configured_model(models, model_spec):
    """The ManagedModel of `models` ({name: model}) that model_spec names, else ServerCore's
    error for the request: a label is looked up first (GetModelVersionForLabel's
    INVALID_ARGUMENT), then the manager's NOT_FOUND for Latest(M) / Specific(M, V) (this
    server's words for all three, naming the model as not served, before); the configured
    models follow."""
    m = models.get(model_spec.name)
    if m is None:
        name = model_spec.name
        served = f"model '{name}' is not served; served models: {sorted(models)}"
        choice = model_spec.WhichOneof("version_choice")
        if choice == "version_label":
            raise invalid(f"Unrecognized servable version label: {model_spec.version_label} ({served})")
        request = f"Specific({name}, {model_spec.version.value})" if choice == "version" else f"Latest({name})"
        raise not_found(f"Servable not found for request: {request} ({served})")
    return m


def version_statuses(m, model_spec):
    """ModelVersionStatus entries of the ManagedModel `m` (None: a model not configured) that
    model_spec picks, newest first, as get_model_status_impl.cc: a version picks that one, and
    anything else (a version_label too: it reads only has_version()) every version the model
    has; the caller holds the manager's lock."""
    name = model_spec.name
    records = sorted(m.records.values(), key=lambda r: -r.version) if m is not None else []
    if model_spec.WhichOneof("version_choice") == "version":
        records = [r for r in records if r.version == model_spec.version.value]
        if not records:
            raise not_found(f"Could not find version {model_spec.version.value} of model {name}")
    elif not records:
        raise not_found(f"Could not find any versions of model {name}")
    out = []
    for r in records:
        # TF Serving fills status for every version (error_code OK when healthy).
        s = get_model_status_pb2.ModelVersionStatus(version=r.version, state=r.state)
        if r.error is not None:
            s.status.CopyFrom(status_pb2.StatusProto(error_code=r.error.code.value[0],
                                                     error_message=r.error.message))
        else:
            s.status.CopyFrom(status_pb2.StatusProto(error_code=0, error_message=""))
        out.append(s)
    return out


def why_unavailable(m):
    """What each version of the ManagedModel `m` is, for an error saying none serves."""
    if m.base_path_missing:
        return f"base path {m.config.base_path} does not exist"
    if not m.records:
        return f"no numeric version directories under {m.config.base_path}"
    state_name = get_model_status_pb2.ModelVersionStatus.State.Name
    return "; ".join(f"version {v}: {state_name(r.state)}"
                     + (f" ({r.error.message[:300]})" if r.error else "")
                     for v, r in sorted(m.records.items()))


def failed_loads(models):
    """['{name: M version: V} due to error: CODE: ...'] for the ManagedModels whose newest version
    failed to load, one each, as TF Serving awaits Latest(M) (an older version that failed while a
    newer one serves does not count); the caller holds the manager's lock."""
    newest = ((m, max(m.records.values(), key=lambda r: r.version)) for m in models if m.records)
    return [f"{{name: {m.name} version: {r.version}}} due to error: {' '.join(str(r.error).split())}"
            for m, r in newest if r.state == END and r.error is not None]


def resolve_record(m, model_spec):
    """The AVAILABLE VersionRecord of the ManagedModel `m` (None: the spec has no name) that
    model_spec picks; the caller holds the manager's lock."""
    if m is None:
        raise invalid("ModelSpec has no name specified.")   # ServerCore's words
    available = m.available_versions()
    choice = model_spec.WhichOneof("version_choice")
    if choice == "version":
        v = model_spec.version.value
    elif choice == "version_label":
        label = model_spec.version_label
        if label not in m.labels:
            raise unknown_label(m, label)
        v = m.labels[label]
    else:
        if not available:
            # TF Serving: NOT_FOUND (HTTP 404) "Servable not found for request: Latest(M)";
            # the why (a failed load, no version directory) follows for the caller.
            raise not_found(f"Servable not found for request: Latest({m.name}) "
                            f"(no version is available: {why_unavailable(m)})")
        v = available[-1]
    r = m.records.get(v)
    if r is None or r.state != AVAILABLE or r.servable is None:
        raise not_found(f"Servable not found for request: Specific({m.name}, {v}) "
                        f"(available versions: {available})")
    return r
