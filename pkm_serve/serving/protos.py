"""TF Serving config messages that tensorflow-serving-api does not ship.

BatchingParameters (session_bundle_config.proto), MonitoringConfig
(monitoring_config.proto) and SSLConfig (ssl_config.proto) are declared here
with TF Serving's package, field names and numbers, so the very same text-proto
files work with `tensorflow_model_server` and with `pkm-serve serve`.
They live in a private descriptor pool so they never clash with a future
tensorflow-serving-api that ships them.
"""
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf import wrappers_pb2

_F = descriptor_pb2.FieldDescriptorProto


def _build_pool():
    pool = descriptor_pool.DescriptorPool()
    wrappers = descriptor_pb2.FileDescriptorProto()
    wrappers_pb2.DESCRIPTOR.CopyToProto(wrappers)
    pool.Add(wrappers)

    f = descriptor_pb2.FileDescriptorProto(
        name="pkm_serve/serving/tf_serving_configs.proto",
        package="tensorflow.serving",
        syntax="proto3",
        dependency=["google/protobuf/wrappers.proto"],
    )

    def msg(name, fields):
        m = f.message_type.add(name=name)
        for number, fname, ftype, type_name, repeated in fields:
            fd = m.field.add(name=fname, number=number, type=ftype,
                             label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                fd.type_name = type_name

    i64 = (_F.TYPE_MESSAGE, ".google.protobuf.Int64Value")
    boolean = (_F.TYPE_MESSAGE, ".google.protobuf.BoolValue")
    # Field numbers written out from TF Serving's .proto files (never derived from the
    # order here); tests/serving/test_serving_protos.py checks the binary encoding of each.
    # tensorflow_serving/servables/tensorflow/session_bundle_config.proto:
    msg("BatchingParameters", [
        (1, "max_batch_size", *i64, False),
        (2, "batch_timeout_micros", *i64, False),
        (3, "max_enqueued_batches", *i64, False),
        (4, "num_batch_threads", *i64, False),
        (5, "thread_pool_name", _F.TYPE_MESSAGE, ".google.protobuf.StringValue", False),
        (6, "allowed_batch_sizes", _F.TYPE_INT64, None, True),
        (7, "pad_variable_length_inputs", _F.TYPE_BOOL, None, False),
        # Wrappers upstream (bundle_factory_util.h reads has_...() and .value()).
        (8, "enable_large_batch_splitting", *boolean, False),
        (9, "max_execution_batch_size", *i64, False),
    ])
    # tensorflow_serving/config/monitoring_config.proto:
    msg("PrometheusConfig", [
        (1, "enable", _F.TYPE_BOOL, None, False),
        (2, "path", _F.TYPE_STRING, None, False),
    ])
    msg("MonitoringConfig", [
        (1, "prometheus_config", _F.TYPE_MESSAGE, ".tensorflow.serving.PrometheusConfig", False),
    ])
    # tensorflow_serving/config/ssl_config.proto:
    msg("SSLConfig", [
        (1, "server_key", _F.TYPE_STRING, None, False),
        (2, "server_cert", _F.TYPE_STRING, None, False),
        (3, "custom_ca", _F.TYPE_STRING, None, False),
        (4, "client_verify", _F.TYPE_BOOL, None, False),
    ])
    pool.Add(f)
    return pool


_POOL = _build_pool()


def _cls(name):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName("tensorflow.serving." + name))


BatchingParameters = _cls("BatchingParameters")
PrometheusConfig = _cls("PrometheusConfig")
MonitoringConfig = _cls("MonitoringConfig")
SSLConfig = _cls("SSLConfig")


def parse_text_file(path, message_cls, what):
    """Parses a text-proto file, raising ValueError that names the file and the problem."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} file {path!r}: {e.strerror}") from None
    msg = message_cls()
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        # TF Serving's wording (tensorflow_model_server_test.py testBadModelConfig greps it).
        raise ValueError(f"Error parsing text-format {message_cls.DESCRIPTOR.full_name} from "
                         f"{what} file {path!r}: {e}") from None
    return msg
