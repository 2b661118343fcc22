"""Round 35's checks of EmbeddingBag / ProductKeyMemory under JAX, PyTorch and TensorFlow
(round35_checks.py holds them), one process per backend for the module, run side by side. A
backend that is not installed is skipped."""

import pytest

from tests.backends.check_processes import results_by_backend

# Its processes take ~30 s together (the JAX export most of it).
pytestmark = pytest.mark.slow

CHECKS = {"jax": ["listed_ids", "signed_zero_ties", "unsigned_message", "eager_jax2tf", "fixed_batch_export"],
          "torch": ["listed_ids", "signed_zero_ties", "unsigned_message"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each backend's check process (fixed_batch_export needs TensorFlow too), waited for once."""
    return results_by_backend(tmp_path_factory, CHECKS, "round35_checks", "fixed_batch_export")


def test_jax_export_with_a_fixed_batch_runs_under_tf(results):
    """model.export() under JAX with a fixed-batch input_signature: the SavedModel runs under TF with the
    model's outputs (it exported lax.top_k, which TF 2.21's XlaCallModule could not deserialise)."""
    assert results("jax")["fixed_batch_export"] == "ok"


def test_jax2tf_called_eagerly_runs_under_tf(results):
    """jax2tf.convert(product_key_search) called outside a tf.function, then inside one: both run with
    JAX's slots (the eager call exported lax.top_k, and that trace stayed cached for the tf.function)."""
    assert results("jax")["eager_jax2tf"] == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_signed_zero_ties_pick_the_lowest_slots(results, backend):
    """Product-key scores tied at 0.0 / -0.0 pick the lowest slots eagerly, jitted and exported (JAX's
    eager top_k put 0.0 first, the exported sort did not), as the float64 reference."""
    assert results(backend)["signed_zero_ties"] == "ok"


@pytest.mark.parametrize("backend", ["tensorflow", *sorted(CHECKS)])
def test_a_list_of_id_tensors_says_what_the_layer_takes(results, backend):
    """EmbeddingBag()([ids, ids]) says the layer takes layer(indices) or layer(indices, weights) and to
    stack the ids (it told of weights the caller did not pass). TensorFlow's in this process."""
    if backend == "tensorflow":
        import keras

        from tests.backends.round35_checks import check_listed_ids

        if keras.backend.backend() != "tensorflow":
            pytest.skip("this process's Keras backend is not TensorFlow")
        check_listed_ids()
        return
    assert results(backend)["listed_ids"] == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_unsigned_ids_past_the_table_name_the_callers_value(results, backend):
    """uint32 4294967295 (or 2147483648) into a 10-row table: the error names that id (under JAX it
    named 2147483647, the value the layer clipped it to); uint32 ids in range read int32's rows."""
    assert results(backend)["unsigned_message"] == "ok"
