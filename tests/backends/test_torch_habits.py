"""The layers and the op used the way a PyTorch user would (torch_habit_checks.py holds the checks),
in one process with KERAS_BACKEND=torch. Skipped where torch is not installed."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.backends.check_processes import ROOT, finish, installed, start

# Its processes take ~25 s (importing torch and Keras, opcheck, a torch.compile, torch.export).
pytestmark = pytest.mark.slow

CHECKS = ["first_call_compiled", "double_backward", "uint64_ids", "exported_program", "func_transforms",
          "keras_variable_table"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_export")


@pytest.fixture(scope="module")
def results(exported):
    if not installed("torch"):
        pytest.skip("torch is not installed")
    args = [a for check in CHECKS for a in ([check, str(exported)] if check == "exported_program" else [check])]
    return finish(start("torch", args, module="torch_habit_checks"), f"torch {CHECKS}")


def test_double_backward_matches_float64_loops(results):
    """A gradient penalty (create_graph=True) through the op, ragged bags and the layer: second
    derivatives as float64 loops' (it failed: no autograd formula for the gradient op)."""
    assert results["double_backward"] == "ok"


def test_a_first_lookup_inside_torch_compile_fullgraph(results):
    """The process's first call of pkm_serve.backends.embedding_bag inside torch.compile(fullgraph=True)
    matches torch ops, gradient too (it failed: the library's loader took a lock dynamo cannot trace)."""
    assert results["first_call_compiled"] == "ok"


def test_uint64_ids_past_int64_fail_naming_them(results):
    """uint64 ids >= 2**63 into a 10-row table fail naming the id (they wrapped negative and were read as
    padding, silently); in-range uint64 ids read int64's rows."""
    assert results["uint64_ids"] == "ok"


def test_torch_func_and_forward_mode_ad_match_float64(results):
    """torch.func.grad, vmap(grad), jacfwd, a compiled jvp, forward_ad, hessian and functionalize through
    pkm_serve.backends.embedding_bag give float64 numpy's derivatives (torch.func.grad failed: "must
    override the setup_context staticmethod"; forward-mode AD gave zero tangents, silently, eagerly and
    under torch.compile, which now runs a jvp through the op eagerly; functionalize must keep the op:
    it has no rule for the autograd.Function the others need)."""
    assert results["func_transforms"] == "ok"


def test_a_keras_variable_table_is_read_with_its_gradient(results):
    """pkm_serve.backends.embedding_bag(layer.embeddings, ids, keras.Variable weights) under PyTorch
    gives float64 numpy's bags and the gradient in the variable (it raised "object of type 'Variable'
    has no len()"); a nested-list table works too (it raised "'list' object has no attribute 'device'")."""
    assert results["keras_variable_table"] == "ok"


# A serving process: torch and pkm_serve only (no Keras), the program read back and run on a new batch.
_LOAD_AND_RUN = """
import sys, numpy as np, torch, pkm_serve
program = torch.export.load(sys.argv[1] + "/bag.pt2")
ids = torch.tensor([[3, -1, 7], [0, 0, 0], [-1, -1, -1], [12, 4, 4]])
weights = torch.tensor([[1.0, 2.0, 0.5], [0.25, 0.5, 1.0], [1.0, 1.0, 1.0], [2.0, 1.0, 3.0]])
np.save(sys.argv[1] + "/out.npy", program.module()(ids, weights).detach().numpy())
np.save(sys.argv[1] + "/ids.npy", ids.numpy()); np.save(sys.argv[1] + "/weights.npy", weights.numpy())
"""


def test_an_exported_program_loads_after_import_pkm_serve(results, exported):
    """torch.export.load of a saved program holding the layer, in a process that imports torch and
    pkm_serve only, runs a new batch as float64 mean bags (it failed: "We failed to resolve
    torch.ops.pkm_serve.embedding_bag.default to an operator": import pkm_serve registered no torch op)."""
    assert results["exported_program"] == "ok"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("KERAS_BACKEND", None)
    run = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(exported)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    table = np.load(exported / "table.npy").astype(np.float64)
    ids, weights = np.load(exported / "ids.npy"), np.load(exported / "weights.npy").astype(np.float64)
    want = np.zeros((len(ids), table.shape[1]))
    for b, (bag, w) in enumerate(zip(ids, weights)):
        kept = bag >= 0
        if kept.any():
            want[b] = (table[bag[kept]] * w[kept, None]).sum(0) / w[kept].sum()
    np.testing.assert_allclose(np.load(exported / "out.npy"), want, rtol=1e-5, atol=1e-6)
