"""Byte encodings TF Serving reads that Python's standard decoders do not read the same way."""
import base64


_BASE64_BLANKS = b" \t\n\v\f\r"


def base64_as_tf_serving(text):
    """The bytes absl::Base64Unescape (TF Serving's decoder) makes of text, else None: blanks
    are skipped and the trailing padding ('=' or '.') may be left out, but if given must be
    complete ("AA" and "AA==" both decode; Python's strict b64decode refused "AA")."""
    if not isinstance(text, str) or not text.isascii():
        return None
    raw = text.encode("ascii").translate(None, _BASE64_BLANKS)
    body = raw.rstrip(b"=.")
    missing = -len(body) % 4
    if len(body) % 4 == 1 or len(raw) - len(body) not in (0, missing) or b"=" in body or b"." in body:
        return None
    try:
        return base64.b64decode(body + b"=" * missing, validate=True)
    except ValueError:   # binascii.Error: a character outside the alphabet
        return None


def string_list(content: bytes, count: int):
    """The strings of a DT_STRING tensor_content (what TF's Tensor::AsProtoTensorContent writes
    and Tensor::FromProto reads: count varint32 lengths, then the bytes), else None."""
    if count > len(content):   # each string takes at least its one-byte length
        return None
    lengths, pos = [], 0
    for _ in range(count):
        length = shift = 0
        while True:
            if pos >= len(content) or shift > 28:
                return None
            byte = content[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        lengths.append(length)
    if pos + sum(lengths) != len(content):
        return None
    strings = []
    for length in lengths:
        strings.append(content[pos:pos + length])
        pos += length
    return strings
