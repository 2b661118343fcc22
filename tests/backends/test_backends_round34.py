"""Round 34's checks of EmbeddingBag / ProductKeyMemory under TensorFlow, JAX and PyTorch
(round34_checks.py holds them), one process per backend for the module, run side by side. A
backend that is not installed is skipped."""

import pytest

from tests.backends.check_processes import results_by_backend

# Its three processes take ~50 s together: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow

CHECKS = {"tensorflow": ["listed_inputs"],
          "jax": ["listed_inputs", "unsigned_ids", "tf_composite_ids", "max_ties", "jax_export"],
          "torch": ["listed_inputs", "unsigned_ids", "tf_composite_ids", "max_ties", "torch_export"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each backend's check process (jax_export needs TensorFlow too), waited for once."""
    return results_by_backend(tmp_path_factory, CHECKS, "round34_checks", "jax_export")


def test_jax_export_of_the_composite_runs_under_tf(results):
    """model.export() under JAX of a composite PKM + max-bag model: the SavedModel runs under TF with
    the model's outputs (lax.top_k's CHLO composite failed in TF's XlaCallModule at the first call)."""
    assert results("jax")["jax_export"] == "ok"


@pytest.mark.parametrize("backend", sorted(CHECKS))
def test_ids_and_weights_in_a_list_are_a_clear_error(results, backend):
    """EmbeddingBag()([ids, weights]) (functional or eager) names layer(indices, weights); it failed
    deep in Keras with "Cannot convert '8' to a shape" and the like."""
    assert results(backend)["listed_inputs"] == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_uint32_ids_past_the_table_are_an_error(results, backend):
    """uint32 ids read the rows int32 ids read, and 4294967295 into a 10-row table is the out-of-range
    error (under JAX it wrapped to int32 -1, padding: no error, a wrong bag)."""
    assert results(backend)["unsigned_ids"] == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_ragged_or_sparse_tf_ids_name_the_padding(results, backend):
    """A tf.RaggedTensor / tf.SparseTensor of ids under JAX or PyTorch is a ValueError naming -1 padding
    (Keras' "should be passed as a keyword argument" pointed the wrong way); padded, each bag sums its rows."""
    assert results(backend)["tf_composite_ids"] == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_composite_max_gives_tied_gradients_to_the_first_row(results, backend):
    """The keras.ops composite's max gradient goes to the first row holding each maximum, as the fused
    kernel's and torch's mode="max" (float64 reference); it split it evenly over tied rows."""
    assert results(backend)["max_ties"] == "ok"


def test_torch_export_with_a_dynamic_batch(results):
    """torch.export of a model with a ProductKeyMemory and a composite max bag, batch marked dynamic:
    the program serves other batch sizes with the model's outputs (the batch was fixed to the example's)."""
    assert results("torch")["torch_export"] == "ok"
