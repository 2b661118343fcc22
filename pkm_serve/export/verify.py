"""Runs original and fused signatures on the same inputs and compares them."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np


class VerificationError(Exception):
    """Fused outputs differ from the original, or sample inputs do not fit."""


# Summation order differs between the composite and the fused kernel; both
# accumulate in float32 for float32 tables, so differences stay near epsilon.
TOLERANCES = {"float32": (1e-4, 1e-5), "float64": (1e-6, 1e-8),
              "float16": (1e-2, 1e-3), "bfloat16": (3e-2, 1e-2)}


def signature_input_specs(fn) -> Dict[str, object]:
    """{name: TensorSpec} of a loaded signature function."""
    return dict(fn.structured_input_signature[1])


def _sparse_groups(specs) -> Dict[str, tuple]:
    """Signature inputs that are the flat (indices, values, dense_shape) parts of
    one SparseTensor: saved as NAME, NAME_1, NAME_2 (tf.function flattening),
    or written by hand as PREFIXindices, PREFIXvalues, PREFIX(dense_)shape."""
    groups = {}
    for name, spec in specs.items():
        values, shape = specs.get(name + "_1"), specs.get(name + "_2")
        if values is None or shape is None:
            continue
        if spec.dtype.name == "int64" and spec.shape.rank == 2 and \
                values.shape.rank == 1 and shape.dtype.name == "int64" and \
                shape.shape.rank == 1:
            groups[name] = (name, name + "_1", name + "_2")
    for name, spec in specs.items():
        if not name.endswith("indices") or spec.dtype.name != "int64" or \
                spec.shape.rank != 2:
            continue
        stem = name[:-len("indices")]
        values = stem + "values"
        shape = next((stem + s for s in ("dense_shape", "shape") if stem + s in specs), None)
        if values in specs and shape is not None and specs[values].shape.rank == 1 and \
                specs[shape].dtype.name == "int64":
            groups[name] = (name, values, shape)
    return groups


def _ragged_groups(specs, taken) -> Dict[str, tuple]:
    """Inputs NAME (flat values) and NAME_1 (row_splits) of one rank-2
    RaggedTensor, as tf.function flattens them. Not NAME_1 .. NAME_k of a deeper one: by name alone, three
    int vectors `input_layer`, `input_layer_1`, `input_layer_2` (Keras 3's names for scalar features) would
    be one; those are read off the saved function's RaggedTensorSpec (composites.py)."""
    groups = {}
    for name, spec in specs.items():
        splits = specs.get(name + "_1")
        if name in taken or name + "_1" in taken or splits is None or name + "_2" in specs or \
                spec.shape.rank != 1 or splits.shape.rank != 1 or \
                splits.dtype.name not in ("int32", "int64"):
            continue
        groups[name] = (name, name + "_1")
    return groups


def _fits(composite, specs) -> bool:
    """A composite's parts (pkm_serve/export/composites.py) are inputs of the
    ranks and dtypes its kind has."""
    if not composite or not all(p in specs for p in composite[1:]):
        return False
    ranks = [specs[p].shape.rank for p in composite[1:]]
    dtypes = [specs[p].dtype.name for p in composite[1:]]
    if composite[0] == "ragged":  # flat values and one row_splits per ragged dimension
        return len(ranks) >= 2 and ranks[0] == 1 and set(ranks[1:]) == {1} and \
            all(d in ("int32", "int64") for d in dtypes[1:])
    return ranks == [2, 1, 1] and dtypes[0] == dtypes[2] == "int64"


def _bag_sizes(rng, batch_size: int) -> np.ndarray:
    """1-4 ids per bag, one empty bag in the middle."""
    per_row = rng.integers(1, 5, size=batch_size)
    if batch_size > 2:
        per_row[batch_size // 2] = 0
    return per_row


def _sparse_layout(rng, batch_size: int, rank: int, width: int = 4):
    """Indices in canonical (row-major, sorted) order, as the segment ops of
    embedding_lookup_sparse require, and the dense shape: `width` columns (the
    table's rows where sparse_dense_matmul multiplies the SparseTensor by it)."""
    rows = []
    for b, count in enumerate(_bag_sizes(rng, batch_size)):
        cols = np.sort(rng.choice(width, size=min(count, width), replace=False))
        rows.extend([b] + [int(c)] + [0] * (rank - 2) for c in cols)
    indices = np.array(rows, np.int64).reshape(-1, rank)
    return indices, np.array(([batch_size, width] + [4] * (rank - 2))[:rank], np.int64)


def _row_partitions(rng, batch_size: int, patterns) -> Dict[tuple, List[np.ndarray]]:
    """{pattern: row_splits outermost first} for RaggedTensors whose ragged dimensions have these row
    lengths (None: 1-4 values a row, one empty; a length: every row that many, as a spec of shape
    [None, 3, None] requires). A pattern that begins a longer one shares its partitions, so session
    weights [users, (sessions)] line up with ids [users, (sessions), (items)]."""
    partitions: Dict[tuple, List[np.ndarray]] = {}
    for pattern in sorted(dict.fromkeys(patterns), key=len, reverse=True):
        longer = next((p for p in partitions if p[:len(pattern)] == pattern), None)
        if longer is not None:
            partitions[pattern] = partitions[longer][:len(pattern)]
            continue
        splits, rows = [], batch_size
        for length in pattern:
            sizes = _bag_sizes(rng, rows) if length is None else np.full(rows, length)
            splits.append(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
            rows = int(splits[-1][-1])
        partitions[pattern] = splits
    return partitions


def _row_lengths(feed, ragged_rank: int) -> tuple:
    lengths = getattr(feed, "row_lengths", None)
    return tuple(lengths) if lengths is not None and len(lengths) == ragged_rank else (None,) * ragged_rank


def generate_inputs(specs, index_limit: int, batch_size: int, seed: int = 0,
                    feeds: Optional[dict] = None) -> Dict[str, np.ndarray]:
    """Random inputs matching `specs`: integers in [0, index_limit) (valid row
    ids of every table the model gathers from), floats in [0.5, 1.5), sparse
    and ragged parts with valid layouts (shared by every sparse or ragged
    input, so ids and their weights line up), strings as `feeds`
    (pkm_serve.export.feeds) says: serialized tf.Examples or words."""
    rng = np.random.default_rng(seed)
    feeds = feeds or {}
    out: Dict[str, np.ndarray] = {}
    index_limit_of = _segment_limits(feeds, index_limit, batch_size)
    composites = [f.composite for f in feeds.values() if _fits(getattr(f, "composite", None), specs)]
    # Read off the saved function: sure where names are not. A name-made group that takes a
    # part of one is wrong: dense int64 [batch, 2] ids beside ragged ids (args_0, args_0_1,
    # args_0_2) are no SparseTensor.
    known = {p for _, *parts in composites for p in parts}
    sparse = {k: g for k, g in _sparse_groups(specs).items() if not set(g) & known}
    for kind, *parts in composites:
        if kind == "sparse":
            sparse[parts[0]] = tuple(parts)
    sparse_layout = {}  # (dense rank, width) -> (indices, dense_shape) shared by the groups
    for ind_name, val_name, shape_name in sparse.values():
        rank = specs[ind_name].shape[1] or 2
        width = getattr(feeds.get(shape_name), "sparse_width", None) or 4
        if (rank, width) not in sparse_layout:
            sparse_layout[rank, width] = _sparse_layout(rng, batch_size, rank, width)
        indices, dense_shape = sparse_layout[rank, width]
        out[ind_name] = indices
        out[shape_name] = dense_shape
        out[val_name] = _values(rng, specs[val_name].dtype, [len(indices)], index_limit_of(val_name),
                                feeds.get(val_name), val_name)
    taken = {n for group in sparse.values() for n in group}
    ragged = [tuple(parts) for kind, *parts in composites if kind == "ragged"]
    taken |= known
    ragged += list(_ragged_groups(specs, taken).values())
    patterns = [_row_lengths(feeds.get(val_name), len(splits_names)) for val_name, *splits_names in ragged]
    # Drawn where no input is ragged too, so the other inputs stay those generated before.
    partitions = _row_partitions(rng, batch_size, patterns or [(None,)])
    for (val_name, *splits_names), pattern in zip(ragged, patterns):
        # Groups of one pattern share their row partitions: ids and their weights line up.
        splits = partitions[pattern]
        for splits_name, part in zip(splits_names, splits):
            out[splits_name] = part.astype(specs[splits_name].dtype.as_numpy_dtype)
        out[val_name] = _values(rng, specs[val_name].dtype, [int(splits[-1][-1])], index_limit_of(val_name),
                                feeds.get(val_name), val_name)
    for name, spec in specs.items():
        if name in out:
            continue
        shape = [batch_size if (i == 0 and d is None) else (3 if d is None else d)
                 for i, d in enumerate(spec.shape.as_list())] \
            if spec.shape.rank is not None else [batch_size]
        out[name] = _values(rng, spec.dtype, shape, index_limit_of(name), feeds.get(name), name)
    _count_positions(out, feeds)
    return out


def _count_positions(out: Dict[str, np.ndarray], feeds) -> None:
    """num_segments of a segment op whose segment ids are positions the graph computes from shapes
    (tf.repeat(tf.range(B), K)): as many as the largest input has values, above every such position, not
    the table's rows (a 10M-row table asked for 10M bags in every verification run and warmup request)."""
    counted = [name for name, feed in feeds.items() if getattr(feed, "segments", None) == "positions"
               and name in out]
    largest = max([v.size for k, v in out.items() if k not in counted] + [1])
    for name in counted:
        out[name] = np.full_like(out[name], largest)


def _segment_limits(feeds, index_limit: int, batch_size: int):
    """name -> the bound of the ints generated for it: segment ids a segment op reads from an input are
    drawn from the batch, [0, min(batch, rows)), and its num_segments is that bound (drawn from [0, rows),
    num_segments asked for a table's rows of bags, each warmup request at each server start too); other
    ints, and num_segments where no input is segment ids (they may be any ids), keep [0, rows)."""
    roles = {name: getattr(feed, "segments", None) for name, feed in feeds.items()}
    bound = max(1, min(index_limit, batch_size)) if {"sorted", "ids"} & set(roles.values()) else index_limit
    return lambda name: bound if roles.get(name) in ("sorted", "ids", "count") else index_limit


def _values(rng, dtype, shape, index_limit, feed=None, name="?"):
    if dtype.is_integer:
        segments = getattr(feed, "segments", None)
        if segments == "count":  # num_segments above every segment id generated: [0, index_limit)
            return np.full(shape, max(index_limit, 1), dtype.as_numpy_dtype)
        ids = rng.integers(0, max(index_limit, 1), size=shape)
        if segments == "sorted":
            return np.sort(ids, axis=-1).astype(dtype.as_numpy_dtype)
        keys = getattr(feed, "int_keys", None)
        if keys:  # raw ids into a lookup table: mostly its keys, one in five other ids
            ids = np.where(rng.random(size=shape) < 0.8, rng.choice(np.array(keys), size=shape), ids)
        return ids.astype(dtype.as_numpy_dtype)
    if dtype.is_floating:
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype.as_numpy_dtype)
    if dtype.is_bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.name == "string":
        from pkm_serve.export import feeds as F
        vocabulary = feed.vocabulary if feed is not None else []
        if feed is not None and feed.features is not None:
            if len(shape) != 1:
                raise VerificationError(
                    f"input {name!r} feeds a tf.Example parser but has shape {shape}: "
                    "only a [batch] vector of serialized Examples can be generated; "
                    "pass --sample-inputs")
            return F.make_examples(rng, feed.features, vocabulary, shape[0], index_limit)
        if feed is not None and feed.tokens:
            return F.make_tokens(rng, vocabulary, shape)
        return F.make_text(rng, vocabulary, shape)
    raise VerificationError(f"cannot generate inputs of dtype {dtype.name} (input "
                            f"{name!r}): pass --sample-inputs")


def _as_strings(value: np.ndarray) -> Optional[np.ndarray]:
    """bytes (|S), str (<U) or object arrays of either -> object array of bytes."""
    if value.dtype.kind == "S":
        return value.astype(object)
    if value.dtype.kind == "U":
        return np.char.encode(value, "utf-8").astype(object)
    if value.dtype == object and all(isinstance(v, (bytes, str)) for v in value.flat):
        return np.array([v.encode() if isinstance(v, str) else v for v in value.flat],
                        dtype=object).reshape(value.shape)
    return None


def sample_inputs_for(signature: str, specs, samples) -> Dict[str, np.ndarray]:
    """Picks a signature's inputs out of an .npz: keys 'SIG/NAME' or 'NAME'."""
    chosen, problems = {}, []
    for name, spec in specs.items():
        key = f"{signature}/{name}" if f"{signature}/{name}" in samples else name
        if key not in samples:
            problems.append(f"missing input {name!r} ({spec.dtype.name} {spec.shape})")
            continue
        value = np.asarray(samples[key])
        if not spec.shape.is_compatible_with(value.shape):
            problems.append(f"input {name!r} has shape {list(value.shape)}, signature "
                            f"expects {spec.shape}")
            continue
        if spec.dtype.name == "string":
            strings = _as_strings(value)
            if strings is None:
                problems.append(f"input {name!r} has dtype {value.dtype}, signature "
                                "expects string (bytes |S or str <U arrays)")
                continue
            chosen[name] = strings
            continue
        want = spec.dtype.as_numpy_dtype
        if value.dtype != want:
            kind_ok = (np.issubdtype(value.dtype, np.integer) and spec.dtype.is_integer) or (
                np.issubdtype(value.dtype, np.floating) and spec.dtype.is_floating)
            if not kind_ok:
                problems.append(f"input {name!r} has dtype {value.dtype}, signature "
                                f"expects {spec.dtype.name}")
                continue
            value = value.astype(want)
        chosen[name] = value
    known = set(specs) | {f"{signature}/{n}" for n in specs}
    extra = sorted(k for k in samples if k not in known and
                   (("/" not in k) or k.split("/", 1)[0] == signature))
    if extra:
        problems.append(f"unexpected inputs {extra} (signature {signature!r} takes "
                        f"{sorted(specs)})")
    if problems:
        raise VerificationError(f"--sample-inputs do not match signature {signature!r}: "
                                + "; ".join(problems))
    return chosen


def _largest_finite(dtype) -> float:
    """The dtype's largest finite value (inf for dtypes numpy cannot describe)."""
    try:
        return float(np.finfo(dtype).max)
    except ValueError:
        try:
            import ml_dtypes  # bfloat16

            return float(ml_dtypes.finfo(dtype).max)
        except (ImportError, ValueError, TypeError):
            return float("inf")


def compare_outputs(signature: str, expected: dict, actual: dict,
                    rtol: Optional[float] = None,
                    atol_rel: Optional[float] = None,
                    precision: Optional[str] = None) -> List[dict]:
    """Per output: max abs/rel error; raises VerificationError past tolerance.
    Default tolerances follow the output dtype, or `precision` (a dtype name)
    when that is coarser: a float32 output of a float16 bag carries float16
    rounding. NaN where the original has NaN (a masked mean of an empty bag)
    counts as equal."""
    rows = []
    if set(expected) != set(actual):
        raise VerificationError(f"signature {signature!r}: outputs differ: "
                                f"{sorted(expected)} vs {sorted(actual)}")
    for key in sorted(expected):
        want = np.asarray(expected[key])
        got = np.asarray(actual[key])
        if want.shape != got.shape:
            raise VerificationError(f"signature {signature!r} output {key!r}: shape "
                                    f"{list(got.shape)} != original {list(want.shape)}")
        if not np.issubdtype(want.dtype, np.number) and want.dtype.name != "bfloat16":
            if not np.array_equal(want, got):
                raise VerificationError(f"signature {signature!r} output {key!r} differs")
            rows.append({"signature": signature, "output": key, "max_abs_err": 0.0})
            continue
        want64, got64 = want.astype(np.float64), got.astype(np.float64)
        default_rtol, default_atol_rel = TOLERANCES.get(want.dtype.name, (1e-4, 1e-5))
        if precision in TOLERANCES:
            default_rtol = max(default_rtol, TOLERANCES[precision][0])
            default_atol_rel = max(default_atol_rel, TOLERANCES[precision][1])
        use_rtol = default_rtol if rtol is None else rtol
        atol_rel_used = default_atol_rel if atol_rel is None else atol_rel
        both_nan = np.isnan(want64) & np.isnan(got64)
        want64, got64 = np.where(both_nan, 0.0, want64), np.where(both_nan, 0.0, got64)
        # The dtype's extremes (reduce_max of an empty bag gives the lowest value) must match
        # exactly and set no scale: one of them would make atol ~3e33 for every element.
        extreme = np.abs(want64) >= _largest_finite(want.dtype)
        finite = want64[np.isfinite(want64) & ~extreme]
        scale = float(np.max(np.abs(finite))) if finite.size else 0.0
        atol = atol_rel_used * max(scale, 1.0)
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities, zeroed below; no warning on stderr
            err = np.abs(want64 - got64)
        err = np.where(want64 == got64, 0.0, err)  # equal infinities
        max_abs = float(np.nanmax(err)) if np.any(~np.isnan(err)) else 0.0  # NaN on one side: _nan_mismatch
        within = np.where(extreme, err == 0.0, err <= atol + use_rtol * np.abs(want64))
        ok = np.all(within)  # False on any new NaN
        rows.append({"signature": signature, "output": key, "shape": list(want.shape),
                     "max_abs_err": max_abs, "rtol": use_rtol, "atol": atol})
        if not ok:
            raise VerificationError(
                f"signature {signature!r} output {key!r}: fused differs from original {_nan_mismatch(want64, got64)}"
                f"by up to {max_abs:.3g} (tolerance atol={atol:.3g}, rtol={use_rtol:g})")
    return rows


def _nan_mismatch(want64: np.ndarray, got64: np.ndarray) -> str:
    """Where one side alone is NaN (the largest difference, NaN-free, may be 0 then): how often, and "elsewhere"
    before the largest difference; "" where NaN sits in the same places."""
    parts = [f"{int(np.sum(np.isnan(a) & ~np.isnan(b)))} of {a.size} elements are NaN in the {name} alone"
             for name, a, b in (("original", want64, got64), ("fused model", got64, want64))
             if np.any(np.isnan(a) & ~np.isnan(b))]
    return f"({'; '.join(parts)}; elsewhere) " if parts else ""


# The fused model's refusal of an int64 num_segments it cannot count (segment_ids.int32_segment_count).
PAST_INT32_COUNT = "is past 2**31 - 1, the most bags the fused op"


def wrapped_count_note(message: str, original: dict) -> str:
    """Where the fused model refused a num_segments past int32 that the original answered: why the refusal is
    right (stock SparseSegment*WithNumSegments reads an int64 num_segments as int32, wrapping 2**32 + 2 to 2
    bags, where TF documents the output's first dimension as num_segments: the original's answer is wrong)."""
    if PAST_INT32_COUNT not in message:
        return ""
    shapes = sorted({tuple(np.shape(v)) for v in original.values()})
    if any(d > np.iinfo(np.int32).max for s in shapes for d in s):
        return ""  # the original answered the rows asked for (unsorted_segment_sum, memory allowing): no wrap
    return (f". The original answered with outputs of shape {', '.join(str(list(s)) for s in shapes)}: stock "
            "tf.sparse.segment_sum/mean/sqrt_n wrap an int64 num_segments past 2**31 - 1 into int32, where TF "
            "documents the output's first dimension as num_segments (which no int32-indexed kernel can give), "
            "so the fused model refuses it instead; verify with a num_segments below 2**31")


def error_line(message: str) -> str:
    """The line of a TF error that says what failed: a graph execution error
    wraps it in 'Detected at node' frames and ends it with the node's name."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("[[") and i > 0:
            return lines[i - 1]
    return lines[-1] if lines else message


def inputs_refused(name: str, samples, err) -> VerificationError:
    """The model (the original, or the one exported where nothing was fused) refuses the
    inputs it is verified on (a tf.errors.OpError `err`): generated ones may not be what it
    accepts (row splits fed apart from their values, say)."""
    hint = "" if samples is not None else (
        " (generated from the signature and the graph, which may not show what the model "
        "accepts: give it inputs it serves with --sample-inputs FILE.npz)")
    return VerificationError(f"the original model fails on the {'sample' if samples else 'generated'} "
                             f"inputs of signature {name!r}{hint}: {error_line(err.message)}")
