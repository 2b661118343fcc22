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
        for number, (fname, ftype, type_name, repeated) in enumerate(fields, start=1):
            if fname is None:
                continue
            fd = m.field.add(name=fname, number=number, type=ftype,
                             label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                fd.type_name = type_name

    i64 = (_F.TYPE_MESSAGE, ".google.protobuf.Int64Value")
    # Field numbers follow tensorflow_serving/servables/tensorflow/session_bundle_config.proto.
    msg("BatchingParameters", [
        ("max_batch_size", *i64, False),
        ("batch_timeout_micros", *i64, False),
        ("thread_pool_name", _F.TYPE_MESSAGE, ".google.protobuf.StringValue", False),
        ("num_batch_threads", *i64, False),
        ("max_enqueued_batches", *i64, False),
        ("allowed_batch_sizes", _F.TYPE_INT64, None, True),
        ("pad_variable_length_inputs", _F.TYPE_BOOL, None, False),
        ("enable_large_batch_splitting", _F.TYPE_MESSAGE, ".google.protobuf.BoolValue", False),
        ("max_execution_batch_size", *i64, False),
    ])
    msg("PrometheusConfig", [
        ("enable", _F.TYPE_BOOL, None, False),
        ("path", _F.TYPE_STRING, None, False),
    ])
    msg("MonitoringConfig", [
        ("prometheus_config", _F.TYPE_MESSAGE, ".tensorflow.serving.PrometheusConfig", False),
    ])
    msg("SSLConfig", [
        ("server_key", _F.TYPE_STRING, None, False),
        ("server_cert", _F.TYPE_STRING, None, False),
        ("custom_ca", _F.TYPE_STRING, None, False),
        ("client_verify", _F.TYPE_BOOL, None, False),
    ])
    pool.Add(f)
    return pool


_POOL = _build_pool()


def _cls(name):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName("tensorflow.serving." + name))


BatchingParameters = _cls("BatchingParameters")
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
        raise ValueError(f"{what} file {path!r} is not a valid text-format "
                         f"{message_cls.DESCRIPTOR.full_name}: {e}") from None
    return msg
