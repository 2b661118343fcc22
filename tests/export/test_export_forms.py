"""The composite forms real models are written in, each exported with
--tflite: fused in the report and in the SavedModel, equal to the original in
TF, and the .tflite equal too through the delegate in LiteRT and in
tflite_runtime (the TF-free venv). References: numpy float64 (export_models)
and the original SavedModel itself.

Every model is built and exported once per module (fixtures below); the
tests only read the results.
"""
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve import tflite  # noqa: E402
from pkm_serve.export import main  # noqa: E402

ops.load_library()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME_PY = os.path.join(ROOT, ".venv-tflite-runtime", "bin", "python")
FUSED_OPS = ("PkmEmbeddingBag", "PkmRaggedEmbeddingBag")
HALF = 2e-2
FP32 = 1e-5


def _dense_inputs(rng, batch=7):
    return {"idx": rng.integers(0, M.N, (batch, M.K)).astype(np.int32),
            "w": rng.uniform(0.2, 2.0, (batch, M.K)).astype(np.float32)}


def _masked(rng):
    return {"ids": M._masked_ids(rng, 7)}


# name: (builder, {signature: inputs(rng)}, output tolerance, fused op)
FORMS = {
    "keras_masked_mean": (M.keras_masked_mean, {"serving_default": _masked}, FP32,
                          "PkmEmbeddingBag"),
    "masked_forms": (M.masked_forms, {"serving_default": _masked}, FP32, "PkmEmbeddingBag"),
    "mean_of_weighted": (M.mean_of_weighted, {"serving_default": _dense_inputs}, FP32,
                         "PkmEmbeddingBag"),
    "cast_forms": (M.cast_forms, {"serving_default": lambda rng: {
        "idx": _dense_inputs(rng)["idx"],
        "w": _dense_inputs(rng)["w"].astype(np.float16)}}, HALF, "PkmEmbeddingBag"),
    "keras_mixed_precision": (M.keras_mixed_precision, {"serving_default": lambda rng: {
        "ids": _dense_inputs(rng)["idx"]}}, HALF, "PkmEmbeddingBag"),
    "keras_ops_forms": (M.keras_ops_forms, {"serving_default": _dense_inputs}, FP32,
                        "PkmEmbeddingBag"),
    "sparse": (M.sparse_all_combiners, {
        "weighted": lambda rng: M.sparse_inputs(rng, True, False),
        "unweighted": lambda rng: M.sparse_inputs(rng, False, False)}, FP32,
        "PkmRaggedEmbeddingBag"),
    "safe_sparse": (lambda p: M.sparse_all_combiners(p, safe=True), {
        "weighted": lambda rng: M.sparse_inputs(rng, True, True),
        "unweighted": lambda rng: M.sparse_inputs(rng, False, True),
        "default_id": lambda rng: M.sparse_inputs(rng, True, True)}, FP32,
        "PkmRaggedEmbeddingBag"),
}


def _outputs(out):
    """Signature outputs as {name: array}; Keras' single output as 'out'."""
    out = {k: np.asarray(v) for k, v in out.items()}
    return {"out": out["output_0"]} if list(out) == ["output_0"] else out


def _reference(ref, x, signature):
    takes_signature = len(inspect.signature(ref).parameters) == 2
    want = ref(x, signature) if takes_signature else ref(x)
    return want if isinstance(want, dict) else {"out": want}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every form built, exported with --tflite and --report through the CLI,
    and run: original and fused SavedModel in TF, the .tflite in LiteRT
    in-process and in tflite_runtime in one subprocess."""
    base = tmp_path_factory.mktemp("forms")
    rng = np.random.default_rng(13)
    results, jobs = {}, []
    for name, (builder, signatures, tol, op) in FORMS.items():
        src, dst = base / name, base / (name + "_out")
        _, ref = builder(str(src))
        tfl, report = base / (name + ".tflite"), base / (name + ".json")
        assert main([str(src), str(dst), "--tflite", str(tfl), "--report", str(report),
                     "--quiet"]) == 0, name
        original = tf.saved_model.load(str(src))
        fused = tf.saved_model.load(str(dst / "1"))
        runs = {}
        for sig, make_inputs in signatures.items():
            x = make_inputs(rng)
            inputs_npz = base / f"{name}.{sig}.in.npz"
            np.savez(inputs_npz, **x)
            out_npz = base / f"{name}.{sig}.rt.npz"
            jobs.append({"model": str(tfl), "signature": sig, "inputs": str(inputs_npz),
                         "outputs": str(out_npz)})
            litert = tflite.make_interpreter(str(tfl), interpreter="litert")
            runs[sig] = {
                "inputs": x, "reference": _reference(ref, x, sig),
                "original": _outputs(original.signatures[sig](**x)),
                "fused": _outputs(fused.signatures[sig](**x)),
                "litert": _outputs(litert.get_signature_runner(sig)(**x)),
                "runtime_npz": out_npz}
        results[name] = {"report": json.loads(report.read_text()), "dst": str(dst / "1"),
                         "src": str(src),
                         "tflite": str(tfl), "runs": runs, "tol": tol, "op": op}
    if not os.path.exists(RUNTIME_PY):
        pytest.fail(f"{RUNTIME_PY} missing: `make test` builds .venv-tflite-runtime")
    jobs_path = base / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=ROOT, PKM_TFLITE_DELEGATE=tflite.delegate_path())
    proc = subprocess.run([RUNTIME_PY, os.path.join(ROOT, "tests", "export",
                                                    "run_signature_in_runtime.py"),
                           str(jobs_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for res in results.values():
        for run in res["runs"].values():
            got = dict(np.load(run["runtime_npz"]))
            assert "error" not in got, str(got.get("error"))
            run["tflite_runtime"] = _outputs(got)
    return results


def _close(got, want, tol, what):
    assert set(got) == set(want), what
    for key in want:
        g, w = np.asarray(got[key], np.float64), np.asarray(want[key], np.float64)
        assert g.shape == w.shape, f"{what} {key}: {g.shape} vs {w.shape}"
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * max(1.0, np.abs(w).max()),
                                   err_msg=f"{what} {key}")


@pytest.mark.parametrize("name", list(FORMS))
def test_fused_in_report_and_savedmodel(exported, name):
    res = exported[name]
    report = res["report"]
    counts = M.op_counts(res["dst"])
    assert report["sites_fused"] >= 1 and report["sites_skipped"] == 0, report["sites"]
    assert report["sites_fused"] == sum(counts.get(op, 0) for op in FUSED_OPS)
    assert counts.get(res["op"], 0) >= 1
    # No table gather is left: every site, in every (nested) function, went.
    assert not counts.get("ResourceGather") and not any(
        s["status"] != "fused" for s in report["sites"])
    assert report["tflite"]["custom_ops"] == [res["op"]]
    assert report["tflite"]["status"] == "verified with the pkm delegate"


@pytest.mark.parametrize("name", list(FORMS))
def test_outputs_equal_original_in_tf_and_tflite(exported, name):
    res = exported[name]
    for sig, run in res["runs"].items():
        # The builder's numpy reference agrees with the original model...
        _close(run["original"], run["reference"], res["tol"], f"{name}/{sig} original")
        # ...and every path agrees with the original.
        for path in ("fused", "litert", "tflite_runtime"):
            _close(run[path], run["original"], res["tol"], f"{name}/{sig} {path}")


def test_sparse_tflite_holds_only_builtins_and_our_ops(exported):
    """The whole safe_ site converted: no SparseFillEmptyRows/Flex op left."""
    for name in ("sparse", "safe_sparse"):
        model = open(exported[name]["tflite"], "rb").read()
        assert b"FlexSparse" not in model and b"SparseFillEmptyRows" not in model
        report = exported[name]["report"]
        patterns = {s["pattern"] for s in report["sites"]}
        assert patterns == ({"safe_embedding_lookup_sparse"} if name == "safe_sparse"
                            else {"embedding_lookup_sparse"})
        assert {s["combiner"] for s in report["sites"]} == {"sum", "mean", "sqrtn"}
        assert {s["weighted"] for s in report["sites"]} == {True, False}


def test_report_describes_each_form(exported):
    sites = {name: exported[name]["report"]["sites"] for name in FORMS}
    [masked] = sites["keras_masked_mean"]
    assert masked["masked"] and masked["combiner"] == "sum" and not masked["weighted"]
    [mean_w] = sites["mean_of_weighted"]
    assert mean_w["weighted"] and mean_w["combiner"] == "sum" and mean_w["divisor"] == M.K
    casts = {s["cast_to"] for s in sites["cast_forms"]}
    assert casts == {"float16", "float32"}
    assert {s["dtype"] for s in sites["cast_forms"]} == {"float32", "float16"}
    [mixed] = sites["keras_mixed_precision"]
    assert mixed["cast_to"] == "float16" and mixed["dtype"] == "float32"
    for form in sites.values():
        for s in form:
            assert s["reason"] == "" and s["status"] == "fused"
            assert s["bytes_per_index"] > 0


def _stock_convert(saved_model_dir):
    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir)
    return converter.convert()  # builtins only: no custom ops allowed


@pytest.mark.parametrize("name", ["keras_mixed_precision", "cast_forms", "safe_sparse"])
def test_fusion_makes_unconvertible_models_convertible(exported, name):
    """The stock converter rejects these sources (float16 Sum, SparseSegment*,
    SparseFillEmptyRows); their fused export converted (checked above)."""
    with pytest.raises(Exception, match="not supported|failed|Failed"):
        _stock_convert(exported[name]["src"])
    assert os.path.getsize(exported[name]["tflite"]) > 0
