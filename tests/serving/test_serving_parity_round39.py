"""Round 39 parity checks against tensorflow_model_server, in process (no server, no model):
a REST body is read as json_tensor.cc's ParseJson has rapidjson read it (as UTF-8, with
kParseNanAndInfFlag) -- a UTF-16/UTF-32 body refused where Python's json read it, a NUL byte
where a document starts or after it, a partial NaN/Infinity refused where rapidjson stops, and
a lone high surrogate reported where it comes before a later syntax error."""
import pytest

from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.rest_frontend import loads

_DOC = '{"instances": [1.0]}'


def _refusal(body):
    with pytest.raises(ServingError) as err:
        loads(body)
    assert err.value.code.name == "INVALID_ARGUMENT"
    return err.value.message


@pytest.mark.parametrize("body, words, offset", [
    # The byte order marks FF FE / FE FF are no value; "{\0" misses a name; a NUL first is
    # the end of the text, where the document should start.
    (_DOC.encode("utf-16"), "Invalid value.", 0),
    (_DOC.encode("utf-16-le"), "Missing a name for object member.", 1),
    (_DOC.encode("utf-16-be"), "The document is empty.", 0),
    (_DOC.encode("utf-32"), "Invalid value.", 0),
    (_DOC.encode("utf-32-be"), "The document is empty.", 0),
    (b" \n\x00" + _DOC.encode(), "The document is empty.", 2),
])
def test_a_body_in_utf16_or_utf32_is_refused(body, words, offset):
    """Python's json guessed the encoding from the NUL bytes and read these bodies."""
    assert _refusal(body) == f"JSON Parse error: {words} at offset: {offset}"


def test_a_utf8_byte_order_mark_is_skipped_and_counted():
    assert loads(b"\xef\xbb\xbf" + _DOC.encode()) == {"instances": [1.0]}
    broken = b"\xef\xbb\xbf" + _DOC.encode()[:-2] + b"}"
    assert _refusal(broken) == f"JSON Parse error: Missing a comma or ']' after an array element. at offset: {len(broken) - 1}"


def test_a_nul_byte_after_the_document_ends_the_text():
    assert loads(_DOC.encode() + b"\x00 what follows is not read") == {"instances": [1.0]}
    assert loads(_DOC.encode() + b'\x00 "\\ud800", Infin') == {"instances": [1.0]}
    assert _refusal(_DOC.encode() + b" x") == ("JSON Parse error: The document root must not be followed by "
                                               f"other values. at offset: {len(_DOC) + 1}")


@pytest.mark.parametrize("value, matched", [
    ("Na", "Na"), ("N", "N"), ("Nx", "N"), ("-Na", "-Na"), ("Infin", "Infin"), ("-Infin", "-Infin"),
    ("Infinit", "Infinit"), ("I", "I"), ("Ix", "I"), ("In", "In"),
])
def test_a_partial_nan_or_infinity_is_refused_past_the_letters_read(value, matched):
    """rapidjson's ParseNumber stops at the first letter that does not match (Python's json
    said "Expecting value" at the first letter, or read "Inf" and wanted a comma)."""
    head = '{"instances": [1.0, '
    body = f"{head}{value}]}}".encode()
    assert _refusal(body) == f"JSON Parse error: Invalid value. at offset: {len(head) + len(matched)}"


def test_a_fault_after_a_respelt_infinity_is_placed_in_the_body():
    """Inf / -NaN are read by respelling them for Python's json, which moved later offsets."""
    head = '{"instances": [Inf, -NaN, -Inf, "\\udcff", '
    assert _refusal(f"{head}tru]}}".encode()) == f"JSON Parse error: Invalid value. at offset: {len(head) + 3}"
    assert _refusal(f"{head}Infinity, Infx]}}".encode()) == ("JSON Parse error: Missing a comma or ']' after an "
                                                            f"array element. at offset: {len(head) + 13}")


@pytest.mark.parametrize("body", [
    b'{"a": "\\ud800x", "b": tru}', b'{"instances": ["\\ud800", ]}', b'{"instances": ["\\ud800"}',
    b'{"instances": ["\\ud800 never closed]}',
])
def test_a_lone_high_surrogate_before_a_syntax_error_is_the_error(body):
    offset = body.index(b"\\ud800")
    assert _refusal(body) == f"JSON Parse error: The surrogate pair in string is invalid. at offset: {offset}"


def test_a_syntax_error_before_a_lone_high_surrogate_is_the_error():
    body = b'{"a": tru, "b": "\\ud800x"}'
    assert _refusal(body) == f"JSON Parse error: Invalid value. at offset: {body.index(b'tru') + 3}"


def test_a_number_too_big_is_placed_in_the_body_as_rapidjson_places_it():
    """At the literal's start (its minus sign), after respelt Inf, and after a lone high surrogate
    that rapidjson meets first; it said "Number too big to be stored in double: 1e400"."""
    head = '{"instances": [Inf, "\\udcff", "caf\u00e9", '
    offset = len(head.encode())
    assert _refusal(f"{head}-1e400]}}".encode()) == f"JSON Parse error: Number too big to be stored in double. at offset: {offset}"
    body = b'{"a": "\\ud800", "b": 1e400}'
    assert _refusal(body) == "JSON Parse error: The surrogate pair in string is invalid. at offset: 7"


@pytest.mark.parametrize("body_value, dtype, shown", [
    # A double within rapidjson's IsFloat range is printed as the float it reads as: "%g" where
    # strtof reads that back, else "%.9g"; past that range as a double ("%g", else "%.17g").
    ("1.2345678901", "int64", "JSON Value: 1.23456788 Type: Number"),
    ("2147483647.0", "int32", "JSON Value: 2.14748365e+09 Type: Number"),
    ("1234567.0", "int32", "JSON Value: 1234567.0 Type: Number"),
    ("0.1", "int32", "JSON Value: 0.1 Type: Number"),
    ("3e39", "int64", "JSON Value: 3e+39 Type: Number"),
    ("1e-7", "int32", "JSON Value: 1e-07 Type: Number"),
    ("18446744073709551616", "uint64", "JSON Value: 1.84467441e+19 Type: Number"),   # past 64 bits: a double
    ("1e39", "float32", "Cannot convert JSON value: 1e+39 to float"),
])
def test_a_number_in_an_error_is_printed_as_json_tensor_writes_it(body_value, dtype, shown):
    """JsonValueToString prints doubles through WriteDecimal (absl::StrCat's "%g", "9e+06");
    it showed Python's repr ("1.2345678901", "1e39", "2147483647.0")."""
    import tensorflow as tf
    from pkm_serve.serving import tensors
    value = loads(f'{{"inputs": [{body_value}]}}'.encode())["inputs"]
    with pytest.raises(ServingError) as err:
        tensors.from_json("x", value, tf.TensorSpec(None, getattr(tf, dtype)))
    assert err.value.message.startswith(shown), err.value.message
