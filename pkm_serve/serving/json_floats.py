"""Float outputs as the JSON numbers TF Serving writes.

json_tensor.cc's WriteDecimal prints a value by printf "%g" (six significant digits, as
absl::StrCat does), or, where that does not read back as the same value (strtof / strtod),
by "%.9g" for a float and "%.17g" for a double (max_digits10); ".0" is appended where the
text has neither "." nor "e", and NaN / Infinity / -Infinity are written as such. So a
float32 0.1 is 0.1, but 1.2345678 is 1.23456776 (not its shortest decimal).

Here each float32 value becomes the float64 nearest that decimal, which the JSON encoder
then prints by its shortest form: the same digits, hence the same number for any client
that parses them, and the same text where "%g" prints no exponent (|x| in [1e-4, 1e6));
elsewhere only the spelling may differ (1e-05 is written 0.00001, 1e+06 1000000.0). A
double is printed by its shortest decimal, which reads back as the same double as
upstream's 17 digits (0.1, where upstream writes 0.10000000000000001): printing 17 digits
costs ~1 us a value in Python, several times the rest of the encoding. float16 and bfloat16
(which json_tensor.cc does not write) take each value's own shortest decimal."""
import decimal

import numpy as np


_EXACT_POWERS_OF_TEN = 22   # 10**k is exact in float64 up to k = 22


def shortest_float32_as_float64(values: np.ndarray, like=np.float32) -> np.ndarray:
    """For float32 values (float16 with like=np.float16), the float64 nearest to each one's
    shortest round-trip decimal (what str(np.float32(x)) prints), so that JSON shows 0.1, not
    0.10000000149011612 (nor 0.099975586 for a half 0.1).

    Vectorised because per-element str() dominated the REST cost of a response: the
    decimal with p significant digits is m * 10**-k for an integer m; while 10**|k| is
    exact in float64 the quotient (or product) is correctly rounded, i.e. the float64
    nearest the decimal. p grows from 1 until the candidate rounds back to the value.
    Values beyond exact powers of ten (|x| < 1e-14 or >= 1e23) take the per-element path."""
    flat = values.astype(np.float64).reshape(-1)
    out = flat.copy()                                   # zeros, infinities, NaN stay as they are
    todo = np.isfinite(flat) & (flat != 0)
    exponent = np.floor(np.log10(np.abs(np.where(todo, flat, 1.0))))
    # Every digit count 1..9 must have an exact scale, else a longer decimal could be taken
    # for the shortest: k = digits - 1 - exponent spans [-exponent, 8 - exponent].
    vector = todo & (exponent >= -_EXACT_POWERS_OF_TEN + 8) & (exponent <= _EXACT_POWERS_OF_TEN)
    per_element, todo = todo & ~vector, vector
    # A decimal half a unit of its last digit away reads back only where that is within half
    # the value's (larger) gap to its neighbours in `like`: from far_digits digits on.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):   # inf/NaN: never in todo
        half_gap = np.spacing(np.abs(flat).astype(like)).astype(np.float64) / 2
        far_digits = exponent + 1 - np.log10(half_gap / 0.49)
    first_far = np.floor(far_digits[todo].min()) if todo.any() else np.inf
    for digits in range(1, 10):
        if not todo.any():
            break
        at = np.flatnonzero(todo)
        v, kk = flat[at], (digits - 1 - exponent)[at]
        scale = 10.0 ** np.abs(kk)
        up = kk >= 0
        scaled = np.where(up, v * scale, v / scale)
        nearest = np.rint(scaled)
        _take_round_trips(out, todo, at, nearest, scale, up, v, like)
        # Else the decimal on the other side, which may be the only one of these digits that
        # rounds back (a half 0.015625: 0.01562 does not, 0.01563 does).
        if digits < first_far:
            continue
        left = todo[at] & (digits >= far_digits[at] - 1e-9)
        if left.any():
            other = np.where(nearest[left] > scaled[left], np.floor(scaled[left]), np.ceil(scaled[left]))
            _take_round_trips(out, todo, at[left], other, scale[left], up[left], v[left], like)
    for i in np.flatnonzero(todo | per_element):
        out[i] = _shortest_one(flat[i], like)
    return out.reshape(values.shape)


def _shortest_one(value, like):
    """The float64 of the fewest-digit decimal that reads back as `value` in `like`. str()
    is that for numpy's float32 and float16, not for ml_dtypes' bfloat16 (6 digits always).
    At each digit count the nearest decimal, then the one on its other side (which alone may
    read back: bfloat16 2**-59 is 1.74e-18, not 1.735e-18); exact, in Decimal, as these values
    lie where float64 powers of ten are not."""
    if like in (np.float32, np.float16):
        return float(str(like(value)))
    target, exact = like(value), decimal.Decimal(float(value))
    for digits in range(1, 18):
        places = exact.adjusted() - digits + 1
        scaled = exact.scaleb(-places)
        nearest = scaled.to_integral_value(decimal.ROUND_HALF_EVEN)
        other = scaled.to_integral_value(decimal.ROUND_FLOOR if nearest > scaled else decimal.ROUND_CEILING)
        for m in (nearest, other):
            candidate = float(m.scaleb(places))
            if like(candidate) == target:
                return candidate
    return float(value)


def _take_round_trips(out, todo, at, m, scale, up, v, like):
    """Where the decimal m * 10**-k reads back as the value v (in `like`), it is the answer."""
    candidate = np.where(up, m / scale, m * scale)
    with np.errstate(over="ignore"):   # a too-short candidate may round past the half range
        ok = candidate.astype(like) == v.astype(like)
    out[at[ok]] = candidate[ok]
    todo[at[ok]] = False



# A float32 significand times 5**k (k <= 12) fits in 53 bits, so v * 10**k is exact there;
# beyond it (and v / 10**k) the result is rounded (relative error 2**-53), which only matters
# next to a half: such values take the exact path. 10**k itself is exact for k <= 22.
_EXACT_PRODUCT_DIGITS = 12
_NEAR_HALF = 4 * 2.0 ** -53


def write_decimal_float32(values: np.ndarray) -> np.ndarray:
    """For each float32 value, the float64 nearest the decimal json_tensor.cc's
    WriteDecimal<float> writes ("%.6g" where strtof reads it back as the value, else
    "%.9g"); zeros, infinities and NaN stay as they are.

    Vectorised (a per-value printf was 0.5 us a value): the decimal of p significant digits
    is rint(v * 10**k) / 10**k for k = p - 1 - floor(log10|v|). Values where that is not
    certainly right take "%.6g" / "%.9g" one at a time: |v| outside [1e-14, 1e22) (10**k
    not exact), a scaled value next to a half, and a six-digit decimal whose float64 lies
    halfway between two floats (float32(float64) rounds twice, strtof once)."""
    flat32 = np.ascontiguousarray(values, np.float32).reshape(-1)
    v = flat32.astype(np.float64)
    magnitude = np.abs(v)
    todo = (magnitude >= 1e-14) & (magnitude < 1e22)
    exponent = _decimal_exponent(np.where(todo, magnitude, 1.0))
    six, six_unsure = _round_to_digits(v, 6, exponent)
    nine, nine_unsure = _round_to_digits(v, 9, exponent)
    with np.errstate(over="ignore"):
        six_reads_back = six.astype(np.float32) == flat32
    out = np.where(six_reads_back, six, nine)
    exact = (~todo & np.isfinite(v) & (v != 0)) | (todo & (six_unsure | _float32_midpoint(six) |
                                                             (~six_reads_back & nine_unsure)))
    out = np.where(todo, out, v)
    at = np.flatnonzero(exact)
    out[at] = _write_decimal_float32_printf(v[at])
    return out.reshape(np.shape(values))


def _decimal_exponent(magnitude):
    """floor(log10(m)) exactly for m in [1e-22, 1e22] (log10 may be off by one at a power)."""
    e = np.floor(np.log10(magnitude))
    e -= magnitude < 10.0 ** e
    e += magnitude >= 10.0 ** (e + 1)
    return e


def _round_to_digits(v, digits, exponent):
    """(float64 nearest v rounded half to even to `digits` significant digits, as printf
    rounds; where that may be wrong: the scaled value was rounded and lies next to a half)."""
    k = digits - 1 - exponent
    scale = 10.0 ** np.abs(k)
    with np.errstate(invalid="ignore"):   # NaN and infinities: never read from here
        scaled = np.where(k >= 0, v * scale, v / scale)
        nearest = np.rint(scaled)
        # n / 10**k and n * 10**j, of exact operands, are the float64 nearest the decimal.
        decimal_value = np.where(k >= 0, nearest / scale, nearest * scale)
        rounded = (k > _EXACT_PRODUCT_DIGITS) | (k < 0)
        unsure = rounded & (np.abs(np.abs(scaled - np.trunc(scaled)) - 0.5) <= _NEAR_HALF * np.abs(scaled))
    return decimal_value, unsure


def _float32_midpoint(x):
    """Where the float64 x lies exactly halfway between two float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        toward = np.nextafter(f, np.where(x > f, np.float32(np.inf), np.float32(-np.inf))).astype(np.float64)
        return (x != f) & (x + x == f.astype(np.float64) + toward)


def _write_decimal_float32_printf(values):
    """write_decimal_float32 by printf itself, for the (few) values given."""
    xs = values.tolist()
    sixes = ["%.6g" % x for x in xs]
    back = np.array([float(t) for t in sixes])
    with np.errstate(over="ignore"):
        reads_back = back.astype(np.float32) == values.astype(np.float32)
    for i in np.flatnonzero(_float32_midpoint(back)).tolist():
        reads_back[i] = _strtof(sixes[i]) == np.float32(xs[i])
    return np.array([b if ok else float("%.9g" % x) for x, b, ok in zip(xs, back.tolist(), reads_back.tolist())])


def _strtof(text: str):
    """strtof of a decimal whose float64 lies halfway between two float32: rounded once."""
    d = float(text)
    with np.errstate(over="ignore"):
        f = np.float32(d)
    if float(f) == d:
        return f
    toward = np.nextafter(f, np.float32(np.inf) if d > float(f) else np.float32(-np.inf))
    exact, midpoint = decimal.Decimal(text), decimal.Decimal(d)
    if exact == midpoint:
        return f   # a true tie: float32() rounded it to even, as strtof does
    return toward if (exact > midpoint) == (float(toward) > float(f)) else f


_RAPIDJSON_FLOAT_RANGE = 3.4028234e38   # rapidjson's Value::IsFloat: a double within +-this
_JSON_INTEGER_RANGE = (-(1 << 63), (1 << 64) - 1)   # integers rapidjson keeps as integers


def json_number_text(v) -> str:
    """A JSON number as json_tensor.cc's JsonValueToString prints it in an error message: an
    integer as it is; a double (a literal with a fraction or exponent, or an integer past 64
    bits) through WriteDecimal, as a float where rapidjson's IsFloat holds (within +-3.4028234e38),
    else as a double: printf "%g" where that reads back as the value, else "%.9g" / "%.17g",
    ".0" added to a whole number ("1e+39", "1.23456788" for 1.2345678901, "2.0")."""
    if isinstance(v, int) and _JSON_INTEGER_RANGE[0] <= v <= _JSON_INTEGER_RANGE[1]:
        return str(v)
    try:
        d = float(v)
    except OverflowError:   # (an integer literal past the double range: rapidjson refuses the body)
        return str(v)
    if d != d:
        return "NaN"
    if abs(d) == float("inf"):
        return "Infinity" if d > 0 else "-Infinity"
    if abs(d) <= _RAPIDJSON_FLOAT_RANGE:
        value = float(np.float32(d))
        decimal_written = float(write_decimal_float32(np.array([value], np.float32))[0])
        six = "%g" % value
        text = six if float(six) == decimal_written else "%.9g" % value
    else:
        six = "%g" % d
        text = six if float(six) == d else "%.17g" % d
    return text if "." in text or "e" in text else text + ".0"
