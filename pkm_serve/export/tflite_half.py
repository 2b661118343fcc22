"""`--tflite --quantize-table int8` of float16 / bfloat16 tables.

`pkm_serve.tflite.quantize_table_int8` quantises the float32 `params` tables
of the bag ops. A model whose tables are half (the converter keeps a float16
or bfloat16 table as a FLOAT16 / BFLOAT16 constant) gets the same per-row
symmetric int8 here, from the table's values read as float32: the op keeps
its half weights and output (the kernels take int8 params with any float
output and dequantise rows in float32 as they sum). A table that anything
else reads stays as it is, as quantize_table_int8 leaves such a float32 one.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from pkm_serve import tflite as pkm_tflite
from pkm_serve.tflite_model import _custom_code


def _ints(xs) -> List[int]:
    return [] if xs is None else [int(x) for x in xs]


def _half_types(schema) -> Dict[int, object]:
    import ml_dtypes
    return {schema.TensorType.FLOAT16: np.float16, schema.TensorType.BFLOAT16: ml_dtypes.bfloat16}


def _readers(model) -> Tuple[Dict[int, List[tuple]], Dict[tuple, bool]]:
    """(tensors of each buffer, whether each tensor is read only as input 0 of a bag op)."""
    tensors_of_buffer: Dict[int, List[tuple]] = {}
    only_params: Dict[tuple, bool] = {}
    for si, subgraph in enumerate(model.subgraphs):
        for ti, tensor in enumerate(subgraph.tensors or []):
            tensors_of_buffer.setdefault(int(tensor.buffer), []).append((si, ti))
        for ti in _ints(subgraph.inputs) + _ints(subgraph.outputs):
            only_params[(si, ti)] = False
        for op in subgraph.operators or []:
            is_bag = _custom_code(model, op.opcodeIndex) in pkm_tflite.CUSTOM_OP_NAMES
            for pos, ti in enumerate(_ints(op.inputs)):
                if ti >= 0:
                    key = (si, ti)
                    only_params[key] = only_params.get(key, True) and is_bag and pos == 0
    return tensors_of_buffer, only_params


def _half_tables(model, schema):
    """(buffer index, the tensors sharing it, numpy dtype) of every constant half
    table that only bag ops read, as their params."""
    half = _half_types(schema)
    tensors_of_buffer, only_params = _readers(model)
    found, seen = [], set()
    for subgraph in model.subgraphs:
        for op in subgraph.operators or []:
            if _custom_code(model, op.opcodeIndex) not in pkm_tflite.CUSTOM_OP_NAMES or not _ints(op.inputs):
                continue
            tensor = subgraph.tensors[int(op.inputs[0])]
            buffer_index = int(tensor.buffer)
            data = model.buffers[buffer_index].data
            if buffer_index in seen or tensor.type not in half or data is None or len(data) == 0:
                continue
            seen.add(buffer_index)
            users = tensors_of_buffer[buffer_index]
            same = [model.subgraphs[si].tensors[ti] for si, ti in users]
            if all(only_params.get(key, True) for key in users) and all(
                    u.type == tensor.type and _ints(u.shape) == _ints(tensor.shape) for u in same):
                found.append((buffer_index, same, half[tensor.type]))
    return found


def quantize_half_tables_int8(model_bytes: bytes) -> Tuple[bytes, int]:
    """(model with its half bag tables per-row int8, how many were quantised);
    the bytes unchanged where there were none. ValueError naming the table
    where one holds a value no int8 row can (NaN, infinity)."""
    schema = pkm_tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    tables = _half_tables(model, schema)
    for buffer_index, tensors, dtype in tables:
        shape = [int(d) for d in tensors[0].shape]
        raw = bytes(np.asarray(model.buffers[buffer_index].data, dtype=np.uint8))
        table = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(np.float32)
        try:
            q, scales = pkm_tflite.quantize_rows_int8(table)
        except ValueError as err:
            name = tensors[0].name.decode() if isinstance(tensors[0].name, bytes) else tensors[0].name
            raise ValueError(f"table {name!r} ({np.dtype(dtype).name}): {err}") from None
        model.buffers[buffer_index].data = np.frombuffer(q.tobytes(), dtype=np.uint8)
        for tensor in tensors:
            tensor.type = schema.TensorType.INT8
            quant = schema.QuantizationParametersT()
            quant.scale, quant.zeroPoint, quant.quantizedDimension = scales.tolist(), [0] * len(scales), 0
            tensor.quantization = quant
    if not tables:
        return model_bytes, 0
    import flatbuffers
    builder = flatbuffers.Builder(len(model_bytes) // 2 + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output()), len(tables)


def quantize_tables_int8(model_bytes: bytes) -> bytes:
    """Every bag table per-row int8: the half ones here, then the float32 ones
    (pkm_serve.tflite.quantize_table_int8). ValueError where there is none."""
    model_bytes, halves = quantize_half_tables_int8(model_bytes)
    try:
        return pkm_tflite.quantize_table_int8(model_bytes)
    except ValueError as e:
        if halves and str(e).startswith("no constant float32 params table"):
            return model_bytes
        if not halves and str(e).startswith("no constant float32 params table"):
            raise ValueError(f"{e} (nor a float16 or bfloat16 one)") from None
        raise
