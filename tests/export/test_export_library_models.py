"""Models built with the real libraries (tests/export/library_models.py:
tf_keras feature columns on tf.Example input, tensorflow-recommenders,
keras-rs, a Keras 3 TextVectorization classifier, TF1-style tf.Modules),
exported through the CLI as a user would, without --sample-inputs (so the
generator must make inputs each model accepts) and with them.

Checked for each: the fused op count reachable from every serving signature
equals the model's pooled sites; outputs equal the original (and the numpy
reference where the builder restates the model) to 1e-5 on real-looking
inputs; the .tflite converts with builtins plus our ops and matches through
the delegate, or, where the model's own non-embedding ops have no TFLite
builtin (tf.Example parsing, string ops), the refusal
names that op and no SparseSegment* op is left behind.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops, tflite
from pkm_serve.export import main
from pkm_serve.export import tflite_export
from pkm_serve.export.errors import ExportError
from pkm_serve.export.exporter import read_saved_model

ops.load_library()
HERE = os.path.dirname(os.path.abspath(__file__))
FUSED_OPS = ("PkmEmbeddingBag", "PkmRaggedEmbeddingBag")
SPARSE_LEFTOVERS = ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
                    "SparseFillEmptyRows")
FP32 = 1e-5
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("library_models")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "library_models.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        "building the library models failed (`make test` installs "
        "requirements-models.lock): " + proc.stderr[-3000:])
    meta = json.loads((out / "meta.json").read_text())
    return out, meta


def _reachable_ops(saved_model_dir, signature):
    """{op: count} over the functions reachable from one signature."""
    mg = read_saved_model(str(saved_model_dir)).meta_graphs[0]
    library = {f.signature.name: f for f in mg.graph_def.library.function}
    outputs = {t.name.split(":")[0] for t in mg.signature_def[signature].outputs.values()}
    nodes = {n.name: n for n in mg.graph_def.node}
    todo, seen = [], set()
    stack = list(outputs)
    while stack:  # top-level graph: from the outputs back to the call ops
        name = stack.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        node = nodes[name]
        todo.extend(_called(node, library))
        stack.extend(i.lstrip("^").split(":")[0] for i in node.input)
    counts, done = {}, set()
    while todo:
        fname = todo.pop()
        if fname in done:
            continue
        done.add(fname)
        for node in library[fname].node_def:
            counts[node.op] = counts.get(node.op, 0) + 1
            todo.extend(_called(node, library))
    return counts


def _called(node, library):
    names = []
    for value in node.attr.values():
        if value.HasField("func") and value.func.name in library:
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func if f.name in library)
    return names


def _inputs(npz, signature, fn):
    specs = fn.structured_input_signature[1]
    return {name: npz[f"{signature}/{name}"] if f"{signature}/{name}" in npz.files
            else npz[name] for name in specs}


_ORIGINALS = {}


def _original_outputs(res, sig):
    """(inputs, outputs) of the original model's signature on the real-looking inputs,
    loaded and run once for the module's tests (a load costs up to seconds)."""
    key = (str(res["src"]), sig)
    if key not in _ORIGINALS:
        if str(res["src"]) not in _ORIGINALS:
            _ORIGINALS[str(res["src"])] = tf.saved_model.load(str(res["src"]))
        fn = _ORIGINALS[str(res["src"])].signatures[sig]
        x = _inputs(res["npz"], sig, fn)
        _ORIGINALS[key] = (x, {k: v.numpy() for k, v in fn(**x).items()})
    return _ORIGINALS[key]


def _close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    np.testing.assert_allclose(got, want, rtol=FP32, atol=FP32 * max(1.0, np.abs(want).max()),
                               err_msg=what)


@pytest.fixture(scope="module")
def exported(corpus):
    """Every model exported through the CLI on generated inputs (no
    --sample-inputs), with --tflite where it converts; models with string
    inputs once more as version 2 with the real-looking inputs as
    --sample-inputs (bytes arrays in the .npz)."""
    out, meta = corpus
    results = {}
    for name, info in meta.items():
        src, dst = out / name, out / (name + "_out")
        report1, report2 = out / (name + ".gen.json"), out / (name + ".real.json")
        tfl = out / (name + ".tflite")
        args = [str(src), str(dst), "--quiet", "--version", "1", "--report", str(report1)]
        if info["tflite"] == "ok":
            args += ["--tflite", str(tfl)]
            if info.get("tflite_signatures"):
                args += ["--signatures"] + info["tflite_signatures"]
        assert main(args) == 0, name
        verified = json.loads(report1.read_text())["verification"]
        if info.get("tflite_signatures"):  # --signatures verified those only: all of them
            report3 = out / (name + ".gen_all.json")
            assert main([str(src), str(dst), "--quiet", "--version", "3", "--report",
                         str(report3)]) == 0, name
            verified = json.loads(report3.read_text())["verification"]
        npz = np.load(out / (name + ".inputs.npz"))
        real = None
        if any(npz[k].dtype.kind == "S" for k in npz.files):
            assert main([str(src), str(dst), "--quiet", "--version", "2", "--report",
                         str(report2), "--sample-inputs",
                         str(out / (name + ".inputs.npz"))]) == 0
            real = json.loads(report2.read_text())
            assert real["verification"], name
        results[name] = {"meta": info, "src": src, "dst": dst / "1", "tflite": tfl,
                         "generated": json.loads(report1.read_text()), "real": real,
                         "verified_generated": verified,
                         "npz": npz}
    return results


NAMES = ["fc_examples", "fc_sparse_ids", "tf_keras_masked_mean", "keras3_text_classifier",
         "tfrs_ranking", "tfrs_tpu_embedding", "tfrs_tpu_embedding_unweighted",
         "keras_rs_embed_reduce", "tf1_modules", "tfm_dlrm_ranking"]


@pytest.mark.parametrize("name", NAMES)
def test_every_pooled_site_fused(exported, name):
    res = exported[name]
    info = res["meta"]
    for sig, pooled in info["pooled"].items():
        counts = _reachable_ops(res["dst"], sig)
        assert sum(counts.get(op, 0) for op in FUSED_OPS) == pooled, (sig, counts)
        if pooled and sig not in info.get("skipped", {}):
            assert not any(counts.get(op) for op in SPARSE_LEFTOVERS), (sig, counts)
    report = res["generated"]
    computes = sorted(s["computes"] for s in report["sites"] if s["status"] == "fused")
    for label in info.get("computes", []):
        assert label in computes, (label, computes)
    skipped = [s for s in report["sites"] if s["status"] != "fused"]
    for sig, why in info.get("skipped", {}).items():
        assert any(why in s["reason"] for s in skipped), (sig, [s["reason"] for s in skipped])
    if "skipped" not in info:
        assert not skipped, [s["reason"] for s in skipped]


@pytest.mark.parametrize("name", NAMES)
def test_outputs_equal_original_on_real_looking_inputs(exported, name):
    res = exported[name]
    fused = tf.saved_model.load(str(res["dst"]))
    for sig in res["meta"]["pooled"]:
        x, want = _original_outputs(res, sig)
        got = {k: v.numpy() for k, v in fused.signatures[sig](**x).items()}
        assert set(got) == set(want)
        for key in want:
            _close(got[key], want[key], f"{name}/{sig}/{key}")
        reference = res["meta"].get("reference", {}).get(sig)
        if reference is None:
            continue
        if not isinstance(reference, dict):
            reference = {list(want)[0]: reference}
        for key, value in reference.items():
            _close(want[key], value, f"{name}/{sig}/{key} original vs numpy")
    # On generated inputs every signature was verified, each output to fp32.
    rows = res["verified_generated"]
    assert {r["signature"] for r in rows} >= set(res["meta"]["pooled"]), rows
    assert all(r["max_abs_err"] <= FP32 for r in rows), rows


@pytest.mark.parametrize("name", [n for n in NAMES])
def test_tflite_converts_or_names_the_models_own_op(exported, name):
    res = exported[name]
    info = res["meta"]
    if info["tflite"] == "ok":
        tflite_info = res["generated"]["tflite"]
        assert tflite_info["status"] == "verified with the pkm delegate"
        assert set(tflite_info["custom_ops"]) <= set(FUSED_OPS)
        interp = tflite.make_interpreter(str(res["tflite"]))
        for sig in info.get("tflite_signatures") or info["pooled"]:
            x, want = _original_outputs(res, sig)
            got = interp.get_signature_runner(sig)(**x)
            for key in want:
                _close(got[key], want[key], f"{name}/{sig}/{key} tflite")
        return
    sigs = sorted(info["pooled"])
    with pytest.raises(ExportError) as err:
        tflite_export.convert_and_verify(str(res["dst"]), sigs, str(res["tflite"]), None,
                                         str(res["src"]), 1, None, 2)
    message = str(err.value)
    assert info["refused_op"] in message, message
    assert not any(op in message for op in SPARSE_LEFTOVERS), message


def test_clipped_site_leaves_a_clear_tflite_error(exported):
    """max_norm stays composite (reported): --tflite names SparseSegmentMean and why."""
    res = exported["tf1_modules"]
    with pytest.raises(ExportError) as err:
        tflite_export.convert_and_verify(
            str(res["dst"]), ["clipped"], str(res["tflite"]), None, str(res["src"]), 1,
            None, 2, not_fused=[type("S", (), s)() for s in res["generated"]["sites"]
                                if s["status"] != "fused"])
    assert "SparseSegmentMean" in str(err.value) and "max_norm" in str(err.value)
