"""The layers and the op used the way a PyTorch user would (torch_habit_checks.py holds the checks),
in one process with KERAS_BACKEND=torch. Skipped where torch is not installed."""

import pytest

from tests.backends.check_processes import finish, installed, start

# Its process takes ~16 s (importing torch and Keras, opcheck, a torch.compile).
pytestmark = pytest.mark.slow

CHECKS = ["double_backward", "uint64_ids"]


@pytest.fixture(scope="module")
def results():
    if not installed("torch"):
        pytest.skip("torch is not installed")
    return finish(start("torch", CHECKS, module="torch_habit_checks"), f"torch {CHECKS}")


def test_double_backward_matches_float64_loops(results):
    """A gradient penalty (create_graph=True) through the op, ragged bags and the layer: second
    derivatives as float64 loops' (it failed: no autograd formula for the gradient op)."""
    assert results["double_backward"] == "ok"


def test_uint64_ids_past_int64_fail_naming_them(results):
    """uint64 ids >= 2**63 into a 10-row table fail naming the id (they wrapped negative and were read as
    padding, silently); in-range uint64 ids read int64's rows."""
    assert results["uint64_ids"] == "ok"
