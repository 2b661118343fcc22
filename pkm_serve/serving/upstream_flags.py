"""tensorflow_model_server flags (main.cc, server.cc) served for command-line parity: those
implemented, those accepted because they change no answer here (each says why in the log),
and those refused because leaving them out would change what the server answers."""
import logging
import math

log = logging.getLogger("pkm_serve.serving")

# Flags refused with a usage error, with what to do instead.
REFUSED = {
    "use_tflite_model": "use --prefer_tflite_model",
    **dict.fromkeys(["platform_config_file", "thread_pool_factory_config_file", "mixed_precision", "skip_initialize_tpu",
                     "use_alts_credentials", "enforce_session_run_timeout", "tensorflow_session_config_file",
                     "force_allow_any_version_labels_for_unavailable_models"],
                    "leave it out (`pkm-serve serve --help` lists the flags served)"),
    "version": "use `pkm-serve --version`",
}


def add_flags(flag, boolflag):
    flag("--saved_model_tags", default="serve",
         help="Comma-separated tags of the MetaGraph to load from each SavedModel (TF Serving's "
              "flag). Default serve.")
    flag("--tensorflow_session_parallelism", type=int, default=0,
         help="Threads of both TF thread pools (intra- and inter-op) when neither "
              "--tensorflow_intra_op_parallelism nor --tensorflow_inter_op_parallelism is set, "
              "as TF Serving; 0 = TF default.")
    flag("--per_process_gpu_memory_fraction", type=float, default=0.0,
         help="Fraction of each GPU's memory the server's TF Sessions may take (0 = TF default: "
              "grow as needed), as TF Serving's flag.")
    flag("--num_load_threads", type=int, default=0,
         help="Threads that load versions (TF Serving's flag). 0 (default): one model after "
              "another in the poll; N: up to N models load at once, so a model whose version "
              "is slow to load or waits between load retries does not hold back the others.")
    flag("--num_unload_threads", type=int, default=0,
         help="Threads that unload versions (TF Serving's flag). 0 (default): in the poll, which "
              "waits for the requests still holding the version (up to --drain_seconds); N: on N "
              "threads, so the poll goes on to the next model meanwhile.")
    boolflag("--rest_api_enable_cors_support", False,
             "Add CORS headers (Access-Control-Allow-Origin: *) to REST responses and answer "
             "CORS preflight requests (OPTIONS with an http(s) Origin header) 200, as TF Serving's flag.")
    for name, default, why in _INERT_BOOLS:
        boolflag(f"--{name}", default, f"Accepted for TF Serving parity: {why}.")
    for name, served, why in _FIXED_BOOLS:
        boolflag(f"--{name}", None, f"Accepted for TF Serving parity when {str(served).lower()}: {why}.")


# Boolean flags that change no answer here: (name, upstream default, why).
_INERT_BOOLS = [
    ("flush_filesystem_caches", True,
     "flushing only frees remote file systems' caches (memory; local paths have none), and "
     "TensorFlow's Python API cannot flush them, so true and false serve alike"),
    ("remove_unused_fields_from_bundle_metagraph", True,
     "it only frees MetaGraphDef fields (the graph) upstream keeps no use for; metadata here "
     "lists the signature defs, which it keeps, so true and false serve alike"),
]

# Boolean flags whose one value is what is served here: (name, that value, why). The other
# value would change answers, so it is a usage error.
_FIXED_BOOLS = [
    ("enable_profiler", False,
     "the gRPC port has no TensorFlow profiler service (ProfilerService), so true, TF Serving's "
     "default, is refused: a profile capture would fail"),
    ("xla_cpu_compilation_enabled", True,
     "TensorFlow compiles a model's jit_compile functions with XLA here; false (TF Serving's "
     "default, where such a model fails its first compilation) is refused"),
    ("enable_grpc_healthcheck_service", True,
     "the standard grpc.health.v1 Health service is always served on the gRPC port (SERVING once "
     "the models have loaded); false (TF Serving's default: no Health service) is refused"),
    ("xla_gpu_compilation_enabled", True,
     "TensorFlow compiles a model's jit_compile functions with XLA here (CPU and GPU); false is refused"),
]


def check_values(p, args):
    """Usage errors (parser p) for values TF Serving refuses or that cannot mean anything."""
    if not all(t.strip() for t in args.saved_model_tags.split(",")):
        p.error(f"--saved_model_tags {args.saved_model_tags!r} has an empty tag "
                "(give comma-separated tags, e.g. serve or serve,gpu)")
    if args.tensorflow_intra_op_parallelism > 0 and args.tensorflow_inter_op_parallelism > 0 \
            and args.tensorflow_session_parallelism > 0:
        p.error("Either configure --tensorflow_session_parallelism or (--tensorflow_intra_op_parallelism, "
                "--tensorflow_inter_op_parallelism) separately. You cannot configure all.")
    for name, served, why in _FIXED_BOOLS:
        if getattr(args, name) not in (None, served):
            p.error(f"--{name}={str(not served).lower()} cannot be served: {why}; leave the flag out "
                    f"or pass --{name}={str(served).lower()}")
    fraction = args.per_process_gpu_memory_fraction
    if not math.isfinite(fraction) or fraction < 0:
        p.error(f"--per_process_gpu_memory_fraction must be >= 0, got {fraction}")
    for name in ("num_load_threads", "num_unload_threads", "tensorflow_session_parallelism"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0, got {getattr(args, name)}")


def apply(args):
    """Folds the parity flags into the ones the server reads (after parsing)."""
    args.saved_model_tags = [t.strip() for t in args.saved_model_tags.split(",")]
    if args.tensorflow_session_parallelism and not (args.tensorflow_intra_op_parallelism
                                                     or args.tensorflow_inter_op_parallelism):
        # server.cc: with neither of the two set, both pools get the session parallelism.
        args.tensorflow_intra_op_parallelism = args.tensorflow_session_parallelism
        args.tensorflow_inter_op_parallelism = args.tensorflow_session_parallelism


def log_inert(argv):
    """One line per inert flag given on the command line, saying why it changes nothing."""
    given = {a.split("=", 1)[0][2:] for a in argv if a.startswith("--")}
    for name, _default, why in _INERT_BOOLS + _FIXED_BOOLS:
        if name in given:
            log.info("--%s changes nothing here: %s", name, why)
