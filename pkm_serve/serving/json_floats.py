"""Float outputs as the JSON numbers TF Serving writes: each by its own shortest decimal."""
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
