"""Which versions of a model are wanted and which may go, as TF Serving decides: the
file-system source aspires directories by the version policy alone
(file_system_storage_path_source.cc), and the availability-preserving policy
(availability_preserving_policy.cc) unloads what is no longer aspired."""
import logging

log = logging.getLogger("pkm_serve.serving")


def aspired_versions(policy, present):
    """The versions the policy wants of the directories `present`, whether or not they
    load (file_system_storage_path_source.cc: AspireLatestVersions & co.)."""
    newest_first = sorted(present, reverse=True)
    choice = policy.WhichOneof("policy_choice") if policy is not None else None
    if choice == "all":
        return set(newest_first)
    if choice == "specific":
        return set(policy.specific.versions) & set(newest_first)
    n = policy.latest.num_versions if choice == "latest" and policy.latest.num_versions > 0 else 1
    return set(newest_first[:n])


def versions_to_unload(aspired, serving):
    """The serving versions to unload (TF Serving's AvailabilityPreservingPolicy, applied
    until it asks for nothing more): every one not aspired once an aspired version serves
    or none is aspired; else all but the newest of them, so the model keeps serving while
    its aspired versions fail or have not loaded."""
    unaspired = sorted(v for v in serving if v not in aspired)
    if not aspired or any(v in serving for v in aspired):
        return unaspired
    return unaspired[:-1]


def warn_of_missing_specific_versions(m, present):
    policy = m.config.model_version_policy
    missing = tuple(sorted(set(policy.specific.versions) - set(present))) \
        if policy.WhichOneof("policy_choice") == "specific" else ()
    for v in missing if missing != m.missing_specific_logged else ():
        log.warning("Version %d of servable %s, which was requested to be served as a 'specific' "
                    "version in the servable's version policy, was not found in the file system", v, m.name)
    m.missing_specific_logged = missing
