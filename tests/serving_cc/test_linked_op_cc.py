"""The linked-op C++ path: build/serving_cc/pkm_saved_model_run (pkm_serve's op
objects linked --whole-archive, as in a custom tensorflow_model_server) loads
exported SavedModels with tensorflow::LoadSavedModel and must answer what
Python answers, to 1e-6, and fail bad requests with our message."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

from serving_cc_helpers import (INT64_MODEL_ROWS, PROGRAM, REPO, export_demo_pkm,
                                require_program, run_cc, save_int64_model, save_ragged_model, tensor_arg,
                                tensor_file_arg)
from tests.reference import embedding_bag
from tests.saved_model_ops import graph_op_types

TOL = 1e-6


@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf
    from pkm_serve import ops
    ops.load_library()
    require_program()
    return tf


@pytest.fixture(scope="module")
def models(tmp_path_factory, tf):
    root = tmp_path_factory.mktemp("cc_models")
    ragged_dir, ragged_table = save_ragged_model(str(root / "ragged"))
    return {"demo": export_demo_pkm(str(root)), "ragged": ragged_dir, "ragged_table": ragged_table,
            "int64": save_int64_model(str(root / "int64"))}


_LOADED = {}


def loaded(tf, model_dir):
    """The SavedModel at `model_dir`, loaded once per module (several tests read each model)."""
    if model_dir not in _LOADED:
        _LOADED[model_dir] = tf.saved_model.load(model_dir)
    return _LOADED[model_dir]


def python_outputs(tf, model_dir, signature, inputs):
    fn = loaded(tf, model_dir).signatures[signature]
    return {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in inputs.items()}).items()}


def assert_same_as_python(tf, run, model_dir, signature, inputs):
    assert run.returncode == 0, run.stderr
    expected = python_outputs(tf, model_dir, signature, inputs)
    assert sorted(run.result["outputs"]) == sorted(expected)
    for key, want in expected.items():
        got = run.output(key)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=key)
    return expected


# ---- how the op gets into the program ---------------------------------------------------

def test_program_links_no_op_library():
    program = require_program()
    ldd = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
    assert "libtensorflow_cc.so" in ldd and "libtensorflow_framework.so" in ldd
    assert "_pkm_ops" not in ldd and "pkm" not in ldd.replace(program, "")
    needed = subprocess.run(["readelf", "-d", program], capture_output=True, text=True, check=True).stdout
    assert "_pkm_ops" not in needed
    # The kernel's code is inside the executable itself (whole-archive: nothing was dropped).
    symbols = subprocess.run(["nm", "-C", program], capture_output=True, text=True, check=True).stdout
    assert "pkm::Forward" in symbols and "pkm_tf::" in symbols


def test_ops_registered_at_start_and_no_op_library_opened(models):
    env = dict(os.environ, LD_DEBUG="files", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PKM_SERVE_OPS_LIB="/nonexistent/_pkm_ops.so")
    idx = np.array([[1, 2]], np.int64)
    proc = subprocess.run([PROGRAM, f"--model_dir={models['int64']}", "--signature=lookup",
                           tensor_arg("indices", idx), tensor_arg("weights", np.ones((1, 2), np.float32))],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Every shared object the dynamic loader opened, at start-up or by dlopen later.
    opened = re.findall(r"\bfile=(\S+)", proc.stderr)
    assert any("libtensorflow_cc.so" in f for f in opened)
    assert not [f for f in opened if "pkm" in os.path.basename(f).lower()]
    result = json.loads(proc.stdout)
    assert result["linked_ops"] == ["PkmEmbeddingBag", "PkmEmbeddingBagGrad", "PkmRaggedEmbeddingBag",
                                    "PkmRaggedEmbeddingBagGrad"]


@pytest.mark.slow
def test_without_whole_archive_the_ops_are_missing(models):
    """The control program: the same objects linked as a plain archive."""
    control = PROGRAM + "_no_whole_archive"
    make = subprocess.run(["make", "--no-print-directory", "-s", "-C", REPO, os.path.relpath(control, REPO)],
                          capture_output=True, text=True, timeout=600)
    assert make.returncode == 0, make.stderr[-2000:]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([control, f"--model_dir={models['int64']}", "--signature=lookup",
                           tensor_arg("indices", np.array([[1]], np.int64)),
                           tensor_arg("weights", np.ones((1, 1), np.float32))],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "Op type not registered 'PkmEmbeddingBag'" in proc.stderr


# ---- the three models --------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 5])
def test_demo_fused_pkm_matches_python(tf, models, batch):
    assert "PkmEmbeddingBag" in graph_op_types(models["demo"])
    query = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    run = run_cc(models["demo"], "serving_default", [tensor_arg("query", query)])
    expected = assert_same_as_python(tf, run, models["demo"], "serving_default", {"query": query})
    assert expected["output"].shape == (batch, 256) and np.abs(expected["output"]).max() > 0
    # As TF Serving names the session: the model, and the version directory it loaded.
    assert run.result["session_metadata"] == {"name": "pkm", "version": 1}


def test_ragged_model_matches_python_and_numpy(tf, models, tmp_path):
    assert "PkmRaggedEmbeddingBag" in graph_op_types(models["ragged"])
    rng = np.random.default_rng(5)
    lengths = [3, 0, 1, 7, 2]  # an empty bag gives zeros
    row_splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(-1, 500, row_splits[-1]).astype(np.int64)  # -1 = padding
    weights = rng.uniform(0.1, 2.0, row_splits[-1]).astype(np.float32)
    inputs = {"values": values, "row_splits": row_splits, "weights": weights}
    # Inputs as TensorProto files this time (the other input route).
    run = run_cc(models["ragged"], "bag", [tensor_file_arg(k, v, str(tmp_path)) for k, v in inputs.items()])
    assert_same_as_python(tf, run, models["ragged"], "bag", inputs)
    dense_idx = np.full((len(lengths), max(lengths)), -1, np.int64)
    dense_w = np.zeros(dense_idx.shape, np.float32)
    for b in range(len(lengths)):
        dense_idx[b, :lengths[b]] = values[row_splits[b]:row_splits[b + 1]]
        dense_w[b, :lengths[b]] = weights[row_splits[b]:row_splits[b + 1]]
    want = embedding_bag(models["ragged_table"], dense_idx, dense_w, combiner="mean")
    np.testing.assert_allclose(run.output("output"), want, rtol=1e-5, atol=1e-6)
    assert not run.output("output")[1].any()


def test_int64_model_matches_python_and_numpy(tf, models):
    rng = np.random.default_rng(9)
    idx = rng.integers(-1, INT64_MODEL_ROWS, (4, 6)).astype(np.int64)
    w = rng.uniform(-1, 1, (4, 6)).astype(np.float32)
    run = run_cc(models["int64"], "lookup", [tensor_arg("indices", idx), tensor_arg("weights", w)])
    assert_same_as_python(tf, run, models["int64"], "lookup", {"indices": idx, "weights": w})
    table = loaded(tf, models["int64"]).values.numpy()
    np.testing.assert_allclose(run.output("output"), embedding_bag(table, idx, w), rtol=1e-5, atol=1e-6)
    # The full PKM read of the same model: int64 slots come back exactly.
    query = rng.standard_normal((3, 32)).astype(np.float32)
    run = run_cc(models["int64"], "serving_default", [tensor_arg("query", query)])
    expected = assert_same_as_python(tf, run, models["int64"], "serving_default", {"query": query})
    assert run.output("slots").dtype == np.int64
    np.testing.assert_array_equal(run.output("slots"), expected["slots"])


# ---- errors ------------------------------------------------------------------------------

def test_out_of_range_index_is_invalid_argument_with_our_message(tf, models):
    idx = np.array([[1, 2, -1], [5, 6, INT64_MODEL_ROWS + 7]], np.int64)
    w = np.ones((2, 3), np.float32)
    run = run_cc(models["int64"], "lookup", [tensor_arg("indices", idx), tensor_arg("weights", w)])
    assert run.returncode == 1 and run.result is None
    message = f"indices[5] = {INT64_MODEL_ROWS + 7} is out of range [0, {INT64_MODEL_ROWS})"
    assert f"error: INVALID_ARGUMENT: {message}" in run.stderr
    with pytest.raises(tf.errors.InvalidArgumentError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        python_outputs(tf, models["int64"], "lookup", {"indices": idx, "weights": w})


def test_request_errors_are_clear(models):
    idx = tensor_arg("indices", np.array([[1]], np.int64))
    w = tensor_arg("weights", np.ones((1, 1), np.float32))
    missing = run_cc(models["int64"], "lookup", [idx])
    assert missing.returncode == 1 and "INVALID_ARGUMENT: signature 'lookup' needs input 'weights'" in missing.stderr
    unknown = run_cc(models["int64"], "lookup", [idx, w, tensor_arg("extra", np.ones(1, np.float32))])
    assert unknown.returncode == 1 and "has no input 'extra'" in unknown.stderr
    wrong_type = run_cc(models["int64"], "lookup", [tensor_arg("indices", np.array([[1]], np.int32)), w])
    assert wrong_type.returncode == 1 and "input 'indices' must be int64, got int32" in wrong_type.stderr
    no_sig = run_cc(models["int64"], "nope", [idx, w])
    assert no_sig.returncode == 1 and "NOT_FOUND: no signature 'nope'" in no_sig.stderr
    assert "lookup" in no_sig.stderr and "serving_default" in no_sig.stderr
    no_model = run_cc("/nonexistent/model", "lookup", [idx, w])
    assert no_model.returncode == 1 and "error: " in no_model.stderr


@pytest.mark.parametrize("args, message", [
    (["--input=indices=int64:[2]:1,2,3"], "shape [2] needs 2 values, got 3"),
    (["--input=indices=int64:2:1,2"], "must look like [2,3]"),
    (["--input=indices=int64:[1]:x"], "'x' is not an integer"),
    (["--input=indices=complex64:[1]:1"], "dtype 'complex64' is not one of"),
    (["--input=indices=@/nonexistent.pb"], "cannot read /nonexistent.pb"),
    (["--bogus=1"], "unknown flag --bogus"),
    (["--repeat=-1"], "--repeat and --warmup must be >= 0"),
])
def test_bad_command_lines_exit_2(models, args, message):
    run = run_cc(models["int64"], "lookup", args)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_repeat_reports_latency(models):
    query = np.zeros((2, 32), np.float32)
    run = run_cc(models["int64"], "serving_default", [tensor_arg("query", query)], "--repeat=5", "--warmup=1")
    assert run.returncode == 0, run.stderr
    lat = run.result["latency_us"]
    assert lat["runs"] == 5 and 0 < lat["min"] <= lat["median"] <= lat["p90"]
