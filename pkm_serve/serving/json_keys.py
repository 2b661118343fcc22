"""JSON objects that spell a key more than once, as json_tensor.cc meets them through rapidjson
(which keeps every member): FindMember (the body's keys, a columnar "inputs" object's names)
finds the first; MakeExampleFromJsonObject keeps a feature's last; IsValBase64Object counts
every member, so {"b64": x, "b64": y} is no base64 value; a named instance's repeated input
is refused here (AddInstanceItem appends each value to the tensor, shifting later rows).

Python's json and orjson keep a key's last value: where the body may repeat a key, it is
parsed again with json_object, which marks each such object."""
import json
import operator
import re
from itertools import repeat


class RepeatedKeys(dict):
    """A JSON object that spells a key more than once. Its items hold each key's last value
    (as Python's json and orjson read it), `pairs` every member in the body's order."""
    pairs: list


class FirstMembers(dict):
    """An object with a repeated key read as FindMember reads it: each key's first value;
    `pairs` every member as sent (an error message shows the object as JsonValueToString does)."""
    pairs: list


def json_object(pairs):
    """json.loads' object_pairs_hook: a dict, or RepeatedKeys where a key repeats."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    repeated = RepeatedKeys(obj)
    repeated.pairs = pairs
    return repeated


def first_members(doc):
    """The body as json_tensor.cc's FindMember reads it: a repeated key of the body or of its
    "inputs" object stands for its first value (Python's json kept the last)."""
    if isinstance(doc, RepeatedKeys):
        doc = _first_of(doc.pairs)
    if isinstance(doc, dict) and isinstance(doc.get("inputs"), RepeatedKeys):
        if type(doc) is dict:
            doc = _first_of(list(doc.items()))
        doc["inputs"] = _first_of(doc["inputs"].pairs)
    return doc


def _first_of(pairs):
    first = FirstMembers()
    for key, value in pairs:
        first.setdefault(key, value)
    first.pairs = pairs   # (the members as sent, later spellings and the "inputs" sent too)
    return first


def json_text(value) -> str:
    """A parsed JSON value as compact JSON; an object that spelled a key twice (a dict with
    its `pairs`) with every member, as rapidjson writes it."""
    pairs = getattr(value, "pairs", None)
    if pairs is not None:
        return "{" + ",".join(f"{json_text(k)}:{json_text(v)}" for k, v in pairs) + "}"
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):
        return repr(value)


# "b64" as the first member of an object, after blanks (plain `{"b64"` is counted apart).
_B64_FIRST_AFTER_BLANKS = re.compile(rb'\{[ \t\n\r]+"b64"')
_BLANKS_BEFORE_COLON = re.compile(rb'"[ \t\n\r]+:')


def may_repeat_keys(body: bytes, doc: dict) -> bool:
    """Whether some object of the body may spell a key twice (False is certain).

    Each key of the body ends with a quote and a colon, so the body's colons, and its
    `"`-then-colon pairs, are at least the keys it spells. The distinct keys are at least
    those of the parsed objects looked at here (the body, "inputs", "context", the named
    instances and the examples) plus each `"b64":` key of other objects, where every "b64"
    opens its object. Where either count of spelled keys equals that, no key
    is spelled twice. Else the body is parsed again. (A key spelled with escapes,
    "\\u0069nputs", counts as any other; it was looked for by its plain spelling, and
    {"b64": x, "b64": y} counted as two values.) The colons are counted first: where they are
    the looked-at objects' keys (most bodies: numbers, named instances, {"b64": ...}
    instances), that one pass decides (the search for "b64" came first, a second pass)."""
    objects, distinct = _objects_looked_at(doc)
    colons = body.count(b":")
    if colons == distinct:
        return False
    if b'"b64"' in body:
        # Where each "b64" opens its object, it is a key, and none is spelled twice in one (the
        # second would follow a comma); an object with another member has a key not counted here.
        # (`{"b64"` is counted, not searched for with blanks: each pass over a body of images costs.)
        spelled, opening = body.count(b'"b64"'), body.count(b'{"b64"')
        if spelled != opening:
            opening += len(_B64_FIRST_AFTER_BLANKS.findall(body))
            if spelled != opening:
                return True
        distinct += opening - sum(map(operator.contains, objects, repeat("b64")))
        if colons == distinct:
            return False
    return body.count(b'":') + len(_BLANKS_BEFORE_COLON.findall(body)) != distinct


def _objects_looked_at(doc):
    """(the parsed objects looked at, how many keys they hold)."""
    objects = [doc] + [doc[k] for k in ("inputs", "context") if isinstance(doc.get(k), dict)]
    keys = sum(map(len, objects))
    for key in ("instances", "examples"):
        items = doc.get(key)
        # (map over builtins: this runs per instance on the hot path)
        if isinstance(items, list) and items and all(map(isinstance, items, repeat(dict))):
            objects += items
            keys += sum(map(len, items))
    return objects, keys
