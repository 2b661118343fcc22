"""Command-line flags (TF Serving's names and meanings) and config files."""
import argparse
import collections
import logging
import math
import os

from tensorflow_serving.config import model_server_config_pb2

from pkm_serve.serving import protos, upstream_flags
from pkm_serve.serving.limits import DEFAULT_MAX_REQUEST_BYTES


def _bool(text):
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _ServeParser(argparse.ArgumentParser):
    """Checks the flags' values too, so that they are usage errors (exit 2) before
    TensorFlow loads (cli.run_command parses with this parser first)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        for arg in rest:
            name = arg.split("=", 1)[0]
            if name.startswith("--") and name[2:] in upstream_flags.REFUSED:
                self.error(f"{name} is a tensorflow_model_server flag that pkm-serve serve does not "
                           f"implement: {upstream_flags.REFUSED[name[2:]]}")
        if not rest:   # else parse_args names the unrecognized arguments first
            _check_values(self, parsed)
        return parsed, rest


def _add_tflite_flags(flag, boolflag):
    boolflag("--prefer_tflite_model", False,
             "Serve a version directory that holds model.tflite from that file (LiteRT with the "
             "pkm_serve delegate) instead of its SavedModel; directories without one are served "
             "from the SavedModel (TF Serving's flag).")
    flag("--num_tflite_pools", type=int, default=None,
         help="TFLite interpreters per served .tflite version; each runs one request at a time "
              "(TF Serving's flag; here every pool is one interpreter). Default: the number of "
              "CPUs this process may run on; 0 is one, as upstream's TfLiteSession takes max(1, N).")
    flag("--num_tflite_interpreters_per_pool", type=int, default=1,
         help="Above 1, each served .tflite version batches its own requests as TF Serving's "
              "TfLiteSession does with this flag: one batch thread per interpreter, requests "
              "queued while all are busy merged, a request split into runs of "
              "ceil(500 / N) rows (or the model's fixed batch size), one past 500 rows refused. "
              "Default 1: no such batching.")
    flag("--tflite_num_threads", type=int, default=1,
         help="Threads of each TFLite interpreter and of its pkm_serve delegate (1 to 256). Default 1.")


def _add_loading_flags(flag, boolflag):
    """How versions load: warmup, retries, labels on versions not loaded yet."""
    boolflag("--enable_model_warmup", True,
             "Replay each version's assets.extra/tf_serving_warmup_requests (PredictionLog "
             "records) before it serves, as TF Serving does; a version without that file runs "
             "nothing at load (no synthetic inputs: a signature may change the model's state).")
    flag("--num_request_iterations_for_warmup", type=int, default=1,
         help="Times each warmup record is replayed in a row (values below 1: once). Default 1.")
    boolflag("--allow_version_labels_for_unavailable_models", False,
             "Allow a new version label (or one kept on its version) to name a version that is not "
             "loaded yet; moving a label to one is still refused, as TF Serving does.")
    flag("--max_num_load_retries", type=int, default=5,
         help="Times a failed load is tried again before the version is given up (0 = one try). Default 5.")
    flag("--load_retry_interval_micros", type=int, default=60_000_000,
         help="Microseconds between the tries of a failed load (negative = no wait). Default one minute.")


def build_parser():
    # allow_abbrev=False: tensorflow_model_server's flags are never abbreviated, and a prefix
    # (--enable_batch, --model_base) must not silently stand for a flag.
    p = _ServeParser(
        prog="pkm-serve serve", allow_abbrev=False,
        description="A model server that speaks TensorFlow Serving's gRPC and REST APIs, with the "
                    "pkm_serve op library (and any --op_library) loaded before the models.")
    flag = p.add_argument

    def boolflag(name, default, help_):
        flag(name, type=_bool, nargs="?", const=True, default=default, metavar="BOOL", help=help_)

    flag("--port", type=int, default=8500, help="gRPC port (0 = disabled). Default 8500.")
    flag("--rest_api_port", type=int, default=0, help="REST/HTTP port (0 = disabled, the TF Serving default).")
    flag("--bind_address", default="127.0.0.1",
         help="Address to listen on. Default 127.0.0.1 (localhost only); use 0.0.0.0 to expose.")
    flag("--model_name", default="default", help="Model name when --model_base_path is used.")
    flag("--model_base_path", default="", help="Directory holding numeric version subdirectories.")
    flag("--model_config_file", default="", help="Text-format tensorflow.serving.ModelServerConfig.")
    flag("--model_config_file_poll_wait_seconds", type=float, default=0.0,
         help="Re-read --model_config_file this often (0 = read once).")
    flag("--file_system_poll_wait_seconds", type=float, default=1.0,
         help="Poll for new versions this often; 0 = once at startup, negative = never.")
    boolflag("--enable_batching", False, "Batch concurrent requests together.")
    flag("--batching_parameters_file", default="",
         help="Text-format BatchingParameters (max_batch_size, batch_timeout_micros, "
              "num_batch_threads, max_enqueued_batches, allowed_batch_sizes, "
              "enable_large_batch_splitting, max_execution_batch_size).")
    boolflag("--enable_per_model_batching_parameters", False,
             "Batch each version with the BatchingParameters of its own batching_params.pbtxt "
             "(in the version directory); a version without one is not batched. Only "
             "num_batch_threads comes from --batching_parameters_file (TF Serving's flag).")
    flag("--monitoring_config_file", default="",
         help="Text-format MonitoringConfig; prometheus_config serves metrics on the REST port.")
    flag("--ssl_config_file", default="", help="Text-format SSLConfig (server_key, server_cert, "
                                                "custom_ca, client_verify) for gRPC and REST.")
    boolflag("--enable_serialization_as_tensor_content", False,
             "Answer gRPC outputs in tensor_content (raw bytes) instead of the typed value fields "
             "(float_val, ...) that TF Serving fills by default.")
    boolflag("--enable_signature_method_name_check", False,
             "Refuse Classify/Regress on signatures whose method_name is not "
             "tensorflow/serving/classify or /regress, and Predict on ones whose method_name "
             "is none of predict/classify/regress (TF Serving's default: false).")
    _add_tflite_flags(flag, boolflag)
    flag("--grpc_socket_path", default="",
         help="Also serve gRPC on this UNIX domain socket.")
    flag("--grpc_channel_arguments", default="",
         help="gRPC server channel arguments, comma-separated key=value "
              "(e.g. grpc.max_connection_age_ms=60000); integer values are passed as integers.")
    flag("--op_library", action="append", default=[],
         help="Extra custom-op library (.so) to load before any model; repeatable or comma-separated.")
    boolflag("--load_pkm_ops", True,
             "Load pkm_serve's own op library (default true; false only for models without PKM ops "
             "on a machine where the library is not built).")
    _add_loading_flags(flag, boolflag)
    flag("--grpc_max_threads", type=int, default=64, help="Threads serving gRPC requests.")
    flag("--rest_api_num_threads", type=int, default=16, help="Threads running REST requests.")
    flag("--rest_api_timeout_in_ms", type=int, default=30000,
         help="Per-request REST deadline (0 = none, as TF Serving).")
    flag("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
         help="Largest accepted request (gRPC message or HTTP body), bytes. Default 64 MiB. "
              "Responses are not bound by it (gRPC: up to 2^31-1 bytes, as TF Serving).")
    flag("--drain_seconds", type=float, default=30.0,
         help="On SIGTERM/SIGINT, wait this long for in-flight requests before exiting.")
    flag("--tensorflow_intra_op_parallelism", type=int, default=0, help="0 = TF default.")
    flag("--tensorflow_inter_op_parallelism", type=int, default=0, help="0 = TF default.")
    upstream_flags.add_flags(flag, boolflag)
    flag("--log_level", default="INFO", help="Python logging level.")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    libs = []
    for item in args.op_library:
        libs.extend(x for x in item.split(",") if x)
    args.op_library = libs
    upstream_flags.apply(args)
    try:
        args.grpc_channel_arguments = parse_channel_arguments(args.grpc_channel_arguments)
    except ValueError as e:
        p.error(str(e))
    return args


def _check_values(p, args):
    """Usage errors for values the server would misuse: a port past 65535 was bound modulo
    65536 by gRPC (--port 70000 listened on 4464), a NaN poll period never loaded a model."""
    if not (args.model_config_file or args.model_base_path):
        p.error("give --model_base_path (with --model_name) or --model_config_file")
    if args.batching_parameters_file and not args.enable_batching:
        p.error("--batching_parameters_file needs --enable_batching")
    if args.enable_per_model_batching_parameters and not args.enable_batching:
        p.error("--enable_per_model_batching_parameters needs --enable_batching")
    for name in ("port", "rest_api_port"):
        if not 0 <= getattr(args, name) <= 65535:
            p.error(f"--{name} must be 0-65535 (0 = disabled), got {getattr(args, name)}")
    if args.port == 0 and args.rest_api_port == 0:
        p.error("both --port and --rest_api_port are 0: nothing to serve on")
    if args.port == args.rest_api_port:
        p.error(f"--port and --rest_api_port are both {args.port}: gRPC and REST need ports of their own")
    if not 0 < args.max_request_bytes < 2 ** 31:   # gRPC's limit is an int32
        p.error(f"--max_request_bytes must be 1 to {2 ** 31 - 1}, got {args.max_request_bytes} "
                "(past it gRPC failed at start-up: 'value too large to convert to int')")
    if (args.num_tflite_pools or 0) < 0 or args.num_tflite_interpreters_per_pool < 0:
        p.error("--num_tflite_pools and --num_tflite_interpreters_per_pool must be >= 0")
    from pkm_serve.tflite import MAX_DELEGATE_THREADS
    if not 1 <= args.tflite_num_threads <= MAX_DELEGATE_THREADS:
        # (the pkm_serve delegate's limit: past it every .tflite version failed its load)
        p.error(f"--tflite_num_threads must be 1 to {MAX_DELEGATE_THREADS}, got {args.tflite_num_threads}")
    for name in ("grpc_max_threads", "rest_api_num_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_num_load_retries < 0:
        p.error(f"--max_num_load_retries must be >= 0 (0: one try), got {args.max_num_load_retries}")
    if args.rest_api_timeout_in_ms < 0:
        p.error(f"--rest_api_timeout_in_ms must be >= 0 (0: no deadline), got {args.rest_api_timeout_in_ms}")
    for name in ("drain_seconds", "file_system_poll_wait_seconds", "model_config_file_poll_wait_seconds"):
        if not math.isfinite(getattr(args, name)):
            p.error(f"--{name} must be a finite number of seconds, got {getattr(args, name)}")
    if args.drain_seconds < 0:
        p.error(f"--drain_seconds must be >= 0, got {args.drain_seconds}")
    upstream_flags.check_values(p, args)
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        p.error(f"--log_level {args.log_level!r} is not a logging level "
                "(DEBUG, INFO, WARNING, ERROR or CRITICAL)")


def parse_channel_arguments(text):
    """"k1=v1,k2=v2" -> [(k1, v1), ...] with integer values as ints (TF Serving's format)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--grpc_channel_arguments: {item!r} is not key=value")
        value = value.strip()
        try:
            out.append((key.strip(), int(value)))
        except ValueError:
            out.append((key.strip(), value))
    return out


ServerConfigs = collections.namedtuple("ServerConfigs", "models batching monitoring ssl")


def load_configs(args) -> ServerConfigs:
    """Reads every config file the flags name, once; raises ValueError naming the file."""
    return ServerConfigs(models=model_server_config(args), batching=batching_parameters(args),
                         monitoring=monitoring_config(args), ssl=ssl_config(args))


def read_model_config_file(path):
    return protos.parse_text_file(path, model_server_config_pb2.ModelServerConfig, "model config")


def model_server_config(args):
    if args.model_config_file:
        if args.model_base_path:   # tensorflow/serving's docker entrypoint always passes it
            logging.getLogger("pkm_serve.serving").warning(
                "--model_config_file is set: --model_name and --model_base_path are ignored, as in TF Serving")
        cfg = read_model_config_file(args.model_config_file)
    else:
        cfg = model_server_config_pb2.ModelServerConfig()
        c = cfg.model_config_list.config.add()
        c.name = args.model_name
        path = args.model_base_path   # a URL (file://, gs://, s3://) is tf.io.gfile's to read
        c.base_path = path if "://" in path else os.path.abspath(path)
        c.model_platform = "tensorflow"
    return cfg


def batching_parameters(args):
    if not args.enable_batching:
        return None
    if args.batching_parameters_file:
        return protos.parse_text_file(args.batching_parameters_file, protos.BatchingParameters,
                                      "batching parameters")
    return protos.BatchingParameters()


def monitoring_config(args):
    if not args.monitoring_config_file:
        return None
    cfg = protos.parse_text_file(args.monitoring_config_file, protos.MonitoringConfig, "monitoring config")
    path = cfg.prometheus_config.path
    if path and not path.startswith("/"):   # no request path equals it: every scrape was a 404
        raise ValueError(f"monitoring config {args.monitoring_config_file!r}: prometheus_config path "
                         f"{path!r} must start with '/' (e.g. '/{path}')")
    return cfg


def ssl_config(args):
    if not args.ssl_config_file:
        return None
    cfg = protos.parse_text_file(args.ssl_config_file, protos.SSLConfig, "SSL config")
    if not cfg.server_key or not cfg.server_cert:
        raise ValueError(f"SSL config {args.ssl_config_file!r} needs server_key and server_cert (PEM text)")
    if cfg.client_verify and not cfg.custom_ca:
        raise ValueError(f"SSL config {args.ssl_config_file!r}: client_verify needs custom_ca")
    import ssl
    try:   # PEM text that does not load failed as gRPC's "cannot bind: Failed to bind to address"
        ssl_server_context(cfg)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"SSL config {args.ssl_config_file!r}: server_key, server_cert or custom_ca "
                         f"is not valid PEM (or the key does not match the certificate): {e}") from None
    return cfg


def ssl_server_context(cfg):
    """The ssl.SSLContext of an SSLConfig (REST's; gRPC takes the PEM text itself)."""
    import ssl
    import tempfile
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.NamedTemporaryFile("w", suffix=".pem") as cert, \
            tempfile.NamedTemporaryFile("w", suffix=".pem") as key:
        cert.write(cfg.server_cert)
        key.write(cfg.server_key)
        cert.flush()
        key.flush()
        ctx.load_cert_chain(cert.name, key.name)
    if cfg.custom_ca:
        ctx.load_verify_locations(cadata=cfg.custom_ca)
    if cfg.client_verify:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def tflite_interpreters(args) -> int:
    """Interpreters of each TFLite version: --num_tflite_pools, whose default upstream is
    the number of CPUs this process may run on (NumSchedulableCPUs: its affinity mask, not
    the machine's CPUs); an explicit 0 is one (TfLiteSession::Create takes max(1, N))."""
    if args.num_tflite_pools is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, args.num_tflite_pools)
