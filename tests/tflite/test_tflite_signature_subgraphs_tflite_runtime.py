"""`pkm-serve tflite --interpreter tflite_runtime` on the two-signature model of
test_tflite_signature_subgraphs.py. tflite_runtime 2.14 applies XNNPack, its default delegate,
at the first allocate_tensors() to every subgraph, which prepares them all at the converter's
shapes: the second signature's bag kernel refuses those (ids [1, 1] against weights [1, 3]), so
the CLI exited 1 with "PkmEmbeddingBag: weights must have the shape of indices [1, 1], got
[1, 3]" for a model LiteRT's CLI lists and both runtimes' signature runners run (run_tflite
failed the same way). It now lists the plan LiteRT's CLI lists, and run_tflite runs the primary
signature; a node without a kernel still fails the CLI."""
import os
import subprocess

import numpy as np
import pytest

from pkm_serve import tflite, tflite_cli
from tests.tflite.test_tflite_signature_subgraphs import _reference, models  # noqa: F401  (the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME_PY = os.path.join(ROOT, ".venv-tflite-runtime", "bin", "python")


def _tflite_runtime_cli(model_path):
    if not os.path.exists(RUNTIME_PY):
        pytest.fail(f"{RUNTIME_PY} missing: `make test` builds .venv-tflite-runtime")
    return subprocess.run([RUNTIME_PY, "-m", "pkm_serve.tflite", model_path, "--interpreter", "tflite_runtime"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


def test_tflite_runtime_lists_the_plan_litert_lists(models, capsys):  # noqa: F811
    path = f"{models['good']}/model.tflite"
    assert tflite_cli.console_main([path, "--interpreter", "litert"]) == 0
    litert_plan = capsys.readouterr().out
    proc = _tflite_runtime_cli(path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == litert_plan, (proc.stdout, litert_plan)


def test_tflite_runtime_still_refuses_an_op_without_a_kernel(models):  # noqa: F811
    proc = _tflite_runtime_cli(f"{models['bogus']}/model.tflite")
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == ("pkm-serve tflite: error: signature 'zzz' (subgraph 1): "
                                                    "Encountered unresolved custom op: BogusOp."), proc.stderr


def test_tflite_runtime_runs_the_primary_signature_with_run_tflite(models):  # noqa: F811
    # run_tflite allocates as the CLI does: its first allocate_tensors() failed the same way.
    # With signature_key= (and a numpy thread count) it runs 'zzz' too (both were refused).
    ids, w = [[0, 39, -1], [5, 5, 7]], [[1.0, 0.5, 2.0], [0.25, 1.0, 3.0]]
    script = ("import numpy as np; from pkm_serve import tflite; "
              f"path = {models['good']!r} + '/model.tflite'; "
              "print(tflite.run_tflite(path, {'x': np.arange(8, dtype=np.float32).reshape(2, 4)}, "
              "interpreter='tflite_runtime')[0].tolist()); "
              f"print(tflite.run_tflite(path, [np.array({ids}), np.array({w}, np.float32)], "
              "interpreter='tflite_runtime', signature_key='zzz', num_threads=np.int64(2))[0].tolist())")
    proc = subprocess.run([RUNTIME_PY, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr
    want = (np.arange(8, dtype=np.float64).reshape(2, 4) * 2 + 1).tolist()   # 'aaa': x * 2 + 1
    primary, other = proc.stdout.strip().splitlines()[-2:]
    assert primary == str(want), proc.stdout
    np.testing.assert_allclose(eval(other), _reference(np.array(ids), np.array(w)), rtol=1e-5, atol=1e-6)
