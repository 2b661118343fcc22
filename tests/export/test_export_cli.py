"""`pkm-serve export` command line, report, bad input, atomic output, TFLite."""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.export import ExportError, export_saved_model, main  # noqa: E402
from pkm_serve.export import fuse, tflite_export  # noqa: E402
from pkm_serve.export.exporter import read_saved_model  # noqa: E402

ops.load_library()
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def weighted_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "weighted"
    table, _ = M.gather_weighted_sum(path)
    return str(path), table


def entries(path):
    return sorted(os.listdir(path)) if os.path.exists(path) else None


def test_cli_writes_version_and_json_report(weighted_model, tmp_path, capsys):
    src, table = weighted_model
    report = tmp_path / "report.json"
    dst = tmp_path / "models"
    assert main([src, str(dst), "--report", str(report), "--batch-size", "1000",
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "fused" in printed and "gather-reduce" in printed
    data = json.loads(report.read_text())
    assert data["version"] == 1 and data["dst"] == str(dst / "1")
    assert data["sites_found"] == data["sites_fused"] == 1
    # gathered rows and the weighted product, [1000, K, D] float32 each
    assert data["saved_bytes_at_batch"] == 2 * 1000 * M.K * M.D * 4
    assert data["sites"][0]["table_shape"] == [M.N, M.D]
    assert data["verification"][0]["max_abs_err"] < 1e-4
    # A second export gets the next version; the first stays as it was.
    assert main([src, str(dst), "--quiet"]) == 0
    assert entries(dst) == ["1", "2"]
    # Same variables as the source: variables are copied, not frozen.
    reader = tf.train.load_checkpoint(str(dst / "2" / "variables" / "variables"))
    values = [reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
              if reader.get_variable_to_shape_map()[n] == [M.N, M.D]]
    assert len(values) == 1 and np.array_equal(values[0], table)
    fused = read_saved_model(str(dst / "2"))
    for fdef in fused.meta_graphs[0].graph_def.library.function:
        for node in fdef.node_def:
            if node.op == "Const":
                dims = [d.size for d in node.attr["value"].tensor.tensor_shape.dim]
                assert np.prod(dims) < M.N * M.D, f"table frozen into {node.name}"


def test_not_a_saved_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("hi")
    (tmp_path / "model.keras").write_bytes(b"PK")
    (tmp_path / "legacy.h5").write_bytes(b"\x89HDF")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "saved_model.pb").write_bytes(b"\xff\x00 not a proto")
    for bad, message in [("empty", "is not a SavedModel"), ("file.txt", "not a directory"),
                         ("missing", "not a directory"), ("model.keras", "model.export(DIR) (Keras 3)"),
                         ("legacy.h5", "model.save(DIR) with no extension (tf_keras)"),
                         ("garbage", "not a valid SavedModel")]:
        assert main([str(tmp_path / bad), str(tmp_path / "dst"), "--quiet"]) == 1
        assert message in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "dst")


def test_version_base_dir_is_explained(weighted_model, tmp_path):
    src, _ = weighted_model
    export_saved_model(src, str(tmp_path / "base"), quiet=True)
    with pytest.raises(ExportError, match="did you mean the version directory"):
        export_saved_model(str(tmp_path / "base"), str(tmp_path / "other"), quiet=True)


def test_model_without_sites_exports_unchanged(tmp_path, capsys):
    kernel, ref = M.no_sites(tmp_path / "m")
    assert main([str(tmp_path / "m"), str(tmp_path / "dst"), "--quiet"]) == 0
    assert "no composite gather-sum sites found" in capsys.readouterr().out
    src_lib = read_saved_model(str(tmp_path / "m")).meta_graphs[0].graph_def.library
    dst_lib = read_saved_model(str(tmp_path / "dst" / "1")).meta_graphs[0].graph_def.library
    assert src_lib == dst_lib
    x = RNG.normal(size=(3, M.D)).astype(np.float32)
    got = tf.saved_model.load(str(tmp_path / "dst" / "1")).signatures["serving_default"](x=x)
    np.testing.assert_allclose(got["y"].numpy(), ref({"x": x})["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,message", [
    ("missing", "missing input 'w'"),
    ("shape", "input 'idx' has shape [2, 5]"),
    ("dtype", "input 'w' has dtype int64"),
    ("extra", "unexpected inputs ['bogus']"),
    ("out_of_range", "original model fails on the sample inputs"),
])
def test_mismatching_sample_inputs(weighted_model, tmp_path, case, message):
    src, _ = weighted_model
    idx = RNG.integers(0, M.N, (2, M.K)).astype(np.int32)
    w = RNG.uniform(size=(2, M.K)).astype(np.float32)
    samples = {"missing": {"idx": idx},
               "shape": {"idx": idx[:, :5], "w": w},
               "dtype": {"idx": idx, "w": w.astype(np.int64)},
               "extra": {"idx": idx, "w": w, "bogus": w},
               "out_of_range": {"idx": idx + M.N, "w": w}}[case]
    np.savez(tmp_path / "s.npz", **samples)
    dst = tmp_path / "dst"
    with pytest.raises(ExportError, match="verification failed") as info:
        export_saved_model(src, str(dst), sample_inputs=str(tmp_path / "s.npz"), quiet=True)
    assert message in str(info.value)
    assert entries(dst) is None  # DST did not exist before: nothing left behind


def test_sample_inputs_key_with_a_misspelled_signature_is_named(weighted_model, tmp_path, capsys):
    """'serving_defualt/w' was never read: the error said only "missing input 'w'"."""
    src, _ = weighted_model
    idx = RNG.integers(0, M.N, (2, M.K)).astype(np.int32)
    np.savez(tmp_path / "s.npz", **{"serving_default/idx": idx, "serving_defualt/w": idx.astype(np.float32)})
    assert main([src, str(tmp_path / "dst"), "--sample-inputs", str(tmp_path / "s.npz"), "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pkm-serve export: error: --sample-inputs key 'serving_defualt/w' names signature 'serving_defualt', "
        "which the model does not have; expected keys: "
        "['idx', 'w', 'serving_default/idx', 'serving_default/w']")
    assert entries(tmp_path / "dst") is None


def test_sample_inputs_are_used(weighted_model, tmp_path):
    src, _ = weighted_model
    idx = RNG.integers(0, M.N, (11, M.K)).astype(np.int64)  # int64 accepted for int32
    w = RNG.uniform(size=(11, M.K)).astype(np.float32)
    np.savez(tmp_path / "s.npz", **{"serving_default/idx": idx, "serving_default/w": w})
    result = export_saved_model(src, str(tmp_path / "dst"),
                                sample_inputs=str(tmp_path / "s.npz"), quiet=True)
    assert result.verification[0]["shape"] == [11, M.D]


def test_wrong_fusion_fails_verification_and_leaves_nothing(weighted_model, tmp_path,
                                                            monkeypatch):
    """A rewrite that computes the wrong thing is caught, and DST keeps only
    what was there before."""
    src, _ = weighted_model
    dst = tmp_path / "dst"
    export_saved_model(src, str(dst), quiet=True)
    real_fuse = fuse.fuse_site

    def wrong_combiner(fg, site):
        site.combiner = "mean"
        real_fuse(fg, site)
    monkeypatch.setattr(fuse, "fuse_site", wrong_combiner)
    with pytest.raises(ExportError, match="fused differs from original"):
        export_saved_model(src, str(dst), quiet=True)
    assert entries(dst) == ["1"]


def test_existing_version_is_never_overwritten(weighted_model, tmp_path):
    src, _ = weighted_model
    export_saved_model(src, str(tmp_path / "dst"), version=7, quiet=True)
    with pytest.raises(ExportError, match="already exists"):
        export_saved_model(src, str(tmp_path / "dst"), version=7, quiet=True)


def test_unknown_signature(weighted_model, tmp_path):
    src, _ = weighted_model
    with pytest.raises(ExportError, match=r"unknown signature\(s\) \['nope'\]"):
        export_saved_model(src, str(tmp_path / "dst"), signatures=["nope"], quiet=True)


def _tflite_runner(path, signature):
    from pkm_serve import tflite
    return tflite.make_interpreter(path).get_signature_runner(signature)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_tflite_custom_op_runs_in_delegate(weighted_model, tmp_path, quantize):
    src, table = weighted_model
    out = tmp_path / "model.tflite"
    result = export_saved_model(src, str(tmp_path / "dst"), tflite=str(out),
                                quantize_table=quantize, quiet=True)
    assert result.tflite["status"] == "verified with the pkm delegate"
    model = out.read_bytes()
    assert b"PkmEmbeddingBag" in model
    assert result.tflite["table_bytes_in_savedmodel"] == M.N * M.D * 4
    from pkm_serve import tflite
    tables = [t for t in tflite.make_interpreter(str(out)).get_tensor_details()
              if list(t["shape"]) == [M.N, M.D]]
    assert len(tables) == 1
    if quantize:  # per-row (axis 0) int8
        assert tables[0]["dtype"] == np.int8
        q = tables[0]["quantization_parameters"]
        assert len(q["scales"]) == M.N and q["quantized_dimension"] == 0
    else:
        assert tables[0]["dtype"] == np.float32
    x = {"idx": RNG.integers(0, M.N, (9, M.K)).astype(np.int32),
         "w": RNG.uniform(size=(9, M.K)).astype(np.float32)}
    got = _tflite_runner(str(out), "serving_default")(**x)["out"]
    want = M.np_bag(table, x["idx"], x["w"])
    tol = 2e-2 * np.abs(want).max() if quantize else 1e-5
    np.testing.assert_allclose(got, want, atol=tol, rtol=1e-4)


def test_tflite_over_flatbuffer_limit_is_refused(weighted_model, tmp_path, monkeypatch):
    src, _ = weighted_model
    # The table is 1600 B here; pretend the limit sits below it.
    monkeypatch.setattr(tflite_export, "FLATBUFFER_LIMIT", 1000)
    monkeypatch.setattr(tflite_export, "_HEADROOM", 0)
    with pytest.raises(ExportError, match="cannot exceed 2 GB"):
        export_saved_model(src, str(tmp_path / "dst"), tflite=str(tmp_path / "m.tflite"),
                           quiet=True)
    assert entries(tmp_path / "dst") is None
    assert not os.path.exists(tmp_path / "m.tflite")


def test_quantize_without_tflite_quantizes_the_savedmodel(weighted_model, tmp_path):
    # --quantize-table applies to the SavedModel too (tests/int8 has the details).
    src, _ = weighted_model
    result = export_saved_model(src, str(tmp_path / "dst"), quantize_table="int8", quiet=True)
    assert result.tflite is None and result.quantization["tables"][0]["int8_bytes"] == M.N * M.D


def test_pkm_serve_cli_dispatch_and_tf_serving_style_session_load(weighted_model, tmp_path):
    """`pkm-serve export` reaches this module; the result loads the way
    tensorflow_model_server does (a v1 Session over the MetaGraph's
    graph_def + function library) and computes the weighted bag sum."""
    from pkm_serve.cli import main as cli_main
    src, table = weighted_model
    assert cli_main(["export", src, str(tmp_path / "dst"), "--quiet"]) == 0
    x = {"idx": RNG.integers(0, M.N, (4, M.K)).astype(np.int32),
         "w": RNG.uniform(size=(4, M.K)).astype(np.float32)}
    with tf.compat.v1.Session(graph=tf.Graph()) as sess:
        meta = tf.compat.v1.saved_model.load(sess, ["serve"], str(tmp_path / "dst" / "1"))
        sig = meta.signature_def["serving_default"]
        assert "PkmEmbeddingBag" in {op.name for op in meta.meta_info_def.stripped_op_list.op}
        got = sess.run(sig.outputs["out"].name,
                       {sig.inputs[k].name: v for k, v in x.items()})
    np.testing.assert_allclose(got, M.np_bag(table, x["idx"], x["w"]), rtol=1e-5, atol=1e-5)


def test_sparse_sites_convert_with_int8_tables(tmp_path):
    """--quantize-table int8 also covers PkmRaggedEmbeddingBag tables."""
    table, ref = M.sparse_all_combiners(tmp_path / "m")
    out = tmp_path / "m.tflite"
    result = export_saved_model(str(tmp_path / "m"), str(tmp_path / "dst"), tflite=str(out),
                                quantize_table="int8", quiet=True)
    assert result.tflite["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    from pkm_serve import tflite
    interp = tflite.make_interpreter(str(out))
    tables = [t for t in interp.get_tensor_details() if list(t["shape"]) == [M.N, M.D]]
    assert tables and all(t["dtype"] == np.int8 for t in tables)
    x = M.sparse_inputs(np.random.default_rng(3), True, False)
    got = interp.get_signature_runner("weighted")(**x)
    for combiner, want in ref(x).items():
        np.testing.assert_allclose(got[combiner], want, rtol=2e-2,
                                   atol=2e-2 * np.abs(want).max(), err_msg=combiner)


def test_tflite_inside_the_version_directory_arrives_with_it(weighted_model, tmp_path):
    """`--tflite DST/<version>/model.tflite` (where `--prefer_tflite_model` serves it from):
    written into the temporary version directory and renamed into place with it."""
    src, _ = weighted_model
    dst = tmp_path / "dst"
    target = dst / "1" / "model.tflite"
    result = export_saved_model(src, str(dst), tflite=str(target), quiet=True)
    assert result.tflite["file"] == str(target)
    assert target.read_bytes()[4:8] == b"TFL3"
    assert sorted(p.name for p in dst.iterdir()) == ["1"]  # no temporaries left beside it
    assert (dst / "1" / "saved_model.pb").exists()


def test_tflite_in_another_version_directory_is_refused(weighted_model, tmp_path):
    """DST holds version 1, so the export writes 2: --tflite DST/5/model.tflite made DST/5 a
    bare model.tflite, which the server then failed to load as a SavedModel."""
    src, _ = weighted_model
    dst = tmp_path / "dst"
    (dst / "1").mkdir(parents=True)
    with pytest.raises(ExportError, match=r"inside version 5 of DST, but this export writes version 2: "
                                          r"pass --version 5 or --tflite .*dst/2/model.tflite"):
        export_saved_model(src, str(dst), tflite=str(dst / "5" / "model.tflite"), quiet=True)
    assert sorted(p.name for p in dst.iterdir()) == ["1"]
    result = export_saved_model(src, str(dst), version=5, tflite=str(dst / "5" / "model.tflite"), quiet=True)
    assert result.version == 5 and (dst / "5" / "saved_model.pb").exists()


def _two_signatures(path):
    module = tf.Module()
    module.t = tf.Variable(M._table(9))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.int32)])
    def a(ids):
        return {"out": tf.reduce_sum(tf.gather(module.t, ids), 1)}

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int32)])
    def b(tokens):
        return {"out": tf.reduce_mean(tf.gather(module.t, tokens), 1)}
    tf.saved_model.save(module, str(path), signatures={"a": a, "b": b})
    return module.t.numpy().astype(np.float64)


def test_sample_inputs_of_several_signatures_are_keyed_sig_name(tmp_path, capsys):
    src = tmp_path / "src"
    table = _two_signatures(src)
    ids = RNG.integers(0, M.N, (5, 3)).astype(np.int32)
    tokens = RNG.integers(0, M.N, (7, 2)).astype(np.int32)
    np.savez(tmp_path / "bare.npz", ids=ids, tokens=tokens)
    assert main([str(src), str(tmp_path / "dst"), "--sample-inputs", str(tmp_path / "bare.npz"), "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pkm-serve export: error: --sample-inputs key 'ids' is a bare NAME, which is fed to every signature, "
        "but signature(s) ['b'] take no input 'ids': with several signatures (['a', 'b']), key each input "
        "SIG/NAME (here 'a/ids')")
    assert entries(tmp_path / "dst") is None
    np.savez(tmp_path / "keyed.npz", **{"a/ids": ids, "b/tokens": tokens})
    result = export_saved_model(str(src), str(tmp_path / "dst"), sample_inputs=str(tmp_path / "keyed.npz"),
                                quiet=True)
    assert [(r["signature"], r["shape"]) for r in result.verification] == [("a", [5, M.D]), ("b", [7, M.D])]
    fused = tf.saved_model.load(result.dst).signatures
    np.testing.assert_allclose(fused["a"](ids=ids)["out"].numpy(), table[ids].sum(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused["b"](tokens=tokens)["out"].numpy(), table[tokens].mean(1), rtol=1e-5, atol=1e-6)


def test_help_documents_sig_name_sample_keys(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "key NAME feeds input NAME of every signature, SIG/NAME input NAME of signature SIG only" in help_text


def test_quantize_tolerance_without_quantize_table_is_a_usage_error(tmp_path, capsys):
    # It was silently ignored: the export ran with float tables and no tolerance check.
    from pkm_serve import cli
    for run in (lambda argv: main(argv), lambda argv: cli.run_command("export", argv)):
        with pytest.raises(SystemExit) as exit_:
            run([str(tmp_path / "src"), str(tmp_path / "dst"), "--quantize-tolerance", "1e-3"])
        assert exit_.value.code == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert lines[-1] == ("pkm-serve export: error: --quantize-tolerance applies to --quantize-table int8 "
                             "only: pass --quantize-table int8 too, or drop --quantize-tolerance")
        assert not (tmp_path / "dst").exists()
    from pkm_serve.export.arguments import build_parser
    args = build_parser().parse_args(["s", "d", "--quantize-table", "int8", "--quantize-tolerance", "1e-3"])
    assert args.quantize_tolerance == 1e-3


@pytest.mark.parametrize("option, where, needle", [
    # --report was written after DST/<version>: exit 1 with "[Errno 2] No such file or
    # directory" naming no option, and the version in place for a server to load.
    ("--report", "missing/report.json", "is not a directory"),
    ("--report", "a_dir", "is a directory"),
    # --tflite an existing directory failed only after the whole conversion.
    ("--tflite", "a_dir", "is a directory"),
    ("--tflite", "a_file/x.tflite", "is not a directory"),
])
def test_unwritable_output_files_are_refused_before_the_export(weighted_model, tmp_path, capsys,
                                                                option, where, needle):
    src, _ = weighted_model
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    dst = tmp_path / "models"
    assert main([src, str(dst), option, str(tmp_path / where), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"pkm-serve export: error: {option} " in err and needle in err, err
    assert entries(dst) is None


@pytest.mark.parametrize("content, needle", [
    # np.load read a .npy as one array: "TypeError: 'numpy.ndarray' object does not support
    # the context manager protocol".
    ("npy", "is a .npy (one unnamed array)"),
    # Any other file was "pickled (object) data" to np.load.
    (b"ids,weights\n1,2\n", "is not a .npz (a zip of named arrays"),
])
def test_sample_inputs_that_are_not_a_npz_are_named(weighted_model, tmp_path, capsys, content, needle):
    src, _ = weighted_model
    path = tmp_path / "samples.npz"
    if content == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros((2, 3), np.float32))
    else:
        path.write_bytes(content)
    dst = tmp_path / "models"
    assert main([src, str(dst), "--sample-inputs", str(path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"pkm-serve export: error: --sample-inputs {path} {needle}" in err, err
    assert entries(dst) is None


def test_dst_that_is_a_version_directory_is_refused(weighted_model, tmp_path, capsys):
    # Was exported to DST/1/1: a SavedModel nested in a served version, seen by no server.
    src, _ = weighted_model
    base = tmp_path / "models"
    assert main([src, str(base), "--quiet"]) == 0
    capsys.readouterr()
    assert main([src, str(base / "1"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"DST {base / '1'} is a SavedModel (a version directory?)" in err and f"pass {base}" in err, err
    assert entries(base / "1") == sorted(os.listdir(src))
