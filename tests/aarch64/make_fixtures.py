"""Writes the aarch64 test fixtures: .tflite models, their inputs and the x86
outputs of the same models (run with the x86 libpkm_tflite.so in LiteRT).

Run on x86 with the project venv (it needs TensorFlow for the converter):
    .venv/bin/python tests/aarch64/make_fixtures.py
Output: tests/aarch64/fixtures/{*.tflite, cases.npz, manifest.json}. The x86
pytest (test_fixtures_are_current) checks the stored outputs against the
current x86 build and a numpy float64 reference, so stale fixtures fail.
"""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(HERE, "fixtures")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from run_on_device import run_case  # noqa: E402  (the same runner the aarch64 side uses)

# D = 37 leaves a 1-element tail after the 4-wide NEON loop; K = 20 bags hit
# the 8-row group kernel (2 groups + 4 rows), bags padded to 6 rows the
# one-row kernel.
N, D, K = 200, 37, 20
SEED = 15


def bags(rng, batch, pad=True, int64=False):
    idx = rng.integers(0, N, size=(batch, K)).astype(np.int64 if int64 else np.int32)
    if pad:
        idx[::3, 6:] = -1  # padding: 6 valid rows in every third bag
        if batch > 1:
            idx[1, :] = -1  # an empty bag
    w = rng.uniform(0.1, 2.0, size=(batch, K)).astype(np.float32)
    return idx, w


def single_row_bags(rng, batch):
    """One valid index per bag, weight 1: the output is the dequantised row."""
    idx = np.full((batch, K), -1, np.int32)
    idx[:, 0] = rng.permutation(N)[:batch]
    return idx, np.ones((batch, K), np.float32)


def rewrite(model_bytes, mutate):
    from ai_edge_litert import schema_py_generated as schema
    import flatbuffers
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    mutate(model, schema)
    b = flatbuffers.Builder(1024)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def main():
    import tensorflow as tf
    from flatbuffers import flexbuffers
    from pkm_serve import ops, tflite

    rng = np.random.default_rng(SEED)
    table = rng.standard_normal((N, D)).astype(np.float32)
    tf_table = tf.constant(table)

    def convert(fn, signature):
        concrete = tf.function(fn, input_signature=signature).get_concrete_function()
        converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete])
        converter.allow_custom_ops = True
        return converter.convert()

    i32, f32 = tf.TensorSpec([None, K], tf.int32), tf.TensorSpec([None, K], tf.float32)
    models = {}
    for combiner in ("sum", "mean", "sqrtn"):
        models[f"op_{combiner}"] = convert(
            lambda i, w, c=combiner: ops.embedding_bag(tf_table, i, w, combiner=c), [i32, f32])
    models["op_int64_noweights"] = convert(
        lambda i: ops.embedding_bag(tf_table, i, None, combiner="sum"),
        [tf.TensorSpec([None, K], tf.int64)])
    models["op_int8"] = tflite.quantize_table_int8(models["op_sum"])
    models["op_fp16_mean"] = tflite.build_embedding_bag_model(table.astype(np.float16), K,
                                                              combiner="mean")
    models["composite"] = convert(
        lambda i, w: tf.reduce_sum(tf.gather(tf_table, i) * w[..., None], axis=-2), [i32, f32])
    models["composite_noweights"] = convert(
        lambda i: tf.reduce_sum(tf.gather(tf_table, i), axis=1), [i32])

    base = tflite.build_embedding_bag_model(table, K, batch=2)

    def set_op(field, value):
        return lambda m, s: setattr(m.subgraphs[0].operators[0], field, value)

    def set_tensor(i, field, value):
        return lambda m, s: setattr(m.subgraphs[0].tensors[i], field, value(s))

    def int8_without_scales(m, s):
        t = m.subgraphs[0].tensors[0]
        t.type = s.TensorType.INT8
        m.buffers[t.buffer].data = np.zeros(N * D, np.uint8)

    options = lambda d: np.frombuffer(bytes(flexbuffers.Dumps(d)), np.uint8)  # noqa: E731
    malformed = {
        "bad_one_input": (set_op("inputs", [0]), "expects 2 or 3 inputs"),
        "bad_float_indices": (set_tensor(1, "type", lambda s: s.TensorType.FLOAT32),
                              "indices must be int32 or int64"),
        "bad_int32_table": (set_tensor(0, "type", lambda s: s.TensorType.INT32),
                            "params must be float32, float16, bfloat16 or int8"),
        "bad_int8_without_scales": (int8_without_scales, "int8 params need per-row"),
        "bad_rank3_table": (set_tensor(0, "shape", lambda s: [N // 4, 4, D]), "params must be a [N, D] matrix"),
        "bad_garbage_options": (set_op("customOptions", np.frombuffer(b"\x07\xff\x00\x13junk", np.uint8)),
                                "malformed flexbuffer"),
        "bad_unknown_combiner": (set_op("customOptions", options({"combiner": "min"})),
                                 "'combiner' must be 'sum', 'mean', 'sqrtn' or 'max', got 'min'"),
    }
    for name, (mutate, _) in malformed.items():
        models[name] = rewrite(base, mutate)
    models["bad_truncated_file"] = models["op_sum"][: len(models["op_sum"]) // 2]

    cases = []
    arrays = {}

    def add(name, model, inputs, compare, **kw):
        case = {"name": name, "model": f"{model}.tflite", "compare": compare,
                "num_threads": kw.pop("num_threads", 1),
                "fuse_composites": kw.pop("fuse_composites", False),
                "use_delegate": kw.pop("use_delegate", True),
                "error": kw.pop("error", None), "n_inputs": len(inputs),
                "interpreters": kw.pop("interpreters", ["litert", "tflite_runtime"])}
        assert not kw, kw
        for i, x in enumerate(inputs):
            arrays[f"{name}/input_{i}"] = x
        cases.append(case)

    for combiner in ("sum", "mean", "sqrtn"):
        add(f"op_{combiner}", f"op_{combiner}", bags(rng, 24), "fp32")
    add("op_sum_2_threads", "op_sum", bags(rng, 64), "fp32", num_threads=2)
    add("op_int64_noweights", "op_int64_noweights", bags(rng, 17, int64=True)[:1], "fp32")
    add("op_empty_batch", "op_sum", bags(rng, 0), "fp32")
    add("op_int8", "op_int8", bags(rng, 24), "fp32")
    add("op_int8_dequantised_rows", "op_int8", single_row_bags(rng, 50), "exact")
    idx16, w16 = bags(rng, 24)
    add("op_fp16_mean", "op_fp16_mean", [idx16, w16.astype(np.float16)], "fp16")
    for name in ("composite", "composite_noweights"):
        idx, w = bags(rng, 24, pad=False)  # stock GATHER has no padding
        inputs = [idx, w] if name == "composite" else [idx]
        add(f"{name}_fused", name, inputs, "fp32", fuse_composites=True, num_threads=2)
        add(f"{name}_stock", name, inputs, "fp32", use_delegate=False)
    idx, w = bags(rng, 3, pad=False)
    idx[1, 2] = N + 5
    add("error_index_out_of_range", "op_sum", [idx, w], "error",
        error=rf"indices[{K + 2}] = {N + 5} is out of range [0, {N})")
    idx, w = bags(rng, 3, pad=False)
    idx[2, 0] = -1
    add("error_fused_negative_index", "composite", [idx, w], "error", fuse_composites=True,
        error=rf"indices[{2 * K}] = -1 is out of range [0, {N})")
    for name, (_, message) in malformed.items():
        add(name, name, [np.ones((2, K), np.int32), np.ones((2, K), np.float32)], "error",
            error=message)
    # tflite_runtime 2.14 does not verify a model file's flatbuffer: a truncated
    # one crashes it on aarch64 (SIGSEGV with or without our delegate; on x86 it
    # happens to read "No subgraph"), so only LiteRT, which verifies, runs it.
    add("bad_truncated_file", "bad_truncated_file", bags(rng, 2), "error",
        error="not a valid Flatbuffer", interpreters=["litert"])

    os.makedirs(FIXTURES, exist_ok=True)
    for old in os.listdir(FIXTURES):
        os.remove(os.path.join(FIXTURES, old))
    for name, blob in models.items():
        with open(os.path.join(FIXTURES, f"{name}.tflite"), "wb") as f:
            f.write(blob)
    # x86 outputs (or errors) of every case, from this machine's build.
    for case in cases:
        result = run_case(FIXTURES, case, arrays, "litert")
        if case["error"] is not None:
            assert "error" in result, (case["name"], result)
            assert case["error"] in result["error"], (case["name"], result["error"])
            case["x86_error"] = result["error"]
        else:
            assert "error" not in result, (case["name"], result)
            for i, out in enumerate(result["outputs"]):
                arrays[f"{case['name']}/x86_output_{i}"] = out
            case["n_outputs"] = len(result["outputs"])
    np.savez_compressed(os.path.join(FIXTURES, "cases.npz"), table=table, **arrays)
    with open(os.path.join(FIXTURES, "manifest.json"), "w") as f:
        json.dump({"N": N, "D": D, "K": K, "seed": SEED, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases, {len(models)} models to {FIXTURES}")


if __name__ == "__main__":
    main()
