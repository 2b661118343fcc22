"""A body that is not JSON, refused in the words of rapidjson (TF Serving's parser, through
json_tensor.cc's ParseJson: "JSON Parse error: <GetParseError_En> at offset: <byte>"), where
Python's json stops at the fault rapidjson stops at; it said "Expecting value: line 1 column 1
(char 0)". rapidjson stops at other bytes than Python's json in a few cases, placed here as it
does: a partial true/false/null or NaN/Infinity (past the letters it matched), a number missing
its fraction or exponent (Python's json read the number before and wanted a comma), a string
left open (at the end of the body)."""
import re

_LITERALS = {"t": "true", "f": "false", "n": "null"}
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_NUMBER_CHARS = frozenset("0123456789.eE+-")
_SAME_PLACE = {
    "Expecting property name enclosed in double quotes": "Missing a name for object member.",
    "Expecting ':' delimiter": "Missing a colon after a name of object member.",
    "Extra data": "The document root must not be followed by other values.",
    "Invalid \\escape": "Invalid escape character in string.",
}


def rapidjson_words(msg, text, pos):
    """(rapidjson's words, the character of `text` where it stops) for Python's json's fault
    `msg` at `pos`, else None (Python's words are kept)."""
    if msg in _SAME_PLACE:
        return _SAME_PLACE[msg], pos
    if msg == "Expecting value":
        return _invalid_value(text, pos)
    if msg == "Expecting ',' delimiter":
        return _after_a_value(text, pos)
    if msg.startswith("Unterminated string"):   # rapidjson reads on to the end of the body
        if (len(text) - len(text.rstrip("\\"))) % 2:   # a body ending in a lone backslash:
            return "Invalid escape character in string.", len(text) - 1   # the escape is refused
        return "Missing a closing quotation mark in string.", len(text)
    if msg.startswith("Invalid control character"):   # (a NUL byte ends rapidjson's string)
        if text[pos:pos + 1] == "\0":
            return "Missing a closing quotation mark in string.", pos
        # rapidjson 1.1.0 (TF Serving's) calls it an escape error; later versions "Invalid encoding".
        return "Invalid escape character in string.", pos
    if msg == "Invalid \\uXXXX escape":   # Python's json points past the backslash, rapidjson at it
        return "Incorrect hex digit after \\u escape in string.", pos - 1
    return None


def _invalid_value(text, pos):
    head = text[pos:pos + 1]
    if head in _LITERALS:   # ParseTrue & co. stop at the first letter that does not match
        literal, matched = _LITERALS[head], 1
        while matched < len(literal) and text[pos + matched:pos + matched + 1] == literal[matched]:
            matched += 1
        return "Invalid value.", pos + matched
    if head in ("N", "I") or (head == "-" and text[pos + 1:pos + 2] in ("N", "I")):
        stop = _nan_or_infinity_fault(text, pos + (head == "-"))
        return None if stop is None else ("Invalid value.", stop)
    return "Invalid value.", pos + (head == "-")   # ParseNumber takes a minus, then wants a digit


def _nan_or_infinity_fault(text, at):
    """Where ParseNumber's kParseNanAndInfFlag branch refuses the letters at `at` (it takes
    "N", "a", "N", else from where that failed "I", "n", "f" and, after an "i", "inity"),
    or None where it reads them as a number."""
    def take(letters):
        nonlocal at
        for letter in letters:
            if text[at:at + 1] != letter:
                return False
            at += 1
        return True
    if take("N") and take("a") and take("N"):
        return None
    if take("I") and take("n") and take("f"):
        return at if text[at:at + 1] == "i" and not take("inity") else None
    return at


def _after_a_value(text, pos):
    """Python's json read a value and wanted a comma: a number missing its fraction or
    exponent for rapidjson, else the comma or closing bracket of the innermost container."""
    start = pos
    while start > 0 and text[start - 1] in _NUMBER_CHARS:
        start -= 1
    number = text[start:pos].lower()
    after = text[pos:pos + 1]
    if number[-1:].isdigit() and "e" not in number:
        if after == "." and "." not in number:
            return "Missing fraction part in number.", pos + 1
        if after in ("e", "E"):
            return "Missing exponent in number.", pos + 1 + (text[pos + 1:pos + 2] in ("+", "-"))
    brackets = []
    for token in _STRING_OR_BRACKET.finditer(text, 0, pos):
        mark = token.group()
        if mark in "[{":
            brackets.append(mark)
        elif mark in "]}" and brackets:
            brackets.pop()
    if brackets[-1:] == ["{"]:
        return "Missing a comma or '}' after an object member.", pos
    return "Missing a comma or ']' after an array element.", pos


# A high-surrogate escape ("\ud800") whose low one does not follow: rapidjson 1.1.0 refuses the
# body (kParseErrorStringUnicodeSurrogateInvalid, at the escape's backslash), where Python's json
# keeps a lone surrogate (a string value then refused in this server's words, a name unmatched).
# orjson refuses such a body too, so this looks only at bodies Python's json read.
_MAY_HOLD_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB]")
_ESCAPE_OR_HIGH_SURROGATE = re.compile(rb"\\(?:(u[dD][89abAB][0-9a-fA-F]{2})(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|.)",
                                       re.DOTALL)


def lone_high_surrogate(body: bytes):
    """(rapidjson's parse error, its byte offset) for the first high-surrogate escape without
    its low one, else None."""
    if not _MAY_HOLD_HIGH_SURROGATE.search(body):
        return None
    for escape in _ESCAPE_OR_HIGH_SURROGATE.finditer(body):   # (each escape whole: "\\\\ud800" is none)
        if escape[1] and not escape[2]:
            return (f"JSON Parse error: The surrogate pair in string is invalid. at offset: {escape.start()}",
                    escape.start())
    return None


# rapidjson's ParseNumber refuses a literal as kParseErrorNumberTooBig (at its start) in two
# places only: an integer part that grows past DBL_MAX / 10 with digits left, and a positive
# exponent above 308 less the fraction digits it counted (17 significant digits at most).
# Any other literal past the double range is read as its (infinite) double, which
# json_tensor.cc's IsLosslessDecimal lets through.
NUMBER_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|-?(\d+)(?:\.(\d+))?(?:[eE]([+-]?)(\d+))?', re.DOTALL)
_TENTH_OF_DOUBLE_MAX = 1.7976931348623157e307
_MAX_SAFE_INTEGER = (1 << 53) - 1


def rapidjson_number_too_big(literal: str) -> bool:
    """Whether rapidjson refuses this JSON number literal as too big to be stored in double."""
    m = NUMBER_OR_STRING.fullmatch(literal)
    if m is None or m[1] is None:
        return False
    digits, fraction, exponent_sign, exponent = m.groups()
    if len(digits) > 308 and float(digits[:-1]) >= _TENTH_OF_DOUBLE_MAX:
        return True
    if exponent is None or exponent_sign == "-":
        return False
    return int(exponent) > 308 + _fraction_digits_counted(literal[0] == "-", digits, fraction or "")


def _fraction_digits_counted(negative, digits, fraction):
    """ParseNumber's -expFrac: the fraction digits it folds into the significand."""
    limit = 1 << 63 if negative else (1 << 64) - 1
    significand = int(digits)
    if significand > limit:   # read as a double from there on: no fraction digit counts
        return 0
    significant = len(digits) - 1 if digits != "0" else 0
    counted = 0
    for digit in fraction:
        if significand > _MAX_SAFE_INTEGER and significant >= 17:
            break
        significand = significand * 10 + int(digit)
        counted += 1
        significant += significand != 0
    return counted
