"""TFLite model files for pkm_serve: the flatbuffer schema, int8 tables
(``quantize_table_int8``) and a one-op PkmEmbeddingBag model built without
TensorFlow. ``pkm_serve.tflite`` re-exports all of it; running models is
there. Needs a flatbuffer schema module (LiteRT's or TensorFlow's) only
when a function here reads or writes a model.
"""

from __future__ import annotations

import importlib
import struct
from typing import Dict, List, Optional

import numpy as np

from pkm_serve.tflite_metadata import (  # noqa: F401  (pkm_serve.tflite re-exports them)
    SIGNATURE_DEFS_METADATA,
    metadata_names,
    signature_defs_metadata_size,
)

CUSTOM_OP_NAME = "PkmEmbeddingBag"
# Ragged bags (values + row_splits), fused from embedding_lookup_sparse sites.
RAGGED_CUSTOM_OP_NAME = "PkmRaggedEmbeddingBag"
CUSTOM_OP_NAMES = (CUSTOM_OP_NAME, RAGGED_CUSTOM_OP_NAME)


def flatbuffer_schema():
    """The TFLite flatbuffer schema module (LiteRT's, else TensorFlow's)."""
    return _schema("flatbuffer_schema")


def _schema(what: str = "flatbuffer_schema"):
    for name in ("ai_edge_litert.schema_py_generated",
                 "tensorflow.lite.python.schema_py_generated"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    # (It named quantize_table_int8 whichever function asked.)
    raise ImportError(f"{what} needs the TFLite flatbuffer schema of ai_edge_litert or tensorflow, "
                      "and neither is installed (tflite_runtime has none): pip install ai-edge-litert")


def _custom_code(model, opcode_index: int) -> Optional[str]:
    code = model.operatorCodes[opcode_index].customCode
    if code is None:
        return None
    return code.decode() if isinstance(code, bytes) else code


TFLITE_FILE_IDENTIFIER = b"TFL3"


def check_tflite_bytes(model_bytes, what: str = "model") -> None:
    """ValueError unless ``model_bytes`` starts like a TFLite flatbuffer (a
    root offset, then the file identifier ``TFL3``): without that check the
    schema's reader takes any 4 bytes as an offset and fails far inside with a
    struct.error ("unpack_from requires a buffer of at least ... bytes")."""
    if not isinstance(model_bytes, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what}: expected the model's bytes, got {type(model_bytes).__name__}")
    data = bytes(model_bytes[:8])
    if len(model_bytes) < 8 or data[4:8] != TFLITE_FILE_IDENTIFIER:
        head = data[:8]
        raise ValueError(f"{what}: the {len(model_bytes)} bytes given are not a TFLite flatbuffer "
                         f"(no file identifier {TFLITE_FILE_IDENTIFIER.decode()!r} at bytes 4..8; "
                         f"they start {head!r}); pass the contents of a .tflite file")


def _finite_rows(table: np.ndarray) -> np.ndarray:
    """``table`` as float32 [N, D]; a NaN or infinite value is a ValueError naming its row."""
    table = np.asarray(table, dtype=np.float32)
    if table.ndim != 2:
        raise ValueError(f"table must be rank 2, got shape {table.shape}")
    bad = np.argwhere(~np.isfinite(table))
    if bad.size:
        r, c = (int(i) for i in bad[0])
        raise ValueError(f"row {r} of the table holds {table[r, c]} (column {c}): an int8 row "
                         f"cannot hold NaN or infinity ({len(np.unique(bad[:, 0]))} such rows)")
    return table


def quantize_rows_int8(table: np.ndarray):
    """Symmetric per-row int8: q = round(x / s), s = max|row| / 127 (1 for a zero row;
    at least float32's smallest subnormal, where max|row| / 127 would round to 0, as
    the kernels take only positive finite scales). ``quantize_table_int8`` uses the
    affine ``quantize_rows_int8_affine``; this stays for callers of the symmetric form.

    Returns (q int8 [N, D], scales float32 [N]). A NaN or infinite value is a
    ValueError naming its row: no int8 row can hold it.
    """
    table = _finite_rows(table)
    max_abs = np.max(np.abs(table), axis=1) if table.shape[1] else np.zeros(table.shape[0])
    scales = np.where(max_abs > 0, max_abs.astype(np.float64) / 127.0, 1.0).astype(np.float32)
    scales = np.maximum(scales, np.finfo(np.float32).smallest_subnormal)
    q = np.clip(np.rint(table / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


# The smallest step of a row, relative to its largest |value|: keeps |zero point| under
# 2**23 + 129 (an int32 in TFLite's TfLiteIntArray, exact as the kernel's float32), at
# a cost of at most max|row| * 2**-24, float32's own rounding of the row.
_MIN_RELATIVE_STEP = 2.0 ** -23


def quantize_rows_int8_affine(table: np.ndarray):
    """Affine (asymmetric) per-row int8, TFLite's x = s * (q - z): each row's
    [min, max] is mapped onto [-128, 127] with s = max((max - min) / 255,
    max|row| * 2**-23) rounded up to float32 (at least float32's smallest
    subnormal) and the integer zero point z = round(-128 - min / s).

    Every value is within s / 2 of s * (q - z) (computed in float64), so a row
    whose values sit away from 0 (all in [5, 6], say) keeps (max - min) / 510,
    where the symmetric max|row| / 254 would lose 12 times more. A constant row
    is exact. The kernel adds s * q and the bias -s * z (about the row's midpoint)
    in float32, so its sums also carry float32 rounding of the rows' magnitudes. Returns (q int8 [N, D], scales float32 [N], zero_points int64 [N]).
    A NaN or infinite value is a ValueError naming its row.
    """
    table = _finite_rows(table)
    n = table.shape[0]
    x = table.astype(np.float64)
    lo = x.min(axis=1) if x.shape[1] else np.zeros(n)
    hi = x.max(axis=1) if x.shape[1] else np.zeros(n)
    step = np.maximum((hi - lo) / 255.0, np.maximum(np.abs(lo), np.abs(hi)) * _MIN_RELATIVE_STEP)
    zero_row = step == 0
    step = np.where(zero_row, 1.0, step)
    scales = step.astype(np.float32)
    scales = np.where(scales.astype(np.float64) < step, np.nextafter(scales, np.float32(np.inf)), scales)
    scales = np.maximum(scales, np.finfo(np.float32).smallest_subnormal)
    s = scales.astype(np.float64)
    # A zero row keeps z = 0: the kernel sums a bag's -s * z apart from its s * q, and a
    # bias of 128 there would cost the other rows of the bag float32 precision.
    zero_points = np.where(zero_row, 0.0, np.rint(-128.0 - lo / s))
    q = np.clip(np.rint(x / s[:, None]) + zero_points[:, None], -128, 127).astype(np.int8)
    return q, scales, zero_points.astype(np.int64)


def _ints(xs) -> List[int]:
    return [] if xs is None else [int(x) for x in xs]


def _table_readers(model):
    """((subgraph, tensor) pairs of each buffer, whether every read of each
    tensor is as input 0 of a bag op (unread: True))."""
    tensors_of_buffer: Dict[int, List[tuple]] = {}
    only_params: Dict[tuple, bool] = {}
    for si, subgraph in enumerate(model.subgraphs):
        for ti, tensor in enumerate(subgraph.tensors or []):
            tensors_of_buffer.setdefault(int(tensor.buffer), []).append((si, ti))
        for ti in _ints(subgraph.inputs) + _ints(subgraph.outputs):
            only_params[(si, ti)] = False
        for op in subgraph.operators or []:
            is_bag = _custom_code(model, op.opcodeIndex) in CUSTOM_OP_NAMES
            for pos, ti in enumerate(_ints(op.inputs)):
                if ti >= 0:
                    key = (si, ti)
                    only_params[key] = only_params.get(key, True) and is_bag and pos == 0
    return tensors_of_buffer, only_params


def _float_table_types(schema) -> Dict[int, object]:
    """The table tensor types quantised, with the numpy dtype of their buffers."""
    types = {schema.TensorType.FLOAT32: np.float32, schema.TensorType.FLOAT16: np.float16}
    try:
        import ml_dtypes  # numpy's bfloat16 (TensorFlow's dependency; not every TFLite runtime's)

        types[schema.TensorType.BFLOAT16] = ml_dtypes.bfloat16
    except ImportError:
        pass
    return types


def _quantisable_tables(model, schema):
    """([(buffer index, the tensors sharing it, numpy dtype)] of the constant float
    tables that only bag ops read, as their params; how many are read elsewhere too)."""
    types = _float_table_types(schema)
    tensors_of_buffer, only_params = _table_readers(model)
    found, shared, done = [], 0, set()
    for subgraph in model.subgraphs:
        for op in subgraph.operators or []:
            if _custom_code(model, op.opcodeIndex) not in CUSTOM_OP_NAMES or not _ints(op.inputs):
                continue
            tensor = subgraph.tensors[int(op.inputs[0])]
            kept = _dequantized_table(model, schema, subgraph, int(op.inputs[0]))
            if kept is not None and kept not in done:   # its DEQUANTIZE kept: read elsewhere too
                done.add(kept)
                shared += 1
            buffer_index = int(tensor.buffer)
            if buffer_index in done or tensor.type not in types:
                continue
            done.add(buffer_index)
            data = model.buffers[buffer_index].data
            if data is None or len(data) == 0:
                continue  # not a constant table (e.g. a model input): leave it float
            users = tensors_of_buffer[buffer_index]
            same = [model.subgraphs[si].tensors[ti] for si, ti in users]
            if not all(only_params.get(key, True) for key in users) or any(
                    u.type != tensor.type or _ints(u.shape) != _ints(tensor.shape) for u in same):
                shared += 1  # read as float elsewhere: leave it float
                continue
            found.append((buffer_index, same, types[tensor.type]))
    return found, shared


def _dequantized_table(model, schema, subgraph, tensor_index):
    """The buffer of the constant float table whose DEQUANTIZE makes this tensor (one
    _bypass_dequantize left in place), else None."""
    for op in subgraph.operators or []:
        if tensor_index in _ints(op.outputs) and _builtin_code(model, op.opcodeIndex) == \
                schema.BuiltinOperator.DEQUANTIZE and len(_ints(op.inputs)) == 1:
            src = subgraph.tensors[int(op.inputs[0])]
            data = model.buffers[int(src.buffer)].data
            if src.type in _float_table_types(schema) and data is not None and len(data):
                return int(src.buffer)
    return None


def _builtin_code(model, opcode_index: int) -> int:
    code = model.operatorCodes[opcode_index]
    return max(int(code.builtinCode or 0), int(code.deprecatedBuiltinCode or 0))


def _bypass_dequantize(model, schema) -> None:
    """Bag ops whose params are a DEQUANTIZE of a constant float table (the
    converter's float16 weight quantization) read that constant instead, and
    the DEQUANTIZE is dropped, so the constant is quantised like any table.
    Only where every tensor of the constant's buffer (one per signature) feeds
    one such DEQUANTIZE alone, and each DEQUANTIZE's output only bag params."""
    dequantize = schema.BuiltinOperator.DEQUANTIZE
    float_types = _float_table_types(schema)
    tensors_of_buffer, only_params = _table_readers(model)
    found: Dict[tuple, tuple] = {}   # (subgraph, src tensor) -> (DEQUANTIZE op, its output)
    for si, subgraph in enumerate(model.subgraphs):
        reads: Dict[int, int] = {}
        for op in subgraph.operators or []:
            for ti in _ints(op.inputs):
                reads[ti] = reads.get(ti, 0) + 1
        io = set(_ints(subgraph.outputs) + _ints(subgraph.inputs))
        for op in subgraph.operators or []:
            ins, outs = _ints(op.inputs), _ints(op.outputs)
            if _builtin_code(model, op.opcodeIndex) != dequantize or len(ins) != 1 or len(outs) != 1:
                continue
            src = subgraph.tensors[ins[0]]
            data = model.buffers[int(src.buffer)].data
            if (src.type in float_types and data is not None and len(data) and reads[ins[0]] == 1
                    and ins[0] not in io and reads.get(outs[0], 0)
                    and only_params.get((si, outs[0]), False)):
                found[(si, ins[0])] = (op, outs[0])
    for si, subgraph in enumerate(model.subgraphs):
        rewire, dropped = {}, set()
        for (sj, src), (op, out) in found.items():
            buffer = int(subgraph.tensors[src].buffer) if sj == si else None
            if buffer is not None and all(key in found for key in tensors_of_buffer[buffer]):
                rewire[out] = src
                dropped.add(id(op))
        subgraph.operators = [op for op in subgraph.operators or [] if id(op) not in dropped]
        for op in subgraph.operators:
            if _custom_code(model, op.opcodeIndex) in CUSTOM_OP_NAMES and _ints(op.inputs)[:1]:
                if int(op.inputs[0]) in rewire:
                    op.inputs = [rewire[int(op.inputs[0])]] + _ints(op.inputs)[1:]


def _already_int8(model, schema) -> str:
    """A note for the no-table error when bag ops already read int8 tables."""
    buffers = {int(sg.tensors[int(op.inputs[0])].buffer) for sg in model.subgraphs for op in sg.operators or []
               if _custom_code(model, op.opcodeIndex) in CUSTOM_OP_NAMES and _ints(op.inputs)[:1]
               and sg.tensors[int(op.inputs[0])].type == schema.TensorType.INT8}
    return (f" ({len(buffers)} int8 table(s) already: this model was quantized before)"
            if buffers else "")


def _tables_through_branches(model) -> str:
    """A note for the no-table error where bag ops of a called subgraph (a tf.cond or
    tf.while_loop branch, no signature's) read their table as its input: the caller's
    operand, left float with the branch's input."""
    signatures = {int(sig.subgraphIndex) for sig in model.signatureDefs or []} | {0}
    count = sum(1 for si, sg in enumerate(model.subgraphs) if si not in signatures for op in sg.operators or []
                if _custom_code(model, op.opcodeIndex) in CUSTOM_OP_NAMES and _ints(op.inputs)[:1]
                and int(op.inputs[0]) in _ints(sg.inputs))
    return (f" ({count} bag op(s) in a tf.cond or tf.while_loop branch read their table as the branch's "
            "input, which stays float: look the bags up outside the branch)" if count else "")


def _packed_once(table_object):
    """``table_object`` whose Pack writes it once per builder and hands every later
    caller that offset: tensors sharing it then point at one table in the file
    (flatbuffers allow any number of references to an object already written)."""
    pack, offsets = table_object.Pack, {}

    def pack_once(builder):
        if id(builder) not in offsets:
            offsets[id(builder)] = (builder, pack(builder))  # the builder kept: its id stays its own
        return offsets[id(builder)][1]

    table_object.Pack = pack_once
    return table_object


def quantize_table_int8(model_bytes: bytes) -> bytes:
    """Rewrites every constant float32, float16 or bfloat16 ``params`` table of a
    PkmEmbeddingBag / PkmRaggedEmbeddingBag op as an int8 tensor with per-row
    (axis 0) affine quantisation (``quantize_rows_int8_affine`` of the table's
    values as float32: a float32 scale and an integer zero point per row, each
    value within half its row's scale of the float one).

    The op keeps its output type: the kernel dequantises rows as it sums.
    A table that anything else also reads (another operator such as a stock
    GATHER, a bag op input other than params, a subgraph output; directly or
    through another tensor sharing its buffer) is left float: that reader would
    otherwise get int8 data as if it were float. A table the converter stored
    float16 behind a DEQUANTIZE (``supported_types=[tf.float16]``) is quantised
    from its float16 values and the DEQUANTIZE dropped. Raises ValueError if no table
    could be quantised, where the model keeps buffers outside its flatbuffer (a model
    over 2 GB), or naming the table where one holds NaN or infinity.
    """
    check_tflite_bytes(model_bytes, "quantize_table_int8")
    schema = _schema("quantize_table_int8")
    try:
        model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    except (struct.error, IndexError, ValueError) as err:
        raise _unreadable("quantize_table_int8", model_bytes, err) from None
    outside = sum(1 for b in model.buffers or [] if int(getattr(b, "offset", 0) or 0) > 1)
    if outside:   # (their data follows the flatbuffer: repacked, it would be dropped, and no table read)
        raise ValueError(f"quantize_table_int8: the model keeps {outside} buffer(s) outside its flatbuffer "
                         "(offset/size, as the converter writes models over 2 GB); rewriting such a "
                         "model is not supported")
    _bypass_dequantize(model, schema)
    tables, shared = _quantisable_tables(model, schema)
    for buffer_index, tensors, dtype in tables:
        raw = bytes(np.asarray(model.buffers[buffer_index].data, dtype=np.uint8))
        table = np.frombuffer(raw, dtype=dtype).reshape(_ints(tensors[0].shape)).astype(np.float32)
        try:
            q, scales, zero_points = quantize_rows_int8_affine(table)
        except ValueError as err:
            name = tensors[0].name.decode() if isinstance(tensors[0].name, bytes) else tensors[0].name
            raise ValueError(f"quantize_table_int8: table {name!r} ({np.dtype(dtype).name}): {err}") from None
        model.buffers[buffer_index].data = np.frombuffer(q.tobytes(), dtype=np.uint8)
        quant = _packed_once(schema.QuantizationParametersT())
        # numpy vectors: packed as one block each, not a float at a time
        quant.scale, quant.zeroPoint = scales.astype(np.float32), zero_points.astype(np.int64)
        quant.quantizedDimension = 0
        for tensor in tensors:   # one per signature reading the buffer: all share one scale set
            tensor.type = schema.TensorType.INT8
            tensor.quantization = quant
    if not tables:
        raise ValueError("no constant float32, float16 or bfloat16 params table of a PkmEmbeddingBag op found" +
                         (f" that only PkmEmbeddingBag reads ({shared} read elsewhere too, left float)"
                          if shared else "") + _already_int8(model, schema) + _tables_through_branches(model))
    import flatbuffers  # the schema modules depend on it
    builder = flatbuffers.Builder(len(model_bytes) // 4 + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _int8_table_problem(tensor) -> Optional[str]:
    """Why the kernels would refuse this int8 params tensor's quantisation, or None."""
    rows = int(tensor.Shape(0)) if tensor.ShapeLength() else None
    quant = tensor.Quantization()
    scales = quant.ScaleAsNumpy() if quant is not None and quant.ScaleLength() else np.zeros(0, np.float32)
    zero_points = quant.ZeroPointAsNumpy() if quant is not None and quant.ZeroPointLength() else np.zeros(0, np.int64)
    if scales.size == 0 or zero_points.size == 0:
        return "no quantisation scales and zero points (int8 params need one of each per row)"
    if zero_points.size != scales.size:
        return f"{scales.size} scales but {zero_points.size} zero points"
    if scales.size > 1 and (scales.size != rows or quant.QuantizedDimension() != 0):
        return (f"{scales.size} scales on axis {quant.QuantizedDimension()}; int8 params are "
                f"quantised per row (axis 0), {rows} scales")
    bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))
    if bad.size:
        return (f"scale of row {int(bad[0])} is {float(scales[bad[0]])!r} ({bad.size} such rows); "
                "scales must be positive and finite")
    info = np.iinfo(np.int32)
    bad = np.flatnonzero((zero_points < info.min) | (zero_points > info.max))
    if bad.size:
        return f"zero point of row {int(bad[0])} is {int(zero_points[bad[0]])}, past int32"
    return None


def check_int8_tables(model_bytes) -> int:
    """ValueError naming the table and the row unless every int8 params table of a
    PkmEmbeddingBag / PkmRaggedEmbeddingBag op (every subgraph) has quantisation the
    kernels take: one scale and zero point, or one per row (axis 0); scales positive
    and finite; zero points within int32. The delegate refuses the same, but only when
    tensors are allocated; a server checks at load. Returns the number of int8 tables (one
    that several signatures' subgraphs read, a buffer of theirs, counts once)."""
    check_tflite_bytes(model_bytes, "check_int8_tables")
    schema = _schema("check_int8_tables")
    try:
        return _check_int8_tables(schema, schema.Model.GetRootAsModel(bytes(model_bytes), 0))
    except (struct.error, IndexError) as err:
        raise _unreadable("check_int8_tables", model_bytes, err) from None


def _unreadable(what: str, model_bytes, err) -> ValueError:
    """The schema's reader ran past the end of the bytes: a file cut short (or corrupt)."""
    return ValueError(f"{what}: the {len(model_bytes)} bytes given are not a whole TFLite flatbuffer "
                      f"(truncated or corrupt: {err}); pass the complete contents of a .tflite file")


def _check_int8_tables(schema, model) -> int:
    codes = []
    for i in range(model.OperatorCodesLength()):
        code = model.OperatorCodes(i).CustomCode()
        codes.append(code.decode() if isinstance(code, bytes) else code)
    seen, int8_tables = set(), set()
    for si in range(model.SubgraphsLength()):
        subgraph = model.Subgraphs(si)
        for oi in range(subgraph.OperatorsLength()):
            op = subgraph.Operators(oi)
            index = op.OpcodeIndex()
            if not 0 <= index < len(codes) or codes[index] not in CUSTOM_OP_NAMES or not op.InputsLength():
                continue
            ti = op.Inputs(0)
            if not 0 <= ti < subgraph.TensorsLength() or (si, ti) in seen:
                continue
            seen.add((si, ti))
            tensor = subgraph.Tensors(ti)
            if tensor.Type() != schema.TensorType.INT8:
                continue
            int8_tables.add(tensor.Buffer())
            problem = _int8_table_problem(tensor)
            if problem:
                name = tensor.Name().decode() if tensor.Name() is not None else f"#{ti}"
                raise ValueError(f"int8 table {name!r} (subgraph {si}, tensor {ti}) of "
                                 f"{codes[index]}: {problem}")
    return len(int8_tables)


def build_embedding_bag_model(table: np.ndarray, bag_size: int, combiner: str = "sum",
                              has_weights: bool = True, index_dtype=np.int32,
                              batch: Optional[int] = None,
                              custom_options: Optional[bytes] = None) -> bytes:
    """A one-op TFLite model: PkmEmbeddingBag(table const, indices, weights).

    Built directly with the flatbuffer schema, the same layout the converter
    emits for the TF op (inputs params, indices, weights; a flexbuffer map of
    the attrs). ``batch=None`` gives a dynamic batch dimension. For tests and
    for producing models without TensorFlow.
    """
    schema = _schema("build_embedding_bag_model")
    from flatbuffers import flexbuffers
    table = np.ascontiguousarray(table)
    ttype = {np.dtype(np.float32): schema.TensorType.FLOAT32,
             np.dtype(np.float16): schema.TensorType.FLOAT16}[table.dtype]
    itype = {np.dtype(np.int32): schema.TensorType.INT32,
             np.dtype(np.int64): schema.TensorType.INT64}[np.dtype(index_dtype)]
    if custom_options is None:
        custom_options = bytes(flexbuffers.Dumps({
            "T": int(ttype), "Tindices": int(itype), "combiner": combiner,
            "has_weights": bool(has_weights)}))
    b = 1 if batch is None else batch

    def tensor(name, shape, ttype_, buffer, signature=None):
        t = schema.TensorT()
        t.name, t.shape, t.type, t.buffer = name, list(shape), ttype_, buffer
        if signature is not None:
            t.shapeSignature = list(signature)
        return t

    buffers = [schema.BufferT(), schema.BufferT()]
    buffers[1].data = np.frombuffer(table.tobytes(), dtype=np.uint8)
    sig = None if batch is not None else [-1, bag_size]
    tensors = [tensor("params", table.shape, ttype, 1),
               tensor("indices", [b, bag_size], itype, 0, sig),
               tensor("weights", [b, bag_size], ttype, 0, sig),
               tensor("output", [b, table.shape[1]], ttype, 0,
                      None if batch is not None else [-1, table.shape[1]])]
    for _ in range(len(buffers), 2):
        buffers.append(schema.BufferT())
    op = schema.OperatorT()
    op.opcodeIndex = 0
    op.inputs = [0, 1, 2]
    op.outputs = [3]
    op.customOptions = np.frombuffer(custom_options, dtype=np.uint8) if custom_options else None
    op.customOptionsFormat = schema.CustomOptionsFormat.FLEXBUFFERS
    subgraph = schema.SubGraphT()
    subgraph.tensors = tensors
    subgraph.inputs = [1, 2]
    subgraph.outputs = [3]
    subgraph.operators = [op]
    subgraph.name = "main"
    code = schema.OperatorCodeT()
    code.builtinCode = schema.BuiltinOperator.CUSTOM
    code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM
    code.customCode = CUSTOM_OP_NAME
    code.version = 1
    model = schema.ModelT()
    model.version = 3
    model.operatorCodes = [code]
    model.subgraphs = [subgraph]
    model.buffers = buffers
    model.description = "pkm_serve PkmEmbeddingBag"
    import flatbuffers
    builder = flatbuffers.Builder(table.nbytes + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())
