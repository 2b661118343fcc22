"""`pkm-serve tflite MODEL` prepares the model before printing its plan: a node with no kernel
(a custom op neither the runtime nor the pkm delegate has, e.g. the converter's ParseExampleV2)
was listed as "runs" with exit 0, and the model then failed to load wherever it was served."""
import numpy as np

from pkm_serve import tflite, tflite_cli

TABLE = np.random.default_rng(34).standard_normal((10, 4)).astype(np.float32)


def _with_custom_op_named(name):
    """The one-op bag model with its custom op renamed (no kernel anywhere for it)."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(tflite.build_embedding_bag_model(TABLE, 3)), 0))
    m.operatorCodes[0].customCode = name
    b = flatbuffers.Builder(1 << 12)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def test_a_node_without_a_kernel_is_an_error_not_a_plan(tmp_path, capsys):
    path = tmp_path / "parse.tflite"
    path.write_bytes(_with_custom_op_named("ParseExampleV2"))
    assert tflite_cli.console_main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert "runs" not in out and "claimed" not in out, out
    assert err.strip().splitlines() == ["pkm-serve tflite: error: Encountered unresolved custom op: ParseExampleV2."]


def test_the_bag_op_is_still_claimed_by_the_delegate(tmp_path, capsys):
    path = tmp_path / "bag.tflite"
    path.write_bytes(tflite.build_embedding_bag_model(TABLE, 3))
    assert tflite_cli.console_main([str(path)]) == 0
    plan = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert plan[0][:2] == ["0", "PkmEmbeddingBag"] and plan[0][-4:] == ["claimed", "by", "node", "1"], plan
    assert plan[1][1] == "DELEGATE" and plan[1][-1] == "runs", plan
    # The model runs as the plan says: numpy float64 reference.
    ids, w = np.array([[0, 9, 2]], np.int32), np.array([[1.0, 0.5, -2.0]], np.float32)
    got = tflite.run_tflite(str(path), [ids, w])[0]
    np.testing.assert_allclose(got, (w[..., None] * TABLE.astype(np.float64)[ids]).sum(axis=1), rtol=1e-5, atol=1e-6)


def _unreadable_files(tmp_path):
    """{file: the one line `pkm-serve tflite` prints}: the runtimes' own words named no file
    ("Mmap of '3' at offset '0' failed with error '22'", "Model provided has model identifier
    'o wo', should be 'TFL3'", "No subgraph in the model.")."""
    model = tflite.build_embedding_bag_model(TABLE, 3)
    files = {"empty.tflite": b"", "notes.tflite": b"hello world\n", "short.tflite": b"TFL",
             "cut.tflite": model[:100]}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    start = "pkm-serve tflite: error: " + str(tmp_path)
    return {str(tmp_path / "empty.tflite"): f"{start}/empty.tflite: the file is empty (0 bytes), not a TFLite model",
            str(tmp_path / "notes.tflite"): f"{start}/notes.tflite: not a TFLite model (no file identifier 'TFL3' "
                                            "at bytes 4..8; the file starts b'hello wo')",
            str(tmp_path / "short.tflite"): f"{start}/short.tflite: not a TFLite model (no file identifier 'TFL3' "
                                            "at bytes 4..8; the file starts b'TFL')",
            str(tmp_path / "cut.tflite"): f"{start}/cut.tflite: "}


def test_an_empty_text_or_cut_file_is_one_line_naming_it(tmp_path, capsys):
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runtime_py = os.path.join(root, ".venv-tflite-runtime", "bin", "python")
    want = _unreadable_files(tmp_path)
    for path, line in want.items():
        assert tflite_cli.console_main([path, "--interpreter", "litert"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
        assert path.endswith("cut.tflite") == (err[0] != line), err   # (the runtime's reason follows)
    # tflite_runtime (no TensorFlow), one process for every file.
    script = ("import sys; from pkm_serve import tflite_cli\n"
              "for path in sys.argv[1:]:\n"
              "    print('rc', tflite_cli.console_main([path, '--interpreter', 'tflite_runtime']), file=sys.stderr)\n")
    proc = subprocess.run([runtime_py, "-c", script, *want], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("INFO:")]
    assert len(lines) == 2 * len(want), proc.stderr
    for (path, line), (err, rc) in zip(want.items(), zip(lines[::2], lines[1::2])):
        assert rc == "rc 1" and err.startswith(line), (path, err)
        assert path.endswith("cut.tflite") == (err != line), err


def test_an_interpreter_not_installed_is_one_line(tmp_path, capsys):
    """The device wheel's `pkm-serve-tflite --interpreter litert` where only tflite_runtime is
    installed (here: tflite_runtime, not in this venv) ended in a ModuleNotFoundError traceback."""
    import importlib.util
    import pytest
    if importlib.util.find_spec("tflite_runtime") is not None:
        pytest.skip("tflite_runtime is installed here")
    path = tmp_path / "bag.tflite"
    path.write_bytes(tflite.build_embedding_bag_model(TABLE, 3))
    assert tflite_cli.console_main([str(path), "--interpreter", "tflite_runtime"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "pkm-serve tflite: error: interpreter 'tflite_runtime' needs pip's tflite-runtime, which is not "
        "installed here (No module named 'tflite_runtime')"]


def test_an_interpreter_that_fails_to_import_is_not_called_not_installed(monkeypatch):
    """An installed runtime whose import fails (tflite_runtime 2.14, built for numpy 1, under
    numpy 2; tensorflow missing one of its own dependencies) was 'needs pip's ..., which is not
    installed here': untrue, and pip install would change nothing. It names the import's error."""
    import importlib
    import pytest
    real = importlib.import_module

    def broken(name, *args):
        if name == "tflite_runtime.interpreter":
            raise ImportError("numpy.core.multiarray failed to import")
        if name == "tensorflow.lite.python.interpreter":
            raise ModuleNotFoundError("No module named 'absl'", name="absl")
        if name == "ai_edge_litert.interpreter":
            raise ModuleNotFoundError("No module named 'ai_edge_litert'", name="ai_edge_litert")
        return real(name, *args)
    monkeypatch.setattr(tflite.importlib, "import_module", broken)
    for choice, cause in (("tflite_runtime", "numpy.core.multiarray failed to import"),
                          ("tf", "No module named 'absl'")):
        with pytest.raises(ImportError) as err:
            tflite.interpreter_module(choice)
        assert str(err.value) == f"interpreter {choice!r} is installed but cannot be imported: {cause}"
    with pytest.raises(ImportError, match="^interpreter 'litert' needs pip's ai-edge-litert, which is not installed"):
        tflite.interpreter_module("litert")
