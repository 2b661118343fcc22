"""`pkm-serve serve`: wires config, op libraries, model manager, batching and front ends."""
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("pkm_serve.serving")


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
        loaders = make_loader_factory(
            warmup=args.enable_model_warmup, prefer_tflite_model=args.prefer_tflite_model,
            num_tflite_interpreters=args.num_tflite_pools or os.cpu_count() or 1,
            tflite_threads=args.tflite_num_threads)
        try:   # the manager validates the model config (once)
            self.manager = ModelManager(
                configs.models, poll_seconds=args.file_system_poll_wait_seconds,
                loader_factory=loaders, metrics=self.metrics,
                config_file=args.model_config_file or None,
                config_poll_seconds=args.model_config_file_poll_wait_seconds,
                unload_drain_seconds=args.drain_seconds)
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
                                         drain_seconds=args.drain_seconds, ssl_config=configs.ssl)
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
        grace = self.args.drain_seconds
        log.info("draining in-flight requests (up to %.0fs)", grace)
        threads = []
        if self.grpc:
            threads.append(threading.Thread(target=self.grpc.stop, args=(grace,)))
        if self.rest:
            threads.append(threading.Thread(target=self.rest.stop))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.batcher:
            self.batcher.stop()
        self.manager.stop()
        log.info("stopped")


def main(argv=None):
    from pkm_serve.serving.config import parse_args
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    # Installed before the slow start so a SIGTERM during model loading still exits cleanly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = Server(args)
        server.start()
    except Exception as e:  # noqa: BLE001 - StartupError and friends: one line, exit 2
        print(f"pkm-serve serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    while not stop.wait(3600):
        pass
    _say("pkm-serve: shutting down")
    server.stop()
    return 0
