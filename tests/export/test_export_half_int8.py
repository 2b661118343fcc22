"""--quantize-table int8 of float16 and bfloat16 tables: in the SavedModel (the
table variable becomes int8, from the half values read as float) and in the
.tflite of --tflite (the FLOAT16 / BFLOAT16 constant becomes per-row int8; the op
keeps its half weights and output). A weighted site of a half table converts
to TFLite at all (its ids/weights broadcast was a float16 ADD, which TFLite
lacks), and a weighted mean too (its division by K was a float16 DIV). Reference: numpy float64 of the half table's values.
"""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve import tflite as pkm_tflite  # noqa: E402
from pkm_serve.export import export_saved_model  # noqa: E402

ops.load_library()
DTYPES = ("float16", "bfloat16")


def _body(t, idx, w):
    return {"sum": tf.reduce_sum(tf.gather(t, idx) * w[..., None], axis=1),
            "mean": tf.reduce_mean(tf.gather(t, idx), axis=1),
            "weighted_mean": tf.reduce_mean(tf.gather(t, idx) * w[..., None], axis=1)}


@pytest.fixture(scope="module", params=DTYPES)
def half_model(request, tmp_path_factory):
    dtype = tf.as_dtype(request.param)
    table = M._table(30).astype(dtype.as_numpy_dtype)
    src = tmp_path_factory.mktemp(request.param) / "src"
    M.save_bag_module(src, table, _body)
    return str(src), table, request.param


def _inputs(table, batch=5):
    rng = np.random.default_rng(4)
    return {"idx": rng.integers(0, M.N, (batch, M.K)).astype(np.int32),
            "w": rng.uniform(0.2, 2.0, (batch, M.K)).astype(table.dtype)}


def _reference(table, x):
    t = table.astype(np.float64)
    return {"sum": M.np_bag(t, x["idx"], x["w"].astype(np.float64)),
            "mean": M.np_bag(t, x["idx"], combiner="mean"),
            "weighted_mean": M.np_bag(t, x["idx"], x["w"].astype(np.float64)) / M.K}


def _assert_close(got, want, what, relative):
    for key in want:
        value = np.asarray(got[key]).astype(np.float64)
        scale = np.max(np.abs(want[key]))
        err = np.max(np.abs(value - want[key]))
        assert err <= relative * scale, f"{what} {key}: max |err| {err} > {relative} * {scale}"


def test_saved_model_int8_of_a_half_table(half_model, tmp_path):
    src, table, dtype = half_model
    result = export_saved_model(src, str(tmp_path / "q"), quantize_table="int8", quiet=True)
    [row] = result.quantization["tables"]
    assert row["dtype"] == dtype and row["int8_bytes"] == table.size
    reader = tf.train.load_checkpoint(os.path.join(result.dst, "variables", "variables"))
    assert {str(d.name) for d in reader.get_variable_to_dtype_map().values()} >= {"int8"}
    x = _inputs(table)
    got = tf.saved_model.load(result.dst).signatures["serving_default"](
        idx=tf.constant(x["idx"]), w=tf.constant(x["w"]))
    assert got["sum"].dtype == tf.as_dtype(dtype)
    _assert_close({k: v.numpy() for k, v in got.items()}, _reference(table, x), "SavedModel int8", 2e-2)


def _params_types(model_bytes):
    schema = pkm_tflite.flatbuffer_schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    types = []
    for subgraph in model.subgraphs:
        for op in subgraph.operators:
            code = model.operatorCodes[op.opcodeIndex].customCode
            if code is not None and code.decode() in pkm_tflite.CUSTOM_OP_NAMES:
                types.append(names[subgraph.tensors[int(op.inputs[0])].type])
    return types


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_tflite_of_a_half_table(half_model, tmp_path, quantize):
    src, table, dtype = half_model
    path = tmp_path / "m.tflite"
    result = export_saved_model(src, str(tmp_path / "q"), tflite=str(path), quantize_table=quantize,
                                quiet=True)
    model = path.read_bytes()
    want_type = "INT8" if quantize else {"float16": "FLOAT16", "bfloat16": "BFLOAT16"}[dtype]
    assert _params_types(model) == [want_type, want_type]  # sum and weighted_mean: one op (the same bag)
    if quantize:
        assert result.tflite["worst_relative_err"] <= 1e-2
    x = _inputs(table)
    runner = pkm_tflite.make_interpreter(model).get_signature_runner("serving_default")
    _assert_close(runner(**x), _reference(table, x), f".tflite {quantize or 'float'}",
                  2e-2 if quantize else 1e-2)
