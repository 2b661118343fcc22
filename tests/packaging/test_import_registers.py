"""`import pkm_serve` registers the op library with TensorFlow and the layers
with Keras (the tensorflow_text convention), once and thread-safely, without
importing TensorFlow itself. Each check runs in a fresh interpreter that
imports nothing of ours but ``pkm_serve``."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import pkm_serve
from pkm_serve import _library, ops
from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

from tests import reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, D, K = 50, 8, 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A SavedModel whose graph holds PkmEmbeddingBag (as export writes it), a
    .keras file with both layers, their inputs and expected outputs."""
    d = tmp_path_factory.mktemp("import_registers")
    rng = np.random.default_rng(5)
    table = rng.standard_normal((N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=(6, K)).astype(np.int64)
    w = rng.uniform(0.5, 1.5, size=(6, K)).astype(np.float32)

    class Fused(tf.Module):
        def __init__(self):
            self.table = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int64),
                                      tf.TensorSpec([None, K], tf.float32)])
        def serve(self, indices, weights):
            return {"out": ops.embedding_bag(self.table, indices, weights)}

    module = Fused()
    tf.saved_model.save(module, str(d / "fused"), signatures={"serving_default": module.serve})

    keras.utils.set_random_seed(1)
    x_in = keras.Input((12,), name="x")
    bag_in = keras.Input((K,), dtype="int64", name="bag")
    memory = ProductKeyMemory(v_dim=D, k_dim=8, n_keys=6, heads=2, knn=3, name="pkm")(x_in)
    bag = EmbeddingBag(N, D, combiner="mean", name="bag_layer")(bag_in)
    model = keras.Model([x_in, bag_in], memory + bag)
    x = rng.standard_normal((6, 12)).astype(np.float32)
    model.save(str(d / "model.keras"))
    np.savez(d / "inputs.npz", idx=idx, w=w, x=x)
    return {"dir": d, "bag_expected": reference.embedding_bag(table, idx, w),
            "keras_expected": model([x, idx], training=False).numpy()}


# load_both(d, tag) loads the fused SavedModel and the .keras file, writing the outputs to
# d/*_out_<tag>.npy; the script's own imports before the call are the case's.
LOAD_FUNCTION = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    def load_both(d, tag):
        import keras
        import tensorflow as tf
        inputs = np.load(os.path.join(d, "inputs.npz"))
        result = {}
        try:
            fused = tf.saved_model.load(os.path.join(d, "fused"))
            out = fused.signatures["serving_default"](indices=tf.constant(inputs["idx"]),
                                                      weights=tf.constant(inputs["w"]))["out"]
            np.save(os.path.join(d, f"bag_out_{tag}.npy"), out.numpy())
        except Exception as e:
            result["saved_model_error"] = str(e).splitlines()[0]
        try:
            model = keras.models.load_model(os.path.join(d, "model.keras"))
            np.save(os.path.join(d, f"keras_out_{tag}.npy"),
                    model([inputs["x"], inputs["idx"]], training=False).numpy())
            result["layer_modules"] = sorted({type(l).__module__ for l in model.layers})
        except Exception as e:
            result["keras_error"] = str(e).splitlines()[0]
        return result
""")
PRELUDES = {"pkm_serve_first": "import pkm_serve",
            # a private module first imports TensorFlow half-way through its own import
            "private_module_first": "import pkm_serve._library"}
# The control and the tensorflow_first case share one fresh process: with TensorFlow and Keras
# imported, both formats fail to load; then `import pkm_serve`, and both load.
CONTROL_THEN_TENSORFLOW_FIRST = LOAD_FUNCTION + textwrap.dedent("""
    import tensorflow, keras
    results = {"control": load_both(sys.argv[1], "control")}
    import pkm_serve
    results["tensorflow_first"] = load_both(sys.argv[1], "tensorflow_first")
    print(json.dumps(results))
""")


def run_fresh(script, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
               **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def control_then_tensorflow_first(saved):
    return run_fresh(CONTROL_THEN_TENSORFLOW_FIRST, str(saved["dir"]))


@pytest.mark.parametrize("case", ["pkm_serve_first", "tensorflow_first", "private_module_first"])
def test_fresh_process_with_only_import_pkm_serve_loads_both_formats(saved, case, request):
    d = saved["dir"]
    if case == "tensorflow_first":
        results, stderr = request.getfixturevalue("control_then_tensorflow_first")
        result = results[case]
    else:
        script = LOAD_FUNCTION + f"{PRELUDES[case]}\nprint(json.dumps(load_both(sys.argv[1], {case!r})))"
        result, stderr = run_fresh(script, str(d))
    assert set(result) == {"layer_modules"}, result  # no load error
    assert "registration after importing" not in stderr, stderr[-2000:]
    assert {"pkm_serve.layers.product_key_memory",
            "pkm_serve.layers.embedding_bag"} <= set(result["layer_modules"])
    np.testing.assert_allclose(np.load(d / f"bag_out_{case}.npy"), saved["bag_expected"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.load(d / f"keras_out_{case}.npy"), saved["keras_expected"],
                               rtol=1e-6, atol=1e-6)


def test_without_import_pkm_serve_both_formats_fail(control_then_tensorflow_first):
    """The control: the fresh process really depends on the import."""
    result = control_then_tensorflow_first[0]["control"]
    assert "PkmEmbeddingBag" in result["saved_model_error"], result
    assert "keras_error" in result, result


def test_import_pkm_serve_does_not_import_tensorflow():
    result, _ = run_fresh(textwrap.dedent("""
        import json, sys
        import pkm_serve, pkm_serve.cli, pkm_serve.tflite, pkm_serve.export.arguments
        print(json.dumps(sorted(m for m in ("tensorflow", "keras") if m in sys.modules)))
    """))
    assert result == []


# TensorFlow's own import is not thread-safe (two threads importing it race
# even without pkm_serve), so the threads race on the first `import pkm_serve`
# after TF and Keras are imported, which is what a server's workers would do.
CONCURRENT_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import tensorflow as tf, keras
    loads = []
    real_load = tf.load_op_library
    tf.load_op_library = lambda path: loads.append(path) or real_load(path)
    barrier = threading.Barrier(6)
    def worker():
        barrier.wait()
        import pkm_serve
    threads = [threading.Thread(target=worker) for i in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    import pkm_serve
    from pkm_serve import ops
    out = ops.embedding_bag(tf.ones([3, 2]), tf.constant([[0, 2]]))
    print(json.dumps({"loads": len(loads), "registered": sorted(pkm_serve._registered),
                      "out": out.numpy().tolist(),
                      "layer": keras.saving.get_registered_name(
                          keras.saving.get_registered_object("pkm_serve>EmbeddingBag"))}))
""")


def test_concurrent_first_imports_register_once():
    result, _ = run_fresh(CONCURRENT_SCRIPT)
    assert result == {"loads": 1, "registered": ["keras", "tensorflow"], "out": [[2.0, 2.0]],
                      "layer": "pkm_serve>EmbeddingBag"}


def test_load_library_loads_once_under_threads(monkeypatch):
    loaded = []
    real = tf.load_op_library

    def counting_load(path):
        loaded.append(path)
        return real(path)

    monkeypatch.setattr(_library, "_lib", None)
    monkeypatch.setattr(tf, "load_op_library", counting_load)
    barrier = threading.Barrier(8)
    libs = []

    def worker():
        barrier.wait()
        libs.append(ops.load_library())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loaded == [ops.library_path()]
    assert len(libs) == 8 and all(lib is libs[0] for lib in libs)


def test_an_unloadable_library_warns_and_tensorflow_still_imports(tmp_path):
    bogus = tmp_path / "_pkm_ops.so"
    bogus.write_bytes(b"not an ELF file")
    result, stderr = run_fresh(textwrap.dedent("""
        import json
        import pkm_serve
        import tensorflow as tf
        from pkm_serve import ops
        try:
            ops.load_library()
            error = None
        except tf.errors.NotFoundError as e:
            error = type(e).__name__
        print(json.dumps({"error": error, "tf": tf.__version__}))
    """), env_extra={"PKM_SERVE_OPS_LIB": str(bogus)})
    assert result["error"] == "NotFoundError" and result["tf"], result
    assert "does not load into TensorFlow" in stderr, stderr[-2000:]


def test_a_missing_library_points_to_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(_library, "_lib", None)
    monkeypatch.setenv("PKM_SERVE_OPS_LIB", str(tmp_path / "absent.so"))
    with pytest.raises(ops.OpLibraryNotFoundError, match=r"make build.*make wheel"):
        ops.load_library()


def test_a_missing_delegate_points_to_the_wheels(monkeypatch, tmp_path):
    from pkm_serve import tflite
    monkeypatch.delenv("PKM_TFLITE_DELEGATE", raising=False)
    monkeypatch.setattr(tflite, "__file__", str(tmp_path / "tflite.py"))  # an install without lib/
    with pytest.raises(FileNotFoundError, match=r"pkm_serve_device-\*\.whl.*make build"):
        tflite.delegate_path()


def test_a_found_spec_of_ours_copies_and_pickles(monkeypatch):
    """importlib.util.find_spec of a pkm_serve module not yet imported (runpy's, `python -m
    pkm_serve.cli`'s __main__.__spec__) has our wrapped loader: copy, deepcopy and pickle of it
    raised RecursionError (its attribute passthrough looked itself up before it had a loader)."""
    import copy
    import importlib.util
    import pickle

    name = "pkm_serve.demo"
    monkeypatch.delitem(sys.modules, name, raising=False)  # (another test of the worker may have imported it)
    spec = importlib.util.find_spec(name)
    assert isinstance(spec.loader, pkm_serve._RegisterAfterLoad)
    source = spec.loader.get_source(name)
    for copied in (copy.copy(spec.loader), copy.deepcopy(spec).loader, pickle.loads(pickle.dumps(spec.loader))):
        assert copied.get_source(name) == source
    assert name not in sys.modules


def test_a_module_of_ours_blocked_with_none_does_not_hold_registration_back(monkeypatch):
    """sys.modules['pkm_serve.backends'] = None (Python's way to make an import fail) counted as our
    import in progress, so importing TensorFlow afterwards never registered the op library."""
    monkeypatch.setitem(sys.modules, "pkm_serve.backends", None)
    assert not pkm_serve._own_import_in_progress()


def test_a_failed_import_of_ours_runs_the_registration_it_held_back(monkeypatch, tmp_path):
    """A pkm_serve module that imports TensorFlow and then fails (pkm_serve.serving.service without
    tensorflow-serving-api) held TensorFlow's registration back and, failing, never ran it: a later
    tf.saved_model.load found no PkmEmbeddingBag. It runs when the failed module is dropped."""
    import importlib

    (tmp_path / "_failing_after_tensorflow.py").write_text("import tensorflow\nraise ImportError('probe')\n")
    monkeypatch.setattr(pkm_serve, "__path__", [*pkm_serve.__path__, str(tmp_path)])
    ran = []
    monkeypatch.setitem(pkm_serve._REGISTRATIONS, "tensorflow", lambda: ran.append("tensorflow"))
    monkeypatch.setattr(pkm_serve, "_registered", {"keras", "torch"})
    with pytest.raises(ImportError, match="probe"):
        importlib.import_module("pkm_serve._failing_after_tensorflow")
    assert ran == ["tensorflow"]
    assert "pkm_serve._failing_after_tensorflow" not in sys.modules
