"""Model versions on the file system -> loaded servables, TF Serving style.

Each model has a base path whose numeric subdirectories are versions. A poll
lists them, applies the model's version policy, loads (and warms) the aspired
versions that are not loaded yet, and only then unloads versions that are no
longer aspired: serving never drops to zero versions during a transition
(TF Serving's availability-preserving policy). A version that fails to load is
first tried again (--max_num_load_retries, --load_retry_interval_micros, as TF
Serving's LoaderHarness), then reported (state END with the error) and not tried
again until its files change. As TF Serving's file-system source, the version policy
picks directories, not loadable versions: a `latest {num_versions: N}` model aspires
the N newest directories even when one of them fails to load (it is not replaced by
an older one). At start-up, though, a failed load fails the start, and a model
without any version yet is waited for (TF Serving's initial load).

What a version *is* stays behind the Loader seam (loader.py, TF Serving's
core/loader.h): the transitions here only call load(), servable() and unload(),
so tests run them on fake loaders.
"""
import contextlib
import logging
import os
import threading
import time

import grpc
from tensorflow_serving.apis import get_model_status_pb2

from pkm_serve.serving.errors import ServingError, not_found
from pkm_serve.serving.load_threads import KeyedThreads, run_all, submit_all
from pkm_serve.serving.loader import load_with_retries, make_loader_factory
from pkm_serve.serving.model_records import (ManagedModel, VersionRecord, ended_records, install_version_labels,
                                             validate_model_server_config)
from pkm_serve.serving.version_policy import aspired_versions, versions_to_unload, warn_of_missing_specific_versions
from pkm_serve.serving.version_status import configured_model, failed_loads, resolve_record, version_statuses
from pkm_serve.serving.version_dirs import directory_fingerprint, holds_model_hint, is_directory, list_versions

log = logging.getLogger("pkm_serve.serving")
State = get_model_status_pb2.ModelVersionStatus.State

NO_VERSIONS_MESSAGE = ("No versions of servable {name} found under base path {path}. "
                       "Did you forget to name your leaf directory as a number (eg. '/1/')?")
WAITING_WARNING_SECONDS = 60.0  # how often a start-up waiting for a first version says so


class ModelManager:
    def __init__(self, server_config, *, poll_seconds=1.0, warmup=True, metrics=None,
                 config_file=None, config_poll_seconds=0.0, unload_drain_seconds=30.0,
                 loader_factory=None, allow_labels_for_unavailable=False,
                 max_num_load_retries=0, load_retry_interval_seconds=60.0, num_load_threads=0,
                 num_unload_threads=0):
        """loader_factory(model_name, version, path) -> loader.Loader; by default the
        SavedModel servable (warmed up if `warmup`). A failed load is tried again
        max_num_load_retries times, load_retry_interval_seconds apart (the server passes
        TF Serving's defaults, 5 and 60 s). num_load_threads > 0: models are polled (their
        versions loaded, retried, unloaded) on that many threads, and the background poll
        does not wait for a model still busy; num_unload_threads > 0: unloads (which wait
        for the requests holding the version) run on that many threads."""
        self._model_polls = KeyedThreads(num_load_threads, "load") if num_load_threads else None
        self._unloads = KeyedThreads(num_unload_threads, "unload") if num_unload_threads else None
        self._max_num_load_retries = max_num_load_retries
        self._load_retry_interval_seconds = load_retry_interval_seconds
        self._loader_factory = loader_factory or make_loader_factory(warmup=warmup)
        self._lock = threading.RLock()       # guards the model table and records
        self._idle = threading.Condition(self._lock)   # a version's last request finished
        self._unload_drain_seconds = unload_drain_seconds
        self._poll_lock = threading.Lock()   # one poll (load/unload) at a time
        self._models = {}
        # Models a reload removed, for GetModelStatus: TF Serving's ServableStateMonitor keeps
        # their versions' last state (END), so their status is not NOT_FOUND.
        self._removed_models = {}
        self._poll_seconds = poll_seconds
        self._metrics = metrics
        self._config_file = config_file
        self._config_poll_seconds = config_poll_seconds
        self._config = None                  # the ModelServerConfig applied last
        self._allow_labels_for_unavailable = allow_labels_for_unavailable
        self._started = False                # labels are checked once versions have loaded
        self._stop = threading.Event()
        self._thread = None
        self.apply_config(server_config, poll=False)

    # ------------------------------------------------------------ config
    validate_config = staticmethod(validate_model_server_config)

    def apply_config(self, server_config, poll=True, await_new_models_until=None):
        """Installs a new model list (HandleReloadConfigRequest); removed models are unloaded.
        With await_new_models_until (a time.monotonic() deadline, math.inf for none), an added
        model without a version yet is waited for, as ServerCore::ReloadConfig does."""
        if server_config.WhichOneof("config") is None:
            # As TF Serving's ServerCore::ReloadConfig: an empty ModelServerConfig changes
            # nothing (an empty model_config_list, which is set, does unload every model).
            log.info("reload with an empty config: taking no action")
            self._config = server_config  # seen: a config file left empty is not re-read as new
            return
        self.validate_config(server_config)
        with self._poll_lock:
            self._config = server_config
            with self._lock:
                wanted = {c.name: c for c in server_config.model_config_list.config}
                removed = [self._models.pop(n) for n in list(self._models) if n not in wanted]
                for m in removed:
                    m.removed = True
                    self._removed_models[m.config.name] = m
                added = [n for n in wanted if n not in self._models]
                for name, c in wanted.items():
                    if name in self._models:
                        self._models[name].config = c
                    else:
                        self._models[name] = ManagedModel(c)
                        gone = self._removed_models.pop(name, None)
                        if gone is not None:   # (its ended versions stay listed, as upstream's)
                            self._models[name].records = ended_records(gone)
            for m in removed:
                for r in list(m.records.values()):
                    if r.state == State.AVAILABLE:
                        self._unload(m, r)
            if poll:
                self._poll_locked()
                if await_new_models_until is not None:
                    self._await_a_version_of(added, await_new_models_until)
                # As ServerCore::ReloadConfig, which waits for the new models: the config stays
                # applied, the labels are left as they were, and the caller hears why.
                failed = self._failed_loads(added)
                if failed:
                    raise ServingError(grpc.StatusCode.UNKNOWN, "Some models did not become available: {"
                                       + "".join(f"{{{entry}}}, " for entry in failed) + "}")
            if self._started:
                self._update_labels()

    def _update_labels(self):
        with self._lock:
            install_version_labels(self._models.values(), self._allow_labels_for_unavailable)

    # ------------------------------------------------------------ polling
    def poll_once(self, wait=True):
        with self._poll_lock:
            self._poll_locked(wait)

    def _poll_locked(self, wait=True):
        """Polls every model: one after another, or (num_load_threads) on the load threads,
        waiting for them unless `wait` is False; a model whose previous poll still runs (a
        load, its retries) is left to it, as is one re-added while its removed namesake's runs."""
        with self._lock:
            models = list(self._models.values())
        if self._model_polls is None:
            for m in models:
                self._poll_model_logged(m)
            return
        submit_all(self._model_polls, [(m.name, self._poll_model_logged, m) for m in models], wait)

    def _poll_model_logged(self, m):
        try:
            self._poll_model(m)
        except Exception:  # noqa: BLE001 - one model's trouble must not stop the others
            log.exception("polling model %s failed", m.name)

    def _poll_model(self, m: ManagedModel):
        present = list_versions(m.config.base_path)
        if present is None:
            # TF Serving (file_system_storage_path_source.cc) fails this poll with "Could not find
            # base path": no aspired version changes, so what is loaded keeps serving (a base
            # path moved away for a redeploy, an NFS blip, a reload that names a missing path).
            if not m.base_path_missing:
                loaded = m.available_versions()
                log.error("Could not find base path %s for servable %s%s", m.config.base_path, m.name,
                          f"; the versions loaded ({loaded}) keep serving" if loaded else "")
            m.base_path_missing = True
            return
        else:
            m.base_path_missing = False
            if not present and not m.no_versions_logged:
                log.warning(NO_VERSIONS_MESSAGE.format(name=m.name, path=m.config.base_path)
                            + holds_model_hint(m.config.base_path))
            m.no_versions_logged = not present
        warn_of_missing_specific_versions(m, present)
        prints = {v: directory_fingerprint(p) for v, p in present.items()}
        failed = {v for v, r in m.records.items()   # not tried again until its files change
                  if r.state == State.END and r.error is not None and v in present and r.fingerprint == prints[v]}
        aspired = aspired_versions(m.config.model_version_policy, present)
        # Each version on the load threads, as upstream's manager (in turn, newest first, without
        # them). An UNLOADING version (its unload on an unload thread) loads again once it is END.
        wanted = [v for v in sorted(aspired - failed, reverse=True)
                  if m.records.get(v) is None or m.records[v].state not in (State.AVAILABLE, State.UNLOADING)]
        run_all(self._model_polls, [((m.name, v), self._load_in_poll, m, v, present[v], prints[v])
                                    for v in wanted])
        if m.superseded:  # a load's retries ended for newer versions: this poll's list is stale
            m.superseded = False
            return self._poll_model(m)
        if self._poll_ended(m):
            return
        with self._lock:
            serving = {v for v, r in m.records.items() if r.state == State.AVAILABLE}
        for v in versions_to_unload(aspired, serving):
            self._unload_in_turn(m, m.records[v])

    def _poll_ended(self, m):
        """Its model removed by a reload (which unloaded it) or the server stopping (unload_all
        unloads) while a poll ran on a load thread: the poll loads nothing more."""
        return m.removed or self._stop.is_set()

    def _unload_in_turn(self, m, r):
        """On an unload thread (num_unload_threads), else here, as once stop() shut them down."""
        loader = self._begin_unload(r)
        with contextlib.suppress(RuntimeError):   # "cannot schedule new futures after shutdown"
            if self._unloads is not None:
                return self._unloads.submit(object(), self._finish_unload, m, r, loader)
        self._finish_unload(m, r, loader)

    def _load_in_poll(self, m, version, path, fingerprint):
        if not (self._poll_ended(m) or m.superseded):
            self._load(m, version, path, fingerprint)

    def _load(self, m, version, path, fingerprint):
        with self._lock:
            r = m.records.get(version) or VersionRecord(version)
            m.records[version] = r
            r.state, r.error, r.fingerprint = State.LOADING, None, fingerprint
        log.info("model %s: loading version %d from %s", m.name, version, path)
        t0 = time.perf_counter()
        try:
            loader = load_with_retries(lambda: self._loader_factory(m.name, version, path),
                                       f"{{name: {m.name} version: {version}}}", self._max_num_load_retries,
                                       lambda: self._retry_cancelled(m, r, path))
            servable = loader.servable()
        except ServingError as e:
            log.error("model %s: version %d failed to load: %s", m.name, version, e.message)
            self._load_failed(m, r, path, e, t0)
            return
        except Exception as e:  # noqa: BLE001 - any loader failure is a failed version, not a crash
            log.exception("model %s: version %d failed to load", m.name, version)
            self._load_failed(m, r, path, ServingError(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"), t0)
            return
        with self._lock:
            # Nothing else would unload a version loaded too late: it never serves, it goes now.
            late = self._poll_ended(m)
            r.loader, r.servable = loader, servable
            r.state = State.UNLOADING if late else State.AVAILABLE
            self._set_available_gauge(m.name, version)
        if self._metrics:
            self._metrics.load_attempt(m.name, path, ok=True, seconds=time.perf_counter() - t0)
        if late:
            log.info("model %s: version %d loaded once removed or stopping; unloading it", m.name, version)
            self._unload(m, r, drain_seconds=0.0)
            return
        log.info("model %s: version %d available (load %.2fs, warmup %.2fs)", m.name, version,
                 getattr(servable, "load_seconds", 0.0), getattr(servable, "warmup_seconds", 0.0))

    def _retry_cancelled(self, m, r, path):
        """Waits the retry interval, then whether the retry is off: TF Serving cancels it when
        the version is no longer aspired (its directory gone, or a newer version took its place
        under the policy) or the server stops. A later poll compares the next try's files."""
        if self._stopped_within(self._load_retry_interval_seconds) or m.removed or not is_directory(path):
            return True
        present = list_versions(m.config.base_path)  # None (not listed: a blip) changes nothing, as a poll
        if present is not None and r.version not in aspired_versions(m.config.model_version_policy, present):
            log.info("model %s: version %d is no longer aspired; its load is not retried", m.name, r.version)
            m.superseded = True
            return True
        r.fingerprint = directory_fingerprint(path)
        return False

    def _stopped_within(self, seconds) -> bool:
        """Waits up to `seconds` (clamped to what a lock wait takes: --load_retry_interval_micros
        at int64 max, meaning "never", raised OverflowError) for stop(); True if it came."""
        return self._stop.wait(min(max(0.0, seconds), threading.TIMEOUT_MAX))

    def _load_failed(self, m, r, path, error, t0):
        """END with the error: reported by GetModelStatus, not retried until the files change."""
        with self._lock:
            r.state, r.error = State.END, error
        if self._metrics:
            self._metrics.load_attempt(m.name, path, ok=False, seconds=time.perf_counter() - t0)

    def _unload(self, m, r, drain_seconds=None):
        """UNLOADING: no new request gets the version; the ones that have it finish (up to
        drain_seconds, by default unload_drain_seconds), then its session, variables and
        batching queues are freed."""
        self._finish_unload(m, r, self._begin_unload(r), drain_seconds)

    def _begin_unload(self, r):
        with self._lock:
            r.state = State.UNLOADING
            loader, r.loader, r.servable = r.loader, None, None
        return loader

    def _finish_unload(self, m, r, loader, drain_seconds=None):
        drain = self._unload_drain_seconds if drain_seconds is None else drain_seconds
        with self._lock:
            drained = self._idle.wait_for(lambda: r.in_flight == 0, drain)
        if not drained:
            log.warning("model %s: version %d still had %d request(s) after %.0fs; unloading anyway",
                        m.name, r.version, r.in_flight, drain)
        if loader is not None:
            try:
                loader.unload()
            except Exception:  # noqa: BLE001 - a failed free must not stop the transition
                log.exception("model %s: version %d failed to unload cleanly", m.name, r.version)
        with self._lock:
            r.state = State.END
            self._set_available_gauge(m.name, r.version)
        log.info("model %s: version %d unloaded", m.name, r.version)

    def _set_available_gauge(self, name, version):
        """model_version_available as the model table has it, set under the lock (held) that
        changed the state, so an unload thread's 0 cannot land after a reload's 1."""
        if self._metrics:
            model = self._models.get(name)
            r = model.records.get(version) if model else None
            self._metrics.version_available(name, version, r is not None and r.state == State.AVAILABLE)

    def _maybe_reload_config_file(self):
        """Re-reads the config file on every poll (as TF Serving does) and applies it when
        it differs from what is served: a change at any moment, even one written before
        the first poll, is picked up."""
        from pkm_serve.serving.config import read_model_config_file
        new = None
        try:
            new = read_model_config_file(self._config_file)
            if new == self._config:
                return
            self.apply_config(new)
            log.info("reloaded model config from %s", self._config_file)
        except (ValueError, ServingError) as e:
            applied = "applied model config %s, but" if new is not None and self._config == new \
                else "ignoring model config %s:"
            log.error(applied + " %s", self._config_file, e)

    def start(self):
        """Polls once (synchronously, so models are up before the server answers), then in
        the background every poll_seconds (TF Serving: 0 = once, negative = never).
        A version that fails this first load fails the start (UNKNOWN), as TF Serving's
        initial load does; later failures only mark their version END."""
        if self._poll_seconds >= 0:
            with self._initial_load_threads():
                self.poll_once()
                self._await_a_version_of_every_model()
            self._refuse_failed_initial_loads()
        self._started = True
        self._update_labels()
        if self._poll_seconds > 0 or self._config_poll_seconds > 0:
            self._thread = threading.Thread(target=self._loop, name="model-poller", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def _initial_load_threads(self):
        """ServerCore's num_initial_load_threads (load_servables_fast.cc): the initial versions
        load on 4 x the CPUs' threads whatever --num_load_threads, which applies afterwards."""
        configured = self._model_polls
        self._model_polls = KeyedThreads(4 * len(os.sched_getaffinity(0)), "initial-load")
        try:
            yield
        finally:
            initial, self._model_polls = self._model_polls, configured
            initial.shutdown()

    def _await_a_version_of_every_model(self):
        """TF Serving's initial load waits until each configured model has a version that
        loaded or failed: a base path that is missing or holds no version directory yet is
        polled again every poll_seconds, ports closed, until one appears (a model synced in
        after the server starts). Upstream waits forever when it polls only once
        (--file_system_poll_wait_seconds=0); here that is an error naming the models."""
        warned_at = None
        while True:
            waiting = self._awaited(self._models)
            if not waiting:
                return
            if self._poll_seconds == 0:
                raise ServingError(grpc.StatusCode.UNKNOWN, f"no version to load of {', '.join(waiting)}, and "
                                   "--file_system_poll_wait_seconds=0 polls only once (TF Serving waits forever)")
            if warned_at is None or time.monotonic() - warned_at >= WAITING_WARNING_SECONDS:
                # Again each minute: the ports stay closed, and some waits never end.
                log.warning("waiting for a version of %s to load (polling every %gs)", ", ".join(waiting),
                            self._poll_seconds)
                warned_at = time.monotonic()
            if self._stopped_within(self._poll_seconds):
                raise ServingError(grpc.StatusCode.CANCELLED, "stopped while waiting for the initial versions")
            self.poll_once()

    def _awaited(self, names):
        """The models of `names` that have no version that loaded or failed yet."""
        with self._lock:
            return [m.name for m in map(self._models.get, names) if m and not any(
                r.state == State.AVAILABLE or r.error is not None for r in m.records.values())]

    def _await_a_version_of(self, names, until):
        """ServerCore::ReloadConfig's WaitUntilModelsAvailable for the models a reload added: polls
        (holding the poll lock) until each has a version that loaded or failed. Upstream waits without
        bound; this ends at the caller's deadline (DEADLINE_EXCEEDED), at stop, or when nothing polls."""
        while True:
            waiting = self._awaited(names)
            if not waiting:
                return
            where = ", ".join(f"{n} (base path {self._models[n].config.base_path})" for n in waiting)
            if self._poll_seconds <= 0:
                raise ServingError(grpc.StatusCode.UNKNOWN, f"no version to load of {where}, and "
                                   "the file system is not polled again (--file_system_poll_wait_seconds"
                                   f"={self._poll_seconds:g}; TF Serving waits forever)")
            left = until - time.monotonic()
            if left <= 0:
                raise ServingError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no version of {where} has loaded "
                                   "yet; the config is applied and the model loads when a version appears")
            if self._stopped_within(min(self._poll_seconds, left)):
                raise ServingError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
            self._poll_locked()

    def _refuse_failed_initial_loads(self):
        """Raises TF Serving's start-up error (load_servables_fast.cc: "N servable(s) did not
        become available: {{{name: M version: V} due to error: CODE: ...}, }"), one entry per
        model, after unloading what did load."""
        failed = self._failed_loads(self._models)
        if failed:
            self.unload_all(drain_seconds=0.0, lock_seconds=30.0)
            entries = "".join(f"{{{entry}}}, " for entry in failed)
            raise ServingError(grpc.StatusCode.UNKNOWN,
                               f"{len(failed)} servable(s) did not become available: {{{entries}}}")

    def _failed_loads(self, names):
        with self._lock:
            return failed_loads([m for m in map(self._models.get, names) if m])

    def _loop(self):
        periods = [self._poll_seconds] + ([self._config_poll_seconds] if self._config_file else [])
        period = min(p for p in periods if p > 0)
        last_versions = last_config = time.monotonic()
        while not self._stopped_within(period):
            now = time.monotonic()
            if self._config_file and self._config_poll_seconds > 0 \
                    and now - last_config >= self._config_poll_seconds:
                last_config = now
                self._maybe_reload_config_file()
            if self._poll_seconds > 0 and now - last_versions >= self._poll_seconds:
                last_versions = now
                self.poll_once(wait=False)

    def stop_waiting(self):
        """Ends the waits (a reload waiting for a new model's first version, the poller's
        sleep) at once: called when shutdown begins, before the front ends drain."""
        self._stop.set()

    def stop(self, timeout=30.0) -> bool:
        """Stops the poller; False if it is still busy (a load) after `timeout` seconds."""
        self._stop.set()
        end = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        idle = self._thread is None or not self._thread.is_alive()
        for threads in (self._model_polls, self._unloads):
            if threads is not None:
                idle = threads.wait_all(max(0.0, end - time.monotonic())) and idle
                threads.shutdown(cancel_queued=threads is not self._unloads)
        return idle

    def unload_all(self, drain_seconds, lock_seconds) -> bool:
        """Unloads every available version (server shutdown), each request still holding one
        given up to drain_seconds. Skipped (False) if a poll (a load, which cannot be interrupted)
        still holds the poll lock after lock_seconds; False too, after unloading, if a load on a
        load thread has not ended by then (its version unloads when it ends: nothing loads now)."""
        self._stop.set()
        end = time.monotonic() + lock_seconds
        if not self._poll_lock.acquire(timeout=lock_seconds):
            return False
        try:
            polls = self._model_polls
            loads_ended = polls is None or polls.wait_all(max(0.0, end - time.monotonic()))
            with self._lock:
                records = [(m, r) for m in self._models.values() for r in m.records.values()
                           if r.state == State.AVAILABLE]
            for m, r in records:
                self._unload(m, r, drain_seconds)
        finally:
            self._poll_lock.release()
        return loads_ended

    # ------------------------------------------------------------ lookups
    @contextlib.contextmanager
    def serving(self, model_spec):
        """The servable for model_spec, held for the whole request: it stays loaded (an
        unload waits for it) until the block exits, so the version a request was validated
        against is the one that runs it."""
        with self._lock:
            r = resolve_record(configured_model(self._models, model_spec) if model_spec.name else None, model_spec)
            r.in_flight += 1
            servable = r.servable
        try:
            yield servable
        finally:
            with self._lock:
                r.in_flight -= 1
                if r.in_flight == 0:
                    self._idle.notify_all()

    def status(self, model_spec):
        """GetModelStatusResponse.model_version_status entries (newest first)."""
        with self._lock:
            name = model_spec.name
            return version_statuses(self._models.get(name) or self._removed_models.get(name), model_spec)
