"""`pkm-serve serve`: wires config, op libraries, model manager, batching and front ends."""
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback

log = logging.getLogger("pkm_serve.serving")


# Beyond --drain_seconds, how long closing the ports and unloading the models may take
# before the process exits anyway: a part that never stops must not keep the server alive.
STOP_MARGIN_SECONDS = 5.0


class StartupError(Exception):
    pass


def _say(line):
    """Status lines on stdout; a closed or full-and-abandoned pipe must not stop the server."""
    try:
        print(line, flush=True)
    except (OSError, ValueError):
        pass


def load_op_libraries(load_pkm_ops: bool, extra_paths):
    """Registers custom ops before any model is loaded (a SavedModel that uses an op that
    is not registered cannot be loaded at all)."""
    import tensorflow as tf
    loaded = []
    if load_pkm_ops:
        try:
            from pkm_serve import ops
            ops.load_library()
            loaded.append(ops.library_path())
        except Exception as e:  # noqa: BLE001 - turned into one clear startup error
            raise StartupError(f"cannot load the pkm_serve op library ({type(e).__name__}: {e}). "
                               "Build it with `make build`, or pass --load_pkm_ops=false to serve "
                               "models that do not use PKM ops.") from None
    for path in extra_paths:
        if not os.path.exists(path):
            raise StartupError(f"--op_library {path!r} does not exist")
        try:
            tf.load_op_library(path)
        except Exception as e:  # noqa: BLE001
            raise StartupError(f"--op_library {path!r} failed to load: {e}") from None
        loaded.append(path)
    return loaded


class Server:
    """The running server; also usable in-process (tests, benchmarks)."""

    stop_step = None          # while stop() runs: the part it is stopping

    def __init__(self, args):
        from pkm_serve.serving import config as cfg
        try:
            configs = cfg.load_configs(args)   # every config file read once, here
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.args = args
        self._set_tf_threads(args)
        self.op_libraries = load_op_libraries(args.load_pkm_ops, args.op_library)
        self._make_model_side(args, configs)
        self._make_front_ends(args, configs)

    @staticmethod
    def _set_tf_threads(args):
        import tensorflow as tf
        if args.tensorflow_intra_op_parallelism:
            tf.config.threading.set_intra_op_parallelism_threads(args.tensorflow_intra_op_parallelism)
        if args.tensorflow_inter_op_parallelism:
            tf.config.threading.set_inter_op_parallelism_threads(args.tensorflow_inter_op_parallelism)

    def _make_model_side(self, args, configs):
        from pkm_serve.serving.batching import BatchScheduler
        from pkm_serve.serving.errors import ServingError
        from pkm_serve.serving.loader import make_loader_factory
        from pkm_serve.serving.manager import ModelManager
        from pkm_serve.serving.metrics import Metrics
        from pkm_serve.serving.service import InferenceService
        self.metrics = Metrics()
        try:
            self.batcher = BatchScheduler(configs.batching, self.metrics) \
                if configs.batching is not None else None
        except ValueError as e:
            raise StartupError(str(e)) from None
        from pkm_serve.serving.config import tflite_interpreters
        loaders = make_loader_factory(
            # As TF Serving, --num_request_iterations_for_warmup counts only when above 0.
            warmup=args.enable_model_warmup and max(1, args.num_request_iterations_for_warmup),
            prefer_tflite_model=args.prefer_tflite_model,
            num_tflite_interpreters=tflite_interpreters(args),
            tflite_threads=args.tflite_num_threads, saved_model_tags=args.saved_model_tags,
            tflite_interpreters_per_pool=args.num_tflite_interpreters_per_pool,
            gpu_memory_fraction=args.per_process_gpu_memory_fraction,
            per_model_batching=configs.batching is not None and args.enable_per_model_batching_parameters)
        try:   # the manager validates the model config (once)
            self.manager = ModelManager(
                configs.models, poll_seconds=args.file_system_poll_wait_seconds,
                loader_factory=loaders, metrics=self.metrics,
                config_file=args.model_config_file or None,
                config_poll_seconds=args.model_config_file_poll_wait_seconds,
                unload_drain_seconds=args.drain_seconds,
                allow_labels_for_unavailable=args.allow_version_labels_for_unavailable_models,
                max_num_load_retries=args.max_num_load_retries,
                load_retry_interval_seconds=args.load_retry_interval_micros / 1e6,
                num_load_threads=args.num_load_threads, num_unload_threads=args.num_unload_threads)
        except ServingError as e:
            raise StartupError(e.message) from None
        self.service = InferenceService(
            self.manager, self.batcher, self.metrics, max_request_bytes=args.max_request_bytes,
            outputs_as_tensor_content=args.enable_serialization_as_tensor_content,
            check_signature_method_name=args.enable_signature_method_name_check)

    def _make_front_ends(self, args, configs):
        from pkm_serve.serving.grpc_frontend import GrpcFrontend
        from pkm_serve.serving.rest_frontend import RestFrontend
        self.grpc = None
        self.rest = None
        monitoring = configs.monitoring
        if monitoring is not None and monitoring.prometheus_config.enable and not args.rest_api_port:
            raise StartupError("prometheus metrics are served on the REST port: set --rest_api_port")
        try:
            if args.port:
                self.grpc = GrpcFrontend(self.service, self.metrics, address=args.bind_address,
                                         port=args.port, max_threads=args.grpc_max_threads,
                                         max_message_bytes=args.max_request_bytes, ssl_config=configs.ssl,
                                         socket_path=args.grpc_socket_path,
                                         channel_arguments=args.grpc_channel_arguments)
            if args.rest_api_port:
                self.rest = RestFrontend(self.service, self.metrics, monitoring, address=args.bind_address,
                                         port=args.rest_api_port, num_threads=args.rest_api_num_threads,
                                         timeout_ms=args.rest_api_timeout_in_ms,
                                         max_body_bytes=args.max_request_bytes,
                                         drain_seconds=args.drain_seconds, ssl_config=configs.ssl,
                                         cors=args.rest_api_enable_cors_support)
        except (OSError, RuntimeError) as e:
            raise StartupError(f"cannot bind: {e}") from None

    def start(self):
        # Models first (as TF Serving does): by the time a port answers, the models it
        # was started with are loaded or reported as failed.
        self.manager.start()
        if self.grpc:
            self.grpc.start()
            self.grpc.set_serving(True)
            _say(f"pkm-serve: gRPC listening on {self.args.bind_address}:{self.grpc.port}")
            if self.grpc.socket_path:
                _say(f"pkm-serve: gRPC listening on unix:{self.grpc.socket_path}")
        if self.rest:
            self.rest.start()
            _say(f"pkm-serve: REST listening on {self.args.bind_address}:{self.rest.port}")
        _say("pkm-serve: ready")

    def stop(self):
        """Drains and stops every part, each within what is left of --drain_seconds +
        STOP_MARGIN_SECONDS; returns the parts that had not stopped by then (left behind:
        the process exits anyway, see main). `stop_step` names the part being stopped."""
        grace = self.args.drain_seconds
        end = time.monotonic() + grace + STOP_MARGIN_SECONDS

        def left():
            return max(0.0, end - time.monotonic())
        log.info("draining in-flight requests (up to %.0fs)", grace)
        self.manager.stop_waiting()   # a reload awaiting a new model's version must not hold the drain
        self.stop_step = "the gRPC and REST front ends"
        threads = []
        if self.grpc:
            threads.append(threading.Thread(target=self.grpc.stop, args=(grace, left()),
                                            name="the gRPC front end", daemon=True))
        if self.rest:
            threads.append(threading.Thread(target=self.rest.stop, name="the REST front end", daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(left())
        overran = [t.name for t in threads if t.is_alive()]
        self.stop_step = "the batch threads"
        if self.batcher and not self.batcher.stop(timeout=left()):
            overran.append(self.stop_step)
        self.stop_step = "the model poller"
        if not self.manager.stop(timeout=left()):
            overran.append(self.stop_step + " (a load)")
        self.stop_step = "unloading the models"
        # The front ends have drained: a request still in flight now is stuck in its model,
        # and closing the version's session is what cancels it.
        if not self.manager.unload_all(drain_seconds=min(1.0, left()), lock_seconds=left()):
            overran.append("unloading the models (a load still runs)")
        self.stop_step = None
        if overran:
            log.error("not stopped within %.0fs: %s", grace + STOP_MARGIN_SECONDS, "; ".join(overran))
        else:
            log.info("stopped")
        return overran


class _Wakeups:
    """The pipe the main thread sleeps on. CPython's C-level signal handler writes each
    signal's number into it (signal.set_wakeup_fd) in whichever thread the kernel picked:
    the kernel may deliver a process's SIGTERM to any thread, and a Python handler runs only
    in the main thread, when it next runs Python code, which a main thread asleep in a lock
    never does. The startup and stop threads write DONE when they finish. The Python-level
    handler does nothing: one that takes a lock (threading.Event.set) deadlocks if the
    signal arrives while the main thread holds that lock."""
    DONE = 0xFF            # not a signal number

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._pending = []
        self.last_signal = None   # the number of the signal wait() last answered "signal" for

    def install(self, signals):
        for sig in signals:
            signal.signal(sig, lambda *_: None)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def done(self):
        try:
            os.write(self._write, bytes([self.DONE]))
        except BlockingIOError:   # a full pipe is already readable
            pass

    def wait(self, timeout=None):
        """"signal", "done" or (after `timeout` seconds) "timeout"."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            remaining = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self._read], [], [], remaining)[0]:
                return "timeout"
            try:
                self._pending.extend(os.read(self._read, 64))
            except BlockingIOError:
                pass
        event = self._pending.pop(0)
        if event == self.DONE:
            return "done"
        self.last_signal = event
        return "signal"


class _InThread:
    """fn() in a daemon thread (so that the main thread can stop waiting for it); wakes
    `wakeups` with DONE when it returns or raises."""

    def __init__(self, name, fn, wakeups):
        self.result = self.error = None

        def run():
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
            finally:
                wakeups.done()
        threading.Thread(target=run, name=name, daemon=True).start()


def _start_server(args):
    server = Server(args)
    server.start()
    return server


def _stop_within_bound(server, wakeups):
    """Exit status: 0 when every part stopped within --drain_seconds + STOP_MARGIN_SECONDS;
    1 when one did not, a SIGINT came, or stopping failed. A repeated SIGTERM (an
    orchestrator's, or one sent to the process group and the process) does not cut the
    bounded drain short: in-flight requests still finish. A second SIGINT (Ctrl-C again)
    exits at once, as SIGKILL would."""
    bound = server.args.drain_seconds + STOP_MARGIN_SECONDS
    stopping = _InThread("stop", server.stop, wakeups)
    end = time.monotonic() + bound + 1.0   # Server.stop keeps to the bound itself: this is a backstop
    while True:
        event = wakeups.wait(max(0.0, end - time.monotonic()))
        if event != "signal" or wakeups.last_signal != signal.SIGTERM:
            break
        log.warning("SIGTERM while stopping %s: the drain goes on (SIGINT or SIGKILL to exit now)",
                    server.stop_step)
    if event == "done":
        if stopping.error is not None:
            log.error("shutdown failed: %s: %s", type(stopping.error).__name__, stopping.error)
        return 1 if stopping.error is not None or stopping.result else 0
    if event == "signal":
        log.warning("second stop signal (SIGINT): exiting while stopping %s", server.stop_step)
    else:
        log.error("shutdown did not finish within %.0fs (still stopping %s): exiting anyway",
                  bound, server.stop_step)
    return 1


def _exit(status):
    """Ends the process without the interpreter's finalization. After the stop, all it has
    left to do is collect modules and run libraries' exit hooks (1-4.5 s measured on a
    loaded 2-core machine), none of it bounded: concurrent.futures joins every worker thread
    at exit, forever when a request is stuck in a model."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def main(argv=None):
    from pkm_serve.serving import upstream_flags
    from pkm_serve.serving.config import parse_args
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    upstream_flags.log_inert(argv)
    wakeups = _Wakeups()
    wakeups.install((signal.SIGTERM, signal.SIGINT))
    # Start-up runs in a thread so that a signal while models load (TF's load and warmup
    # cannot be interrupted) ends the process at once: the ports open only after the loads.
    startup = _InThread("startup", lambda: _start_server(args), wakeups)
    if wakeups.wait() == "signal":
        _say("pkm-serve: shutting down")
        log.warning("stop signal during start-up: exiting without waiting for the models to load")
        _exit(0)
    if startup.error is not None:   # StartupError and friends: one line, exit 2
        from pkm_serve import cli

        if cli.verbose():
            traceback.print_exception(startup.error)
        # A module missing as the CLI words it: with the pip extra that installs it.
        error = startup.error
        message = cli.one_line(error) if isinstance(error, ModuleNotFoundError) else error
        print(f"pkm-serve serve: error: {message}", file=sys.stderr, flush=True)
        return 2
    while wakeups.wait() != "signal":
        pass
    _say("pkm-serve: shutting down")
    _exit(_stop_within_bound(startup.result, wakeups))
