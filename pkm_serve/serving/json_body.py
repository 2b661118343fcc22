"""A REST body read as TF Serving reads it: json_tensor.cc's ParseJson hands the bytes to
rapidjson as UTF-8 (EncodedInputStream<UTF8<>, MemoryStream>, kParseNanAndInfFlag). orjson
reads most bodies; Python's json reads the rest (NaN/Infinity, integers beyond 64 bits) and
finds the fault of a body that is no JSON, told in rapidjson's words (json_parse_errors).

Python's json.loads, given bytes, guessed UTF-16/UTF-32 from NUL bytes and read such a body;
rapidjson reads every body as UTF-8, where a NUL byte is the end of the text: one where a
document should start is "The document is empty", one after the document ends it (what
follows is not read). The bytes EF, BB and BF at the start (a UTF-8 byte order mark, each
byte on its own) are skipped; offsets count them."""
import json
import math
import re

import orjson

from pkm_serve.serving import json_parse_errors, rest_requests
from pkm_serve.serving.errors import invalid

TOO_DEEP = "JSON Parse error: the document is nested too deeply"

# Finds a number of 20+ leading digits (an integer maybe beyond 64 bits), never the digits
# of a fraction, at C speed (a regex took longer than orjson's whole parse): digits become
# 0, the three characters a JSON value can follow become S, blanks and signs go.
_DIGITS_TABLE = bytes.maketrans(b"0123456789[,:", b"0000000000SSS")
_LONG_NUMBER = b"S" + b"0" * 20


def has_long_integer(body: bytes) -> bool:
    return _LONG_NUMBER in body.translate(_DIGITS_TABLE, b" \t\n\r-")


class _NumberTooBig(Exception):
    pass


def _rapidjson_float(text: str) -> float:
    """A number literal with a fraction or exponent as rapidjson reads it: refused where it
    refuses one as too big (Python's json read 1e400 as Infinity), else its double."""
    if ("e" in text or "E" in text or len(text) > 300) and json_parse_errors.rapidjson_number_too_big(text):
        raise _NumberTooBig(text)
    return float(text)


# rapidjson refuses a literal as too big only where it has a positive exponent over 308
# (three digits or more after the "e", leading zeros kept) or an integer part of 309+ digits;
# an integer literal (read by parse_int, not parse_float) too: Python's json kept it as an
# int, or refused one of 4300+ digits with a ValueError (a 500). The hooks that judge a
# literal run only for a body with such a spelling (a Python call for every number took
# 2-16x the parse): digits read as 0, "E" as "e", "+" dropped.
_NUMBER_SHAPES = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_EXPONENT = b"e000"
_DOUBLE_MAX_DIGIT_RUN = b"0" * 309


def _may_spell_too_big_number(body: bytes) -> bool:
    shapes = body.translate(_NUMBER_SHAPES, b"+")
    return _LONG_EXPONENT in shapes or _DOUBLE_MAX_DIGIT_RUN in shapes


def _rapidjson_int(text: str) -> int:
    if len(text) > 308 and json_parse_errors.rapidjson_number_too_big(text):
        raise _NumberTooBig(text)
    return int(text)


# A JSON string, or a spelling of a non-finite number that rapidjson's kParseNanAndInfFlag
# reads and Python's json does not (Inf, -Inf, -NaN); "Infin" is no Inf (rapidjson refuses it).
_STRING_OR_RAPIDJSON_NON_FINITE = re.compile(r'"(?:[^"\\]|\\.)*"|-?Inf(?:inity|(?!i))|-NaN', re.DOTALL)
_PYTHON_SPELLING = {"Inf": "Infinity", "-Inf": "-Infinity", "-NaN": "NaN"}


# A lone low-surrogate escape ("\\udcff"), which rapidjson 1.1.0 (TF Serving's) writes as the
# code point's three UTF-8 bytes (ED B3 BF). Python's json makes it the character a body byte
# 0xFF becomes under surrogateescape, so it reached a string tensor as that one byte; it is
# respelt as the escapes of its three bytes. (A surrogate pair is kept; `.` steps over any
# other escape, "\\\\" included.)
_MAY_HOLD_LOW_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][c-fC-F]")
_ESCAPE = re.compile(r"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|u([dD][c-fC-F][0-9a-fA-F]{2})|.)",
                     re.DOTALL)


def _as_utf8_byte_escapes(escape):
    if escape[1] is None:
        return escape[0]
    return "".join(f"\\udc{b:02x}" for b in chr(int(escape[1], 16)).encode("utf-8", "surrogatepass"))


def _respelt(token) -> str:
    text = token[0]
    if text[0] == '"':
        return _ESCAPE.sub(_as_utf8_byte_escapes, text) if "\\u" in text else text
    return _PYTHON_SPELLING.get(text, text)


def _as_rapidjson_reads(text: str):
    """(text Python's json reads as rapidjson reads the body, [(start, end, shift)] of each
    respelt token there, shift = its length in `text` less its respelt length): Inf/-Inf/-NaN
    and lone low-surrogate escapes respelt."""
    pieces, spans, at, grown = [], [], 0, 0
    for token in _STRING_OR_RAPIDJSON_NON_FINITE.finditer(text):
        new = _respelt(token)
        if new != token[0]:
            pieces += [text[at:token.start()], new]
            at, start = token.end(), token.start() + grown
            grown += len(new) - len(token[0])
            spans.append((start, start + len(new), -grown))
    return "".join(pieces) + text[at:], spans


def _body_place(pos, spans):
    """Where Python's fault at `pos` of the respelt text lies in the body's text; None
    inside a respelt token."""
    shift = 0
    for start, end, after in spans:
        if pos < start:
            break
        if pos < end:
            return None
        shift = after
    return pos + shift


def _bom_length(body: bytes) -> int:
    skipped = 0
    for byte in b"\xef\xbb\xbf":   # (each byte on its own, as rapidjson's stream skips them)
        skipped += body[skipped:skipped + 1] == bytes([byte])
    return skipped


def _read_text(text: str, **hooks):
    """json.loads of the text; a NUL byte after the document ends it, as for rapidjson."""
    try:
        return json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data" and e.doc[e.pos] == "\0":
            return json.loads(text[:e.pos], **hooks)
        raise


def _python_loads(body: bytes, **hooks):
    """The body read by Python's json (NaN/Infinity literals, huge integers), else
    ServingError with rapidjson's parse error."""
    skipped = _bom_length(body)
    text = body[skipped:].decode("utf-8", "surrogateescape")   # bytes not UTF-8 reach strings as sent
    blank = len(text) - len(text.lstrip(" \t\n\r"))
    if text[blank:blank + 1] in ("", "\0"):   # rapidjson's kParseErrorDocumentEmpty
        raise invalid(f"JSON Parse error: The document is empty. at offset: {skipped + blank}")
    if _may_spell_too_big_number(body):
        hooks.update(parse_float=_rapidjson_float, parse_int=_rapidjson_int)
    respelt, spans = text, []
    if _MAY_HOLD_LOW_SURROGATE_ESCAPE.search(body):   # (Python's json would read them otherwise)
        respelt, spans = _as_rapidjson_reads(text)
    try:
        try:
            return _read_text(respelt, **hooks)
        except json.JSONDecodeError:
            if spans:
                raise
            respelt, spans = _as_rapidjson_reads(text)
            if not spans:
                raise
            return _read_text(respelt, **hooks)
    except RecursionError:        # deeper than Python's stack (orjson stops at 1024 levels)
        raise invalid(TOO_DEEP) from None
    except json.JSONDecodeError as e:
        pos = _body_place(e.pos, spans)
        found = None if pos is None else json_parse_errors.rapidjson_words(e.msg, text, pos)
        raise _parse_error(e, body, skipped, text, found or (None, pos)) from None
    except _NumberTooBig:   # (at the literal's start: the first one too big, as Python's json reads in order)
        pos = next(_body_place(m.start(), spans) for m in json_parse_errors.NUMBER_OR_STRING.finditer(respelt)
                   if m[1] is not None and json_parse_errors.rapidjson_number_too_big(m[0]))
        raise _parse_error(None, body, skipped, text, ("Number too big to be stored in double.", pos)) from None


def _parse_error(err, body, skipped, text, words_at):
    """rapidjson's words for the fault (words, the character of the body's text where it
    lies; words None: Python's fault `err` kept), or for a lone high surrogate before it
    (rapidjson stops at the first)."""
    words, at = words_at
    offset = None if at is None else skipped + len(text[:at].encode("utf-8", "surrogateescape"))
    surrogate = json_parse_errors.lone_high_surrogate(body)
    if surrogate is not None and (offset is None or surrogate[1] < offset):
        return invalid(surrogate[0])
    if words is None:
        return invalid(f"JSON Parse error: {err}")
    return invalid(f"JSON Parse error: {words} at offset: {offset}")


def loads(body: bytes):
    if not body:   # json_tensor.cc's ParseJson (Python's json said "Expecting value: line 1 ...")
        raise invalid("JSON Parse error: The document is empty")
    doc = None
    if not has_long_integer(body):
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    if doc is None:
        doc = _python_loads(body)
        # (read, the body's text ends at its first NUL byte, if any: what follows is not read)
        surrogate = json_parse_errors.lone_high_surrogate(body.partition(b"\0")[0])
        if surrogate is not None:
            raise invalid(surrogate[0])
    if isinstance(doc, dict) and rest_requests.may_repeat_keys(body, doc):
        # Parsed again, keeping what json_tensor.cc's FindMember reads: a key's first spelling.
        doc = rest_requests.first_members(_python_loads(body, object_pairs_hook=rest_requests.json_object))
    return doc
