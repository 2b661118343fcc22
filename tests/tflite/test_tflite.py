"""libpkm_tflite.so in LiteRT, tf.lite and tflite_runtime (TF-free venv).

Models come from the real TF->TFLite converter (the TF op with
allow_custom_ops, and the stock composite gather*w -> reduce_sum), plus
hand-built flatbuffers for malformed cases. References: numpy and the TF op.
"""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME_PY = os.path.join(ROOT, ".venv-tflite-runtime", "bin", "python")

from pkm_serve import tflite  # noqa: E402
from tests.reference import embedding_bag  # noqa: E402

import tensorflow as tf  # noqa: E402  (converter + reference op)
from flatbuffers import flexbuffers  # noqa: E402

N, D, K = 300, 24, 6
RNG = np.random.default_rng(7)
TABLE = RNG.standard_normal((N, D)).astype(np.float32)


def tf_op(params, idx, w, combiner):
    from pkm_serve import ops
    return ops.embedding_bag(params, idx, w, combiner=combiner)


def convert(fn, signature):
    concrete = tf.function(fn, input_signature=signature).get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete])
    converter.allow_custom_ops = True
    return converter.convert()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Converted models, written to disk for the runtime subprocess."""
    d = tmp_path_factory.mktemp("models")
    table = tf.constant(TABLE)
    out = {}
    for combiner in ("sum", "mean", "sqrtn"):
        out[combiner] = convert(
            lambda i, w, c=combiner: tf_op(table, i, w, c),
            [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, K], tf.float32)])
    out["int64_noweights"] = convert(
        lambda i: tf_op(table, i, None, "sum"), [tf.TensorSpec([None, K], tf.int64)])
    out["composite"] = convert(
        lambda i, w: tf.reduce_sum(tf.gather(table, i) * w[..., None], axis=-2),
        [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, K], tf.float32)])
    out["composite_noweights"] = convert(
        lambda i: tf.reduce_sum(tf.gather(table, i), axis=1), [tf.TensorSpec([None, K], tf.int32)])
    out["int8"] = tflite.quantize_table_int8(out["sum"])
    paths = {}
    for name, blob in out.items():
        p = d / f"{name}.tflite"
        p.write_bytes(blob)
        paths[name] = str(p)
    return paths


def bags(batch, int64=False, pad=True):
    idx = RNG.integers(0, N, size=(batch, K)).astype(np.int64 if int64 else np.int32)
    if pad:
        idx[::3, -2:] = -1  # padding
    w = RNG.uniform(0.1, 2.0, size=(batch, K)).astype(np.float32)
    return idx, w


def run_runtime_venv(model_path, inputs, tmp_path, num_threads=1, fuse_composites=False):
    """Runs a model in the TF-free tflite_runtime venv; returns outputs or raises."""
    if not os.path.exists(RUNTIME_PY):
        pytest.fail(f"{RUNTIME_PY} missing: `make test` builds .venv-tflite-runtime")
    job, result = tmp_path / "job.npz", tmp_path / "out.npz"
    np.savez(job, model_path=np.array(model_path), interpreter=np.array("tflite_runtime"),
             num_threads=np.array(num_threads), fuse_composites=np.array(fuse_composites),
             **{f"input_{i}": x for i, x in enumerate(inputs)})
    env = dict(os.environ, PYTHONPATH=ROOT, PKM_TFLITE_DELEGATE=tflite.delegate_path())
    proc = subprocess.run([RUNTIME_PY, os.path.join(ROOT, "tests", "tflite", "run_in_runtime.py"),
                           str(job), str(result)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = np.load(result)
    if "error" in res.files:
        raise RuntimeError(str(res["error"]))
    return [res[f"output_{i}"] for i in range(len(res.files))]


ALL_INTERPRETERS = ("litert", "tf", "tflite_runtime")


def run_in(interpreter, model_path, inputs, tmp_path, **kw):
    if interpreter == "tflite_runtime":
        return run_runtime_venv(model_path, inputs, tmp_path, **kw)
    return tflite.run_tflite(model_path, inputs, interpreter=interpreter, **kw)


# ---- the library itself ------------------------------------------------------

def test_library_links_no_tensorflow_and_exports_the_plugin_api():
    path = tflite.delegate_path()
    ldd = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    libs = [line.split()[0] for line in ldd.strip().splitlines()]
    assert not [l for l in libs if "tensorflow" in l or "tflite" in l or "litert" in l.lower()], ldd
    allowed = ("linux-vdso", "libstdc++", "libm.", "libgcc_s", "libc.", "ld-linux", "libpthread")
    assert all(l.startswith(allowed) or "/ld-linux" in l for l in libs), libs
    nm = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                        check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    assert {"tflite_plugin_create_delegate", "tflite_plugin_destroy_delegate",
            "PkmEmbeddingBagRegistration"} <= exported
    undefined = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True,
                               text=True, check=True).stdout
    assert "TfLite" not in undefined and "tensorflow" not in undefined


def test_custom_options_are_the_converters_attr_map(models):
    from ai_edge_litert import schema_py_generated as schema
    blob = open(models["mean"], "rb").read()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(blob), 0))
    (op,) = model.subgraphs[0].operators
    assert model.operatorCodes[op.opcodeIndex].customCode == b"PkmEmbeddingBag"
    opts = flexbuffers.Loads(bytes(op.customOptions))
    assert opts["combiner"] == "mean" and opts["has_weights"] is True
    tensors = model.subgraphs[0].tensors
    assert [tensors[i].name.decode() for i in op.inputs][1:] == ["i", "w"]  # params, indices, weights


# ---- same outputs everywhere ---------------------------------------------------

@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_converted_op_matches_tf_and_numpy_in_every_interpreter(models, combiner, tmp_path):
    idx, w = bags(9)
    expect_tf = tf_op(tf.constant(TABLE), idx, w, combiner).numpy()
    expect_np = embedding_bag(TABLE, idx, w, combiner)
    np.testing.assert_allclose(expect_tf, expect_np, rtol=1e-5, atol=1e-5)
    outs = {}
    for interp in ALL_INTERPRETERS:
        (outs[interp],) = run_in(interp, models[combiner], [idx, w], tmp_path, num_threads=2)
        np.testing.assert_allclose(outs[interp], expect_tf, rtol=1e-5, atol=1e-6, err_msg=interp)
    np.testing.assert_array_equal(outs["litert"], outs["tflite_runtime"])
    np.testing.assert_array_equal(outs["litert"], outs["tf"])


def test_dynamic_batch_and_int64_unweighted(models, tmp_path):
    for batch in (1, 17, 0):
        idx, _ = bags(batch, int64=True)
        expect = embedding_bag(TABLE, idx)
        for interp in ALL_INTERPRETERS:
            (out,) = run_in(interp, models["int64_noweights"], [idx], tmp_path)
            assert out.shape == (batch, D)
            np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5, err_msg=interp)


def test_int8_table_within_one_percent_of_fp32_everywhere(models, tmp_path):
    # int8 rows + per-row scale (f32) and zero point (i64 in the schema): < half here.
    assert os.path.getsize(models["int8"]) < 0.5 * os.path.getsize(models["sum"])
    idx, w = bags(12)
    (fp32,) = tflite.run_tflite(models["sum"], [idx, w])
    outs = [run_in(i, models["int8"], [idx, w], tmp_path)[0] for i in ALL_INTERPRETERS]
    for out in outs:
        rel = np.linalg.norm(out - fp32) / np.linalg.norm(fp32)
        assert rel < 0.01, rel
        np.testing.assert_array_equal(out, outs[0])
    # Exactly the dequantised table: the kernel uses the per-row scales.
    q, scales, zero_points = tflite.quantize_rows_int8_affine(TABLE)
    dequantized = scales[:, None].astype(np.float64) * (q.astype(np.float64) - zero_points[:, None])
    np.testing.assert_allclose(outs[0], embedding_bag(dequantized, idx, w), rtol=1e-5, atol=1e-5)


def test_float16_table(tmp_path):
    table16 = TABLE.astype(np.float16)
    model = tflite.build_embedding_bag_model(table16, K, combiner="mean")
    path = tmp_path / "fp16.tflite"
    path.write_bytes(model)
    idx, w = bags(5)
    expect = embedding_bag(table16.astype(np.float32), idx, w.astype(np.float16).astype(np.float32),
                       "mean")
    for interp in ALL_INTERPRETERS:
        (out,) = run_in(interp, str(path), [idx, w.astype(np.float16)], tmp_path)
        assert out.dtype == np.float16
        np.testing.assert_allclose(out.astype(np.float32), expect, rtol=2e-3, atol=2e-3)


# ---- fusing the stock composite --------------------------------------------------

@pytest.mark.parametrize("name", ["composite", "composite_noweights"])
def test_fuse_composites_claims_the_chain(models, name, tmp_path):
    weighted = name == "composite"
    idx, w = bags(8, pad=False)  # stock GATHER rejects negative indices
    inputs = [idx, w] if weighted else [idx]
    (stock,) = tflite.run_tflite(models[name], inputs, use_delegate=False)
    np.testing.assert_allclose(stock, embedding_bag(TABLE, idx, w if weighted else None), rtol=1e-5,
                               atol=1e-5)
    for interp in ("litert", "tf"):
        it = tflite.make_interpreter(models[name], interp, fuse_composites=True)
        ops = tflite.execution_plan(it)
        delegated = [op for op in ops if op["op_name"] == "DELEGATE"]
        assert len(delegated) == 1, [op["op_name"] for op in ops]
        # Every stock op of the chain is replaced; only the delegate node runs.
        assert tflite.ops_in_plan(it) == ["DELEGATE"], ops
        assert all(op["replaced_by"] == delegated[0]["index"] for op in ops if op is not delegated[0])
        gather = next(op for op in ops if op["op_name"] == "GATHER")
        total = next(op for op in ops if op["op_name"] == "SUM")
        # The delegate node reads the table and indices and writes SUM's output.
        assert set(gather["inputs"]) <= set(delegated[0]["inputs"])
        assert list(delegated[0]["outputs"]) == list(total["outputs"])
        (fused,) = tflite.run_tflite(models[name], inputs, interpreter=interp,
                                     fuse_composites=True, num_threads=2)
        np.testing.assert_allclose(fused, stock, rtol=1e-5, atol=1e-6)
        not_fused = tflite.make_interpreter(models[name], interp, fuse_composites=False)
        assert "DELEGATE" not in tflite.ops_in_plan(not_fused)
        assert "GATHER" in tflite.ops_in_plan(not_fused)
    (rt,) = run_runtime_venv(models[name], inputs, tmp_path, fuse_composites=True)
    np.testing.assert_allclose(rt, stock, rtol=1e-5, atol=1e-6)


# ---- errors, never crashes --------------------------------------------------------

def test_out_of_range_index_names_position_and_value(models, tmp_path):
    idx, w = bags(3, pad=False)
    idx[1, 2] = N + 5
    for interp in ALL_INTERPRETERS:
        with pytest.raises(RuntimeError, match=rf"indices\[{K + 2}\] = {N + 5} is out of range"):
            run_in(interp, models["sum"], [idx, w], tmp_path)


def _rewrite(model_bytes, mutate):
    """Applies mutate(model, schema); returns the bytes and the input shapes."""
    from ai_edge_litert import schema_py_generated as schema
    import flatbuffers
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    mutate(model, schema)
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    sub = model.subgraphs[0]
    shapes = [tuple(int(x) for x in (sub.tensors[i].shape if sub.tensors[i].shape is not None
                                     else ())) for i in sub.inputs]
    return bytes(b.Output()), shapes


def _options(opts):
    return bytes(flexbuffers.Dumps(opts))


def _int8_without_scales(model, schema):
    table = model.subgraphs[0].tensors[0]
    table.type = schema.TensorType.INT8
    model.buffers[table.buffer].data = np.zeros(N * D, np.uint8)


MALFORMED = {
    "one input": (lambda m, s: setattr(m.subgraphs[0].operators[0], "inputs", [0]),
                  "expects 2 or 3 inputs"),
    "four inputs": (lambda m, s: setattr(m.subgraphs[0].operators[0], "inputs", [0, 1, 2, 2]),
                    "expects 2 or 3 inputs"),
    "float indices": (lambda m, s: setattr(m.subgraphs[0].tensors[1], "type", s.TensorType.FLOAT32),
                      "indices must be int32 or int64"),
    "int32 table": (lambda m, s: setattr(m.subgraphs[0].tensors[0], "type", s.TensorType.INT32),
                    "params must be float32, float16, bfloat16 or int8"),
    "int8 table without scales": (lambda m, s: _int8_without_scales(m, s), "int8 params need per-row"),
    "rank-3 table": (lambda m, s: setattr(m.subgraphs[0].tensors[0], "shape", [N // 4, 4, D]),
                     "params must be a [N, D] matrix, got shape [75, 4, 24]"),
    "scalar indices": (lambda m, s: [setattr(m.subgraphs[0].tensors[i], "shape", []) or
                                     setattr(m.subgraphs[0].tensors[i], "shapeSignature", None)
                                     for i in (1, 2)],
                       "indices must have rank >= 1"),
    "garbage options": (lambda m, s: setattr(m.subgraphs[0].operators[0], "customOptions",
                                             np.frombuffer(b"\x07\xff\x00\x13junk", np.uint8)),
                        "malformed flexbuffer"),
    "unknown combiner": (lambda m, s: setattr(m.subgraphs[0].operators[0], "customOptions",
                                              np.frombuffer(_options({"combiner": "min"}), np.uint8)),
                         "'combiner' must be 'sum', 'mean', 'sqrtn' or 'max', got 'min'"),
    # Bytes that are not UTF-8 came back raw: Python raised UnicodeDecodeError, not the message.
    "combiner not UTF-8": (lambda m, s: setattr(m.subgraphs[0].operators[0], "customOptions",
                                                np.frombuffer(_options({"combiner": "sqrtn"}).replace(
                                                    b"sqrtn", b"\xadqrtn"), np.uint8)),
                           "got '\\xadqrtn'"),
    "combiner not a string": (lambda m, s: setattr(m.subgraphs[0].operators[0], "customOptions",
                                                   np.frombuffer(_options({"combiner": 3}), np.uint8)),
                              "'combiner' must be a string"),
    # A misspelt key ran the default combiner ('sum') silently.
    "misspelt combiner key": (lambda m, s: setattr(m.subgraphs[0].operators[0], "customOptions",
                                                   np.frombuffer(_options({"T": 0, "Tindices": 2,
                                                                           "combinr": "mean"}), np.uint8)),
                              "unknown custom_options key 'combinr'; accepted: 'combiner', 'has_weights',"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_models_fail_with_a_message(case, tmp_path):
    mutate, message = MALFORMED[case]
    base = tflite.build_embedding_bag_model(TABLE, K, batch=2)
    path = tmp_path / "bad.tflite"
    blob, shapes = _rewrite(base, mutate)
    path.write_bytes(blob)
    # Inputs shaped as the (mutated) model declares, so nothing is resized.
    interp_inputs = [np.ones(shapes[0], np.int32), np.ones(shapes[1], np.float32)]
    for interp in ALL_INTERPRETERS:
        with pytest.raises((RuntimeError, ValueError)) as err:
            if interp == "tflite_runtime":
                run_runtime_venv(str(path), interp_inputs, tmp_path)
            else:
                it = tflite.make_interpreter(str(path), interp)
                it.allocate_tensors()
                for d, x in zip(it.get_input_details(), interp_inputs):
                    it.set_tensor(d["index"], x.astype(d["dtype"]))
                it.invoke()
        assert message in str(err.value), (interp, str(err.value))


def test_tf_attrs_the_kernel_does_not_read_are_accepted(tmp_path):
    # The converter writes every TF attr of the node: type attrs (capitalised) and, for a
    # graph converted without the op registered, "_"-prefixed ones such as _output_shapes.
    opts = _options({"T": 0, "Tindices": 2, "Tweights": 0, "_output_shapes": [[-1, D]],
                     "_class": "loc:@x", "combiner": "mean", "has_weights": True})
    model = tflite.build_embedding_bag_model(TABLE, K, custom_options=opts)
    path = tmp_path / "attrs.tflite"
    path.write_bytes(model)
    idx, w = bags(4)
    for interp in ALL_INTERPRETERS:
        (out,) = run_in(interp, str(path), [idx, w], tmp_path)
        np.testing.assert_allclose(out, embedding_bag(TABLE, idx, w, "mean"), rtol=1e-5, atol=1e-5,
                                   err_msg=interp)


def test_zero_sized_tensors(tmp_path):
    # K = 0: empty bags give zeros; an empty table accepts only padding.
    empty_bags = tflite.build_embedding_bag_model(TABLE, 0, batch=3)
    (out,) = tflite.run_tflite(empty_bags, [np.zeros((3, 0), np.int32), np.zeros((3, 0), np.float32)])
    np.testing.assert_array_equal(out, np.zeros((3, D), np.float32))
    empty_table = tflite.build_embedding_bag_model(np.zeros((0, D), np.float32), 2, batch=2)
    (out,) = tflite.run_tflite(empty_table, [np.full((2, 2), -1, np.int32), np.ones((2, 2), np.float32)])
    np.testing.assert_array_equal(out, np.zeros((2, D), np.float32))
    with pytest.raises(RuntimeError, match=r"indices\[0\] = 0 is out of range \[0, 0\)"):
        tflite.run_tflite(empty_table, [np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32)])
    zero_dim = tflite.build_embedding_bag_model(np.zeros((5, 0), np.float32), 2, batch=2)
    (out,) = tflite.run_tflite(zero_dim, [np.zeros((2, 2), np.int32), np.ones((2, 2), np.float32)])
    assert out.shape == (2, 0)
    with pytest.raises(RuntimeError, match=r"indices\[1\] = 9 is out of range"):
        tflite.run_tflite(zero_dim, [np.array([[0, 9], [1, 1]], np.int32), np.ones((2, 2), np.float32)])


def test_delegate_options_are_validated():
    with pytest.raises(ValueError, match="unknown delegate option"):
        tflite.load_delegate(interpreter="litert", threads=2)
    from ai_edge_litert import interpreter as litert
    for options in ({"num_threads": "zero"}, {"fuse_composites": "maybe"}, {"colour": "red"}):
        with pytest.raises(ValueError):
            litert.load_delegate(tflite.delegate_path(), options=options)


@pytest.mark.slow
def test_asan_fuzz_of_prepare_and_invoke():
    """`make asan-tflite`: random tensors/options under AddressSanitizer + UBSan."""
    if shutil.which("make") is None:
        pytest.fail("make is required")
    proc = subprocess.run(["make", "-s", "asan-tflite", "FUZZ_ITERS=4000"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rejected with a message" in proc.stdout


def test_indices_with_data_dependent_shape(tmp_path):
    """Indices produced by UNIQUE (a dynamic tensor in TFLite): the output is
    made dynamic in Prepare and sized at Invoke."""
    table = tf.constant(TABLE)

    def fn(ids):
        unique = tf.unique(ids).y  # data-dependent length
        return tf_op(table, tf.reshape(unique, [-1, 2]), None, "mean")

    model = convert(fn, [tf.TensorSpec([8], tf.int32)])
    path = tmp_path / "dynamic.tflite"
    path.write_bytes(model)
    for ids in (np.array([3, 3, 5, 7, 7, 9, 1, 2], np.int32), np.arange(8, dtype=np.int32) * 11):
        _, first = np.unique(ids, return_index=True)
        expect = embedding_bag(TABLE, ids[np.sort(first)].reshape(-1, 2), None, "mean")
        for interp in ALL_INTERPRETERS:
            (out,) = run_in(interp, str(path), [ids], tmp_path)
            np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6, err_msg=interp)


# ---- review fixes: stock-equivalent errors, input ranges, shared tables -------------

@pytest.mark.parametrize("bad", [-1, N + 5])
def test_fused_chain_rejects_indices_stock_gather_rejects(models, bad, tmp_path):
    """Stock GATHER has no padding: the fused chain must fail where it fails."""
    idx, w = bags(3, pad=False)
    idx[1, 2] = bad
    with pytest.raises(RuntimeError):
        tflite.run_tflite(models["composite"], [idx, w], use_delegate=False)
    message = rf"indices\[{K + 2}\] = {bad} is out of range \[0, {N}\)"
    for interp in ALL_INTERPRETERS:
        with pytest.raises(RuntimeError, match=message):
            run_in(interp, models["composite"], [idx, w], tmp_path, fuse_composites=True)
    # The custom op keeps its padding semantics.
    if bad < 0:
        (out,) = tflite.run_tflite(models["sum"], [idx, w])
        np.testing.assert_allclose(out, embedding_bag(TABLE, idx, w), rtol=1e-5, atol=1e-5)


def test_run_tflite_rejects_indices_that_do_not_fit_the_input_type(models):
    idx, w = bags(2, int64=True, pad=False)
    name = tflite.make_interpreter(models["sum"]).get_input_details()[0]["name"]
    idx[0, 0] = 2 ** 31  # would wrap to -2**31 (padding) in the int32 model
    with pytest.raises(ValueError, match=rf"input '{re.escape(name)}' is int32; values .* do not fit"):
        tflite.run_tflite(models["sum"], [idx, w])
    idx[0, 0] = 7  # in range: int64 arrays are still accepted
    (out,) = tflite.run_tflite(models["sum"], [idx, w])
    np.testing.assert_allclose(out, embedding_bag(TABLE, idx, w), rtol=1e-5, atol=1e-5)


def test_quantize_leaves_a_table_that_gather_also_reads_float():
    """A table also read by a stock GATHER keeps float32; a table only the op
    reads is quantised. With no quantisable table left, a clear ValueError."""
    shared, private = tf.constant(TABLE), tf.constant(TABLE[::-1].copy())
    model = convert(lambda i, w: (tf_op(shared, i, w, "sum"), tf.gather(shared, i),
                                  tf_op(private, i, w, "mean")),
                    [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, K], tf.float32)])
    quantized = tflite.quantize_table_int8(model)
    from ai_edge_litert import schema_py_generated as schema
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(quantized), 0))
    sub = m.subgraphs[0]
    params = [sub.tensors[op.inputs[0]] for op in sub.operators
              if m.operatorCodes[op.opcodeIndex].customCode == b"PkmEmbeddingBag"]
    assert sorted(t.type for t in params) == sorted([schema.TensorType.FLOAT32,
                                                     schema.TensorType.INT8])
    idx, w = bags(4, pad=False)  # stock GATHER rejects padding
    ref = tflite.run_tflite(model, [idx, w])
    out = tflite.run_tflite(quantized, [idx, w])
    # Same graph, so the same output order; the GATHER output is the rank-3 one.
    (gathered,) = [o for o in out if o.ndim == 3]
    np.testing.assert_array_equal(gathered, TABLE[idx])
    exact = [np.array_equal(r, o) for r, o in zip(ref, out)]
    assert sorted(exact) == [False, True, True], exact  # only the private table changed
    for r, o in zip(ref, out):
        assert np.linalg.norm(o - r) <= 0.01 * np.linalg.norm(r)
    only_shared = convert(lambda i: (tf_op(shared, i, None, "sum"), tf.gather(shared, i)),
                          [tf.TensorSpec([None, K], tf.int32)])
    with pytest.raises(ValueError, match=r"read elsewhere too, left float\)"):
        tflite.quantize_table_int8(only_shared)


@pytest.mark.parametrize("interpreter", ALL_INTERPRETERS)
def test_dynamic_indices_first_invoke_at_the_stored_output_shape(interpreter, tmp_path):
    # Indices from a RESHAPE with a run-time shape are a dynamic tensor, so the op's output is
    # made dynamic and its buffer dropped; a first invoke whose result has the output's stored
    # shape [1, D] must still get a buffer (it failed: "output buffer is not allocated").
    table = tf.constant(TABLE)
    model = convert(lambda x, s: tf_op(table, tf.reshape(x, s), None, "sum"),
                    [tf.TensorSpec([None], tf.int32), tf.TensorSpec([2], tf.int32)])
    path = tmp_path / "dyn_reshape.tflite"
    path.write_bytes(model)
    for ids in ([3, 4], [1, 2, 3, 4, 5, 6]):
        x = np.array(ids, np.int32)
        shape = np.array([len(ids) // 2, 2], np.int32)
        [out] = run_in(interpreter, str(path), [x, shape], tmp_path)
        want = embedding_bag(TABLE, x.reshape(-1, 2), None, "sum")
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---- a fused chain after resize_tensor_input ------------------------------------------
# The delegate matches a stock GATHER/MUL/SUM chain once, with the shapes the interpreter has
# then; resizing the inputs afterwards can change what the stock MUL broadcasts or SUM reduces.
# The fused chain must then give the stock ops' result or fail with a message, never other numbers.

def _chain_model(tmp_path, name, fn, signature):
    path = tmp_path / f"{name}.tflite"
    path.write_bytes(convert(fn, signature))
    return str(path)


def _stock_and_fused(path, inputs, tmp_path):
    (stock,) = tflite.run_tflite(path, inputs, use_delegate=False)
    results = {}
    for interp in ALL_INTERPRETERS:
        try:
            (results[interp],) = run_in(interp, path, inputs, tmp_path, fuse_composites=True)
        except RuntimeError as e:
            results[interp] = e
    return stock, results


def test_fused_chain_broadcasts_per_position_weights_after_a_batch_resize(tmp_path):
    """Weights [K] reshaped to [1, K, 1]: matched at batch 1 (no broadcast), run at batch 5,
    where the stock MUL broadcasts them over the bags (the fused chain failed: 'weights must
    have as many elements as indices')."""
    table = tf.constant(TABLE)
    path = _chain_model(tmp_path, "per_position",
                        lambda i, w: tf.reduce_sum(tf.gather(table, i) * tf.reshape(w, [1, K, 1]), axis=1),
                        [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([K], tf.float32)])
    it = tflite.make_interpreter(path, "litert", fuse_composites=True)
    assert tflite.ops_in_plan(it) == ["DELEGATE"]  # the chain is fused at the model's shapes
    idx, _ = bags(5, pad=False)
    w = RNG.uniform(0.1, 2.0, size=K).astype(np.float32)
    stock, fused = _stock_and_fused(path, [idx, w], tmp_path)
    np.testing.assert_allclose(stock, embedding_bag(TABLE, idx, np.broadcast_to(w, idx.shape)), rtol=1e-5, atol=1e-5)
    for interp, out in fused.items():
        assert not isinstance(out, Exception), f"{interp}: {out}"
        np.testing.assert_allclose(out, stock, rtol=1e-5, atol=1e-5, err_msg=interp)


def test_fused_chain_refuses_a_resize_its_weights_no_longer_fit(tmp_path):
    """ids [None, None], weights [None] reshaped to [1, -1, 1]: matched at [1, 1], run with ids
    [K, 1] and K weights, where the stock MUL makes [K, K, D] and SUM gives sum(w) * row. The
    element counts still agree, so the fused chain used to weigh each bag by one weight."""
    table = tf.constant(TABLE)
    path = _chain_model(tmp_path, "reshaped_weights",
                        lambda i, w: tf.reduce_sum(tf.gather(table, i) * tf.reshape(w, [1, -1, 1]), axis=1),
                        [tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.float32)])
    assert tflite.ops_in_plan(tflite.make_interpreter(path, "litert", fuse_composites=True)) == ["DELEGATE"]
    idx = RNG.integers(0, N, size=(K, 1)).astype(np.int32)
    w = RNG.uniform(0.1, 2.0, size=K).astype(np.float32)
    stock, fused = _stock_and_fused(path, [idx, w], tmp_path)
    np.testing.assert_allclose(stock, w.sum() * TABLE[idx[:, 0]], rtol=1e-5, atol=1e-5)
    for interp, out in fused.items():
        if isinstance(out, Exception):
            assert re.search(r"weights reach the fused MUL as \[1, 6, 1\], which does not scale each row of "
                             r"the gathered \[6, 1, 24\]", str(out)), f"{interp}: {out}"
        else:
            np.testing.assert_allclose(out, stock, rtol=1e-5, atol=1e-5, err_msg=interp)
    # Shapes the chain still fits run fused and equal the stock ops.
    idx, w = RNG.integers(0, N, size=(1, 4)).astype(np.int32), RNG.uniform(0.1, 2, 4).astype(np.float32)
    stock, fused = _stock_and_fused(path, [idx, w], tmp_path)
    for interp, out in fused.items():
        np.testing.assert_allclose(out, stock, rtol=1e-5, atol=1e-5, err_msg=interp)


def test_fused_chain_refuses_a_resize_that_moves_the_bag_axis(tmp_path):
    """SUM over axis 1 of gather(ids [None, K]): resized to ids [2, 3, K], the stock SUM reduces
    the 3, not the bag axis."""
    table = tf.constant(TABLE)
    path = _chain_model(tmp_path, "axis_one", lambda i: tf.reduce_sum(tf.gather(table, i), axis=1),
                        [tf.TensorSpec([None, K], tf.int32)])
    idx = RNG.integers(0, N, size=(2, 3, K)).astype(np.int32)
    stock, fused = _stock_and_fused(path, [idx], tmp_path)
    np.testing.assert_allclose(stock, TABLE[idx].sum(axis=1), rtol=1e-5, atol=1e-5)
    for interp, out in fused.items():
        assert isinstance(out, Exception), interp
        assert "the fused SUM's axis 1 is not the bag axis of the gathered [2, 3, 6, 24]" in str(out), out


def test_fused_chain_follows_expand_dims_and_squeeze_of_the_weights(tmp_path):
    """expand_dims / squeeze on the weights path, run at other batch sizes than matched."""
    table = tf.constant(TABLE)
    path = _chain_model(
        tmp_path, "expand_squeeze",
        lambda i, w: tf.reduce_sum(tf.gather(table, i) * tf.expand_dims(tf.squeeze(w, axis=1), -1), axis=1),
        [tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, 1, K], tf.float32)])
    assert tflite.ops_in_plan(tflite.make_interpreter(path, "litert", fuse_composites=True)) == ["DELEGATE"]
    for batch in (3, 9):
        idx, w = bags(batch, pad=False)
        stock, fused = _stock_and_fused(path, [idx, w[:, None, :]], tmp_path)
        np.testing.assert_allclose(stock, embedding_bag(TABLE, idx, w), rtol=1e-5, atol=1e-5)
        for interp, out in fused.items():
            assert not isinstance(out, Exception), f"{interp}: {out}"
            np.testing.assert_allclose(out, stock, rtol=1e-5, atol=1e-5, err_msg=interp)
