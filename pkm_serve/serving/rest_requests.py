"""REST request bodies -> tensors and tf.Examples, checked in the order and words of TF
Serving's json_tensor.cc (FillPredictRequestFromJson, FillClassifyRegressRequestFromJson).

Where json_tensor.cc prints a JSON value (JsonValueToString: the whole document for a
misplaced key) it is shown here compactly and cut at 200 characters. Deliberate differences,
all refusals of what upstream silently ignores: keys of a body besides those it reads, and
names of a columnar "inputs" object that the signature lacks."""
import json
import math
import re

from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow_serving.apis import input_pb2

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError, invalid
from pkm_serve.serving.json_keys import RepeatedKeys, first_members, json_object, may_repeat_keys  # noqa: F401

_FLOAT32_MAX = float(tensors.ml_dtypes.finfo("float32").max)


_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """`text` with each lone surrogate (a body byte that was not UTF-8, kept as rapidjson keeps
    it, or a JSON escape such as "\\udcff") as U+FFFD: a protobuf string (a signature name) and
    the answer's JSON take only valid Unicode (a signature_name holding such a byte was a 500)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def json_value(value, limit=200) -> str:
    """A JSON value as an error message shows it."""
    text = tensors.json_text(value)
    return text if len(text) <= limit else text[:limit] + "..."


def json_type(value) -> str:
    """json_tensor.cc's JsonTypeString."""
    if value is None:
        return "Null"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, dict):   # (RepeatedKeys too: it was "Number")
        return "Object"
    return {list: "Array", str: "String"}.get(type(value), "Number")


def is_b64(v):
    """json_tensor.cc's IsValBase64Object: one key, "b64", holding a string (no set built: it
    runs per instance). {"b64": 5} is an object like any other, as upstream reads it, and so
    are {"b64": x, "b64": y} (RepeatedKeys) and an object read by its first members."""
    return type(v) is dict and len(v) == 1 and isinstance(v.get("b64"), str)


def signature_name(doc):
    """Checked before any other field, as TF Serving's handler does."""
    name = doc.get("signature_name", "")
    if not isinstance(name, str):
        raise invalid(f"JSON Value: {json_value(doc)} not formatted correctly. "   # the document, as upstream
                      "'signature_name' key must be a string value.")
    return valid_unicode(name)   # (no signature has such a name: it is not found, a 400)


def check_predict_body(doc, sig_name, specs):
    """FillPredictRequestFromJson's checks after the signature is found: a signature without
    inputs, then the "instances" / "inputs" keys. Then this server's: no other keys."""
    if not specs:
        raise invalid(f"Failed to get input map for signature: {sig_name or 'DEFAULT'} (a signature "
                      "without inputs cannot be called over REST; the gRPC Predict API calls it)")
    if "instances" in doc:
        if "inputs" in doc:
            raise invalid(f"JSON Value: {json_value(doc)} Not formatted correctly expecting only one of "
                          "'inputs' or 'instances' keys to exist ")
        if not isinstance(doc["instances"], list):
            raise invalid(f"JSON Value: {json_value(doc)} Excepting 'instances' to be an list/array")
        if not doc["instances"]:
            raise invalid(f"JSON Value: {json_value(doc)} No values in 'instances' array")
    elif "inputs" not in doc:
        raise invalid("Missing 'inputs' or 'instances' key")
    unknown = set(doc) - {"signature_name", "instances", "inputs"}
    if unknown:
        raise invalid(f"unknown request field(s) {sorted(unknown)}; expected signature_name and "
                      "one of instances/inputs")


def _dense_shape(value):
    """json_tensor.cc's GetDenseTensorShape: the sizes along each list's first element."""
    shape = []
    while isinstance(value, list):
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _dense_fault(value, shape, level=0):
    """FillTensorProto's first complaint about a value that does not fill `shape` densely
    (None where it does): a value at another level than the rank, a list too deep, or a list
    of another size than the first one's at that level."""
    if not isinstance(value, list):
        if level != len(shape):
            return (f"JSON Value: {json_value(value)} found at incorrect level: {level + 1} in the JSON DOM. "
                    f"Expected at level: {len(shape)}")
        return None
    if level >= len(shape):
        return f"Encountered list at unexpected level: {level} expected < {len(shape)}"
    if len(value) != shape[level]:
        return f"Encountered list at unexpected size: {len(value)} at level: {level} expected size: {shape[level]}"
    for item in value:
        fault = _dense_fault(item, shape, level + 1)
        if fault:
            return fault
    return None


def _shape_text(shape):
    return "[" + ",".join(map(str, shape)) + "]"


def _from_json(name, value, spec, may_hold_bools, fault_of):
    """tensors.from_json, a ragged value refused in json_tensor.cc's words (`fault_of(value)`)
    where they can be found (this server's words were "input 'x' is ragged")."""
    try:
        return tensors.from_json(name, value, spec, may_hold_bools)
    except ServingError as err:
        fault = fault_of(value) if "is ragged" in err.message else None
        if fault:
            raise invalid(f"{fault} (input '{name}')") from None
        raise


def _is_named(value):
    return isinstance(value, dict) and not is_b64(value)


def rows_to_inputs(instances, specs, may_hold_bools=True):
    """FillTensorMapFromInstancesList: a plain list for a one-input signature, else a list of
    objects, each with exactly the signature's input names. Read at once (per input, the hot
    path); where that finds a fault, the one reported is the first in upstream's order."""
    if not isinstance(instances, list) or not instances:
        raise invalid("\"instances\" must be a non-empty list")
    if not _is_named(instances[0]) and len(specs) > 1:   # (upstream lets a {"b64": ...} by)
        raise invalid("instances is a plain list, but expecting list of objects as multiple input tensors "
                      f"required as per tensorinfo_map (the signature's inputs: {sorted(specs)})")
    try:
        return _rows_at_once(instances, specs, may_hold_bools)
    except ServingError:
        start = _first_bad_slice_start(instances, specs, may_hold_bools)
        fault = None if start is None else _first_element_fault(instances, specs, may_hold_bools, start)
        if fault is None:
            raise
        raise invalid(fault) from None


def _rows_at_once(instances, specs, may_hold_bools):
    named = _is_named(instances[0])
    names = specs.keys()
    for x in instances:
        # Compared as key views, no set built per instance (this loop is on the hot path); an
        # object that spelled a key twice is no dict proper (json_keys.RepeatedKeys).
        if _is_named(x) != named or (named and (x.keys() != names or type(x) is not dict)):
            raise invalid("the instances are not objects with the signature's input names")
    if not named:
        (name, s), = specs.items()
        return {name: tensors.from_json(name, instances, s, may_hold_bools)}
    return {k: tensors.from_json(k, [x[k] for x in instances], s, may_hold_bools) for k, s in specs.items()}


_SLICES, _ELEMENT_BY_ELEMENT = 16, 64


def _first_bad_slice_start(instances, specs, may_hold_bools):
    """Where to start looking element by element: every element before it is good, as upstream
    reads it. Found by reading slices at once, in 16ths, then 16ths of the first bad one, and
    so on (element by element from the start, a fault in the last of 200k instances took 20x
    a good request's time), a slice being good where it reads at once with the shapes of
    element 0. None where no slice is bad."""
    try:
        first = _rows_at_once(instances[:1], specs, may_hold_bools)
    except ServingError:
        return 0
    shapes = {k: v.shape[1:] for k, v in first.items()}
    named = _is_named(instances[0])
    lo, hi = 0, len(instances)
    while hi - lo > _ELEMENT_BY_ELEMENT:
        step = -(-(hi - lo) // _SLICES)
        for start in range(lo, hi, step):
            part = instances[start:start + step]
            if _is_named(part[0]) != named:
                break
            try:
                arrays = _rows_at_once(part, specs, may_hold_bools)
            except ServingError:
                break
            if any(v.shape[1:] != shapes[k] for k, v in arrays.items()):
                break
        else:
            return None
        lo, hi = start, min(start + step, hi)
    return lo


def _first_element_fault(instances, specs, may_hold_bools, start=0):
    """The first fault of "instances" from element `start` on (those before it are good) as
    AddInstanceItem meets them: element by element, each object's keys in their order (a key
    the signature lacks or spelt twice, a value that is not dense or of the input's type,
    another size or shape than the first element's), then its key set. None where none is found."""
    named = _is_named(instances[0])
    first_shapes = {}
    if start:
        first_shapes = ({k: _dense_shape(v) for k, v in instances[0].items()} if named
                        else {next(iter(specs)): _dense_shape(instances[0])})
    for i in range(start, len(instances)):
        x = instances[i]
        if _is_named(x) != named:
            return (f"Expecting object but got list at item {i} of input list" if named else
                    f"Expecting value/list but got object at item {i} of input list")
        seen = set()
        for key, value in (getattr(x, "pairs", x.items()) if named else [(next(iter(specs)), x)]):
            fault = _item_fault(key, value, specs, may_hold_bools, first_shapes)
            if fault is None and key in seen:   # (upstream appends both values: later rows shift)
                fault = f"JSON object: has named input: {key} more than once"
            seen.add(key)
            if fault:
                where = f" key: {key}" if named else ""
                return f"Failed to process element: {i}{where} of 'instances' list. Error: INVALID_ARGUMENT: {fault}"
        if named and x.keys() != specs.keys():
            return (f"Failed to process element: {i} of 'instances' list. JSON object: "
                    f"{json_value(x)} keys must be equal to: {','.join(sorted(specs))}")
    return None


def _item_fault(key, value, specs, may_hold_bools, first_shapes):
    """AddInstanceItem's complaint about one input's value in one element, else None."""
    if key not in specs:
        return f"JSON object: does not have named input: {key}"
    shape = _dense_shape(value)
    fault = _dense_fault(value, shape)
    if fault:
        return fault
    try:
        tensors.from_json(key, value, specs[key], may_hold_bools)
    except ServingError as err:
        return err.message
    first = first_shapes.setdefault(key, shape)
    if math.prod(shape) != math.prod(first):
        return f"Expecting tensor size: {math.prod(first)} but got: {math.prod(shape)}"
    if shape != first:
        return f"Expecting shape {_shape_text(first)} but got: {_shape_text(shape)}"
    return None


def columns_to_inputs(value, specs, may_hold_bools=True):
    """FillTensorMapFromInputsMap: a plain value for a one-input signature, else an object with
    each of the signature's input names (and, here, no other)."""
    if not _is_named(value):
        if len(specs) > 1:
            raise invalid("inputs is a plain value/list, but expecting an object as multiple input tensors "
                          f"required as per tensorinfo_map (the signature's inputs: {sorted(specs)})")
        (name, s), = specs.items()
        return {name: _from_json(name, value, s, may_hold_bools, _columns_fault)}
    for name in sorted(specs):
        if name not in value:
            raise invalid(f"Missing named input: {name} in 'inputs' object.")
    if set(value) != set(specs):
        raise invalid(f"\"inputs\" has {tensors.input_mismatch(specs, value)}; "
                      f"the signature expects {sorted(specs)}")
    return {k: _from_json(k, v, specs[k], may_hold_bools, _columns_fault) for k, v in value.items()}


def _columns_fault(value):
    return _dense_fault(value, _dense_shape(value))


def _feature_kind(name, v):
    """The Feature list a JSON value goes in, checked as TF Serving's AddValueToFeature does."""
    if isinstance(v, bool):
        return "int64"
    if isinstance(v, int):
        if v >= 1 << 63 and v < 1 << 64:
            raise invalid(f"Feature: {name} has uint64 element. Only int64 is supported.")
        if not -(1 << 63) <= v < 1 << 63:   # JSON integers have no bound; int64/float do
            raise invalid(f"feature value {json_value(v, 100)} of feature {name} is out of range")
        return "int64"
    if isinstance(v, float):
        # IsLosslessDecimal<float>: a finite double must lie in float32's range.
        if math.isfinite(v) and abs(v) > _FLOAT32_MAX:
            raise tensors.lossy_decimal_error(v, "float")
        return "float"
    if isinstance(v, str) or is_b64(v):
        return "bytes"
    raise invalid(f"Feature: {name} has element with unexpected JSON type: {json_type(v)}")


def feature(value, name=""):
    """A JSON feature value -> tf.train.Feature (TF Serving's JSON example encoding): every
    element must go in the same list (int64, float or bytes), as in TF Serving, so a JSON
    integer is never silently turned into a float."""
    values = value if isinstance(value, list) else [value]
    f = feature_pb2.Feature()
    kind = None
    for v in values:
        k = _feature_kind(name, v)
        if kind is not None and k != kind:
            raise invalid(f"Unexpected element type in feature: {name} expecting type: {kind}")
        kind = k
    if kind == "int64":
        f.int64_list.value.extend(int(v) for v in values)
    elif kind == "float":
        f.float_list.value.extend(values)
    elif kind == "bytes":
        f.bytes_list.value.extend(tensors.decode_b64(v) for v in values)   # validated base64
    return f


def example(obj):
    if not isinstance(obj, dict):
        raise invalid(f"Example must be JSON object but got JSON {json_type(obj)}")
    ex = example_pb2.Example()
    # Every member in order, a repeated feature's last value kept (MakeExampleFromJsonObject
    # reads each one: an earlier faulty value is refused, where the last value alone was read).
    for k, v in getattr(obj, "pairs", obj.items()):
        if valid_unicode(k) != k:   # (a tf.train.Example's feature key is a protobuf string: it was a 500)
            raise invalid(f"Feature name: {valid_unicode(k)} is not valid UTF-8")
        ex.features.feature[k].CopyFrom(feature(v, k))
    return ex


def example_input(doc):
    """FillClassifyRegressRequestFromJson: the context (if any), then the examples, in its
    words (which say "classify" for a regression too)."""
    inp = input_pb2.Input()
    if "context" in doc:
        inp.example_list_with_context.context.CopyFrom(example(doc["context"]))
    examples = doc.get("examples")
    if "examples" not in doc:
        raise invalid(f"JSON Value: {json_value(doc)} When method is classify, key 'examples' is expected "
                      "and was not found")
    if not isinstance(examples, list):
        raise invalid(f"JSON Value: {json_value(doc)} Expecting 'examples' value to be an list/array")
    if not examples:
        raise invalid(f"JSON Value: {json_value(doc)} 'examples' value is an empty array")
    target = inp.example_list_with_context if "context" in doc else inp.example_list
    target.examples.extend(example(e) for e in examples)
    unknown = set(doc) - {"signature_name", "examples", "context"}
    if unknown:
        raise invalid(f"unknown request field(s) {sorted(unknown)}")
    return inp
