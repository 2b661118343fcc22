"""Round 35's review checks under JAX (review35_checks.py holds them), one process for the module.
Skipped where JAX or TensorFlow is not installed."""

import pytest

from tests.backends.check_processes import finish, installed, start

# Its process takes ~15 s (TensorFlow and JAX imported, a SavedModel written).
pytestmark = pytest.mark.slow

CHECKS = ["jit_then_jax2tf", "vmapped_unsigned_ids", "exported_sparse_bad_entries"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not (installed("jax") and installed("tensorflow")):
        pytest.skip("JAX or TensorFlow is not installed")
    args = []
    for check in CHECKS:
        args += [check] + ([str(tmp_path_factory.mktemp("export") / "saved")] if check == "jit_then_jax2tf" else [])
    return finish(start("jax", args, module="review35_checks"), f"jax {CHECKS}")


def test_jitted_search_called_then_exported_runs_under_tf(results):
    """jax.jit(product-key search) called once, then jax2tf into a SavedModel: TF runs it with JAX's slots
    (jax.jit's cached trace exported lax.top_k, which TF's XlaCallModule could not deserialise)."""
    assert results["jit_then_jax2tf"] == "ok"


def test_vmapped_unsigned_ids_take_one_host_check_per_call(results):
    """jax.vmap of an EmbeddingBag over uint32 ids: one host callback per call (it was one per mapped row),
    int32's rows, and an id past int32 still named."""
    assert results["vmapped_unsigned_ids"] == "ok"


@pytest.fixture(scope="module")
def sharded_results():
    """The checks run with 2 CPU devices, one process."""
    if not installed("jax"):
        pytest.skip("JAX is not installed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
        proc = start("jax", ["sharded_unsigned_ids", "sharded_sparse_bad_entries"], module="review35_checks")
    return finish(proc, "jax sharded checks", timeout=120)


def test_sharded_unsigned_ids_past_int32_are_an_error_not_an_abort(sharded_results):
    """jax.jit of an EmbeddingBag on uint32 ids sharded over 2 CPU devices: an id past int32 is an error
    (the range check's host callback ran on one device and XLA aborted the process 40 s later)."""
    assert sharded_results["sharded_unsigned_ids"] == "ok"


def test_bad_sparse_ids_are_an_error_inside_an_export(results):
    """jax.export of an EmbeddingBag on BCOO ids: two ids at one position, or weights missing at an id's,
    fail the CPU kernel's range check (no host callback in an export: another row, or weight 0, was read
    silently); a well-formed batch gives the eager result."""
    assert results["exported_sparse_bad_entries"] == "ok"


def test_bad_sparse_ids_are_an_error_with_several_devices(sharded_results):
    """jax.jit of an EmbeddingBag on BCOO ids with 2 CPU devices: the same bad batches fail the range check
    (the host check is skipped with several devices; they were read silently)."""
    assert sharded_results["sharded_sparse_bad_entries"] == "ok"
