"""The config messages pkm_serve declares itself (protos.py) against TF Serving's field
numbers, in the binary encoding (text format would hide a wrong number).

Expected numbers and wire types are copied by hand from TF Serving's .proto files:
session_bundle_config.proto (BatchingParameters), monitoring_config.proto,
ssl_config.proto. The wire bytes are read and written here by a small independent
decoder/encoder, not by protobuf.
"""
import pytest

from pkm_serve.serving import protos

VARINT, LEN = 0, 2
# message -> {field: (number, wire type, value to set, how protobuf exposes it)}
TF_SERVING_FIELDS = {
    "BatchingParameters": {
        "max_batch_size": (1, LEN, 128),
        "batch_timeout_micros": (2, LEN, 5000),
        "max_enqueued_batches": (3, LEN, 7),
        "num_batch_threads": (4, LEN, 3),
        "thread_pool_name": (5, LEN, "pool"),
        "allowed_batch_sizes": (6, LEN, [32, 64, 128]),   # proto3 packs repeated int64
        "pad_variable_length_inputs": (7, VARINT, True),
        "enable_large_batch_splitting": (8, LEN, True),   # google.protobuf.BoolValue
        "max_execution_batch_size": (9, LEN, 32),
    },
    "PrometheusConfig": {"enable": (1, VARINT, True), "path": (2, LEN, "/metrics")},
    "SSLConfig": {"server_key": (1, LEN, "KEY"), "server_cert": (2, LEN, "CERT"),
                  "custom_ca": (3, LEN, "CA"), "client_verify": (4, VARINT, True)},
}


def _varint(data, pos):
    shift = value = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _enc_varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _fields(data):
    """[(number, wire type, raw value)] of a serialized message."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == VARINT:
            value, pos = _varint(data, pos)
        elif wire == LEN:
            n, pos = _varint(data, pos)
            value, pos = data[pos:pos + n], pos + n
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((number, wire, value))
    return out


# Fields whose type is a google.protobuf wrapper message ({value = 1}).
WRAPPED = {("BatchingParameters", n) for n in ("max_batch_size", "batch_timeout_micros",
                                               "max_enqueued_batches", "num_batch_threads",
                                               "thread_pool_name", "enable_large_batch_splitting",
                                               "max_execution_batch_size")}


def _encode_value(value, wrapped):
    """The wire form TF Serving's message has for a value of our table."""
    if wrapped:
        inner = (_enc_varint(1 << 3 | VARINT) + _enc_varint(value) if isinstance(value, int)
                 else _enc_varint(1 << 3 | LEN) + _enc_len(value.encode()))
        return _enc_len(inner)
    if isinstance(value, bool):
        return _enc_varint(int(value))
    if isinstance(value, str):
        return _enc_len(value.encode())
    if isinstance(value, list):       # packed repeated int64
        return _enc_len(b"".join(_enc_varint(v) for v in value))
    raise TypeError(value)


def _enc_len(payload):
    return _enc_varint(len(payload)) + payload


def _set(msg, name, value):
    field = msg.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None:   # wrapper types (Int64Value, StringValue)
        getattr(msg, name).value = value
    elif isinstance(value, list):
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)


def _get(msg, name):
    field = msg.DESCRIPTOR.fields_by_name[name]
    value = getattr(msg, name)
    if field.message_type is not None:
        return value.value
    return list(value) if isinstance(value, (list,)) or hasattr(value, "extend") else value


@pytest.mark.parametrize("message", sorted(TF_SERVING_FIELDS))
def test_every_field_encodes_with_tf_servings_number(message):
    cls = getattr(protos, message)
    expected = TF_SERVING_FIELDS[message]
    assert set(cls.DESCRIPTOR.fields_by_name) == set(expected), "fields differ from TF Serving's"
    assert {n for n, f in cls.DESCRIPTOR.fields_by_name.items() if f.message_type is not None} == \
        {n for m, n in WRAPPED if m == message}, "wrapper-typed fields differ from TF Serving's"
    for name, (number, wire, value) in expected.items():
        msg = cls()
        _set(msg, name, value)
        (got,) = _fields(msg.SerializeToString())
        assert got[:2] == (number, wire), f"{message}.{name}"


@pytest.mark.parametrize("message", sorted(TF_SERVING_FIELDS))
def test_bytes_written_with_tf_servings_numbers_parse_back(message):
    """The binary a TF Serving tool writes (built here by hand) parses into the right
    fields, and serializes back to the same bytes."""
    cls = getattr(protos, message)
    wire = b""
    for name, (number, wire_type, value) in sorted(TF_SERVING_FIELDS[message].items(), key=lambda kv: kv[1][0]):
        wire += _enc_varint(number << 3 | wire_type) + _encode_value(value, (message, name) in WRAPPED)
    msg = cls.FromString(wire)
    for name, (_number, _wire, value) in TF_SERVING_FIELDS[message].items():
        assert _get(msg, name) == value, f"{message}.{name}"
    assert msg.SerializeToString(deterministic=True) == wire


def test_monitoring_config_nests_prometheus_config_as_field_1():
    msg = protos.MonitoringConfig()
    msg.prometheus_config.enable = True
    ((number, wire, inner),) = _fields(msg.SerializeToString())
    assert (number, wire) == (1, LEN)
    assert _fields(inner) == [(1, VARINT, 1)]
    assert protos.MonitoringConfig.FromString(_enc_varint(1 << 3 | LEN) + _enc_len(b"\x08\x01")) == msg


def test_text_and_binary_agree_for_a_batching_file(tmp_path):
    path = tmp_path / "batching.config"
    path.write_text("max_batch_size { value: 64 } batch_timeout_micros { value: 1000 }\n"
                    "max_enqueued_batches { value: 5 } thread_pool_name { value: 't' }\n"
                    "allowed_batch_sizes: 8 allowed_batch_sizes: 64\n")
    msg = protos.parse_text_file(str(path), protos.BatchingParameters, "batching parameters")
    numbers = [n for n, _w, _v in _fields(msg.SerializeToString())]
    assert numbers == [1, 2, 3, 5, 6]
