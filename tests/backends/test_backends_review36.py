"""Review of round 36's BCOO ids under JAX (review36_checks.py holds the check), in a JAX process of its
own; skipped where JAX is not installed."""

import pytest

from tests.backends.check_processes import results_by_backend

CHECKS = {"jax": ["jax_sparse_bad_entries"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The JAX check process, waited for once."""
    return results_by_backend(tmp_path_factory, CHECKS, "review36_checks", None)


def test_jax_sparse_ids_refuse_repeated_positions_and_other_weight_positions(results):
    """BCOO ids with two entries at one position, and BCOO weights at other positions: an error naming
    the position eagerly, under jax.jit and in model.predict (they gave another id's row, and weight 0,
    silently); well-formed batches still give the float64 reference."""
    assert results("jax")["jax_sparse_bad_entries"] == "ok"
