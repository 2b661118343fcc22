"""Round 34's checks of EmbeddingBag / ProductKeyMemory under JAX and PyTorch (round34_checks.py holds
them), one process per backend for the module. A backend that is not installed is skipped."""

import pytest

from tests.backends.check_processes import finish, installed, start

JAX_CHECKS = ["jax_export"]


@pytest.fixture(scope="module")
def jax_results(tmp_path_factory):
    if not installed("jax") or not installed("tensorflow"):
        pytest.skip("needs jax and tensorflow")
    args = []
    for check in JAX_CHECKS:
        args += [check] + ([str(tmp_path_factory.mktemp("export") / "saved")] if check == "jax_export" else [])
    return finish(start("jax", args, module="round34_checks"), f"jax {JAX_CHECKS}")


def test_jax_export_of_the_composite_runs_under_tf(jax_results):
    """model.export() under JAX of a composite PKM + max-bag model: the SavedModel runs under TF with
    the model's outputs (lax.top_k's CHLO composite failed in TF's XlaCallModule at the first call)."""
    assert jax_results["jax_export"] == "ok", jax_results
