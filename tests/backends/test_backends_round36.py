"""Round 36's checks of EmbeddingBag / ProductKeyMemory under TensorFlow, JAX and PyTorch
(round36_checks.py holds them), one process per backend for the module, run side by side. A
backend that is not installed is skipped."""

import pytest

from tests.backends.check_processes import results_by_backend

# Its processes take ~50 s together on 2 busy cores (three backends imported, a torch.export).
pytestmark = pytest.mark.slow

BACKENDS = ["tensorflow", "jax", "torch"]
CHECKS = {"tensorflow": ["python_list_ids"], "jax": ["python_list_ids", "jax_sparse_ids", "jax_sparse_bad_entries"], "torch": ["python_list_ids", "torch_ragged_export"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each backend's check process, waited for once."""
    return results_by_backend(tmp_path_factory, CHECKS, "round36_checks", None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_python_list_ids_are_a_clear_error(results, backend):
    """EmbeddingBag on ids as nested Python lists ([[1, 2], [3, 4]], [], [[]], ragged): a ValueError naming
    np.asarray, as Keras' own Embedding refuses them (it said "pass as a keyword argument", or raised
    AttributeError for [] / [[]]); np.asarray of them gives the float64 reference."""
    assert results(backend)["python_list_ids"] == "ok"


def test_torch_export_of_ragged_bags_with_dynamic_sizes(results):
    """torch.export of values + row_splits bags, both sizes dynamic, the way README gives
    (backed_size_oblivious=True): 0, 1 and more bags match the float64 reference (torch alone guards
    B+1 != 2 on every [B, D] tensor and suggests Dim(min=3), so one bag failed; README now says so)."""
    assert results("torch")["torch_ragged_export"] == "ok"


def test_jax_sparse_ids_form_bags_of_the_entries_present(results):
    """keras.Input(sparse=True) ids and weights under JAX (BCOO): model(x), predict and jax.jit give the
    float64 reference of the entries present, an id 0 included (the layer failed on a BCOO); weights at
    other positions are a ValueError."""
    assert results("jax")["jax_sparse_ids"] == "ok"


def test_jax_sparse_ids_refuse_repeated_positions_and_other_weight_positions(results):
    """BCOO ids with two entries at one position, and BCOO weights at other positions: an error naming
    the position eagerly, under jax.jit and in model.predict (they gave another id's row, and weight 0,
    silently); well-formed batches still give the float64 reference."""
    assert results("jax")["jax_sparse_bad_entries"] == "ok"
