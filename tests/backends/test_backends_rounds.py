"""Rounds 34-36's checks of EmbeddingBag / ProductKeyMemory under JAX, PyTorch and TensorFlow
(round34_checks.py, round35_checks.py, round36_checks.py, review35_checks.py hold them). A Keras
backend is fixed per process, so all the JAX checks share one process, all the PyTorch checks another,
the JAX checks needing 2 CPU devices a third (with several devices the host range check is skipped,
which the others test), run side by side by run_checks.py; the TensorFlow checks run in this process
when its Keras backend is TensorFlow (else in a fourth). A backend that is not installed is skipped,
and so is a check needing TensorFlow beside it where TensorFlow is not."""

import pytest

from tests.backends.check_processes import checks_side_by_side, installed

# Its three processes take ~40 s of CPU together (the JAX exports most of it).
pytestmark = pytest.mark.slow

CHECKS = {
    "jax": ["round34.listed_inputs", "round34.unsigned_ids", "round34.tf_composite_ids", "round34.max_ties",
            "round34.jax_export", "round35.listed_ids", "round35.signed_zero_ties", "round35.unsigned_message",
            "round35.eager_jax2tf", "round35.fixed_batch_export", "round36.python_list_ids",
            "round36.jax_sparse_ids", "round36.jax_sparse_bad_entries", "review35.jit_then_jax2tf",
            "review35.vmapped_unsigned_ids", "review35.exported_sparse_bad_entries"],
    "jax_2_devices": ["review35.sharded_unsigned_ids", "review35.sharded_sparse_bad_entries"],
    "torch": ["round34.listed_inputs", "round34.unsigned_ids", "round34.tf_composite_ids", "round34.max_ties",
              "round34.torch_export", "round35.listed_ids", "round35.signed_zero_ties",
              "round35.unsigned_message", "round36.python_list_ids", "round36.torch_ragged_export"],
    "tensorflow": ["round34.listed_inputs", "round35.listed_ids", "round36.python_list_ids"],
}
BACKEND = {"jax": "jax", "jax_2_devices": "jax", "torch": "torch", "tensorflow": "tensorflow"}
ENV = {"jax_2_devices": {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}}
NEEDS_TF = {"round34.jax_export", "round34.tf_composite_ids", "round35.eager_jax2tf",
            "round35.fixed_batch_export", "review35.jit_then_jax2tf"}


def _in_this_process():
    """The TensorFlow checks' results, run here: this process's Keras backend is TensorFlow."""
    from tests.backends.run_checks import run

    return {name: run(name) for name in CHECKS["tensorflow"]}


@pytest.fixture(scope="module")
def results():
    """result(process, check) -> "ok" or the check's failure; the processes start at the first test."""
    import keras

    here = installed("tensorflow") and keras.backend.backend() == "tensorflow"
    plan = {process: (BACKEND[process], [c for c in checks if installed("tensorflow") or c not in NEEDS_TF],
                      ENV.get(process, {}))
            for process, checks in CHECKS.items()
            if installed(BACKEND[process]) and not (process == "tensorflow" and here)}
    result = checks_side_by_side(plan)
    local = {}

    def outcome(process, check):
        if process == "tensorflow" and here:
            local.update(local or _in_this_process())
            got = local[check]
        elif process not in plan:
            pytest.skip(f"{BACKEND[process]} is not installed")
        elif check not in plan[process][1]:
            pytest.skip(f"{check} needs TensorFlow beside {BACKEND[process]}")
        else:
            got = result(process)[check]
        if got != "ok":
            pytest.fail(f"{check} under {process}:\n{got}", pytrace=False)
        return got

    return outcome


def test_jax_export_of_the_composite_runs_under_tf(results):
    """model.export() under JAX of a composite PKM + max-bag model: the SavedModel runs under TF with
    the model's outputs (lax.top_k's CHLO composite failed in TF's XlaCallModule at the first call)."""
    assert results("jax", "round34.jax_export") == "ok"


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_ids_and_weights_in_a_list_are_a_clear_error(results, backend):
    """EmbeddingBag()([ids, weights]) (functional or eager) names layer(indices, weights); it failed
    deep in Keras with "Cannot convert '8' to a shape" and the like."""
    assert results(backend, "round34.listed_inputs") == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_uint32_ids_past_the_table_are_an_error(results, backend):
    """uint32 ids read the rows int32 ids read, and 4294967295 into a 10-row table is the out-of-range
    error (under JAX it wrapped to int32 -1, padding: no error, a wrong bag)."""
    assert results(backend, "round34.unsigned_ids") == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_ragged_or_sparse_tf_ids_name_the_padding(results, backend):
    """A tf.RaggedTensor / tf.SparseTensor of ids under JAX or PyTorch is a ValueError naming -1 padding
    (Keras' "should be passed as a keyword argument" pointed the wrong way); padded, each bag sums its rows."""
    assert results(backend, "round34.tf_composite_ids") == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_composite_max_gives_tied_gradients_to_the_first_row(results, backend):
    """The keras.ops composite's max gradient goes to the first row holding each maximum, as the fused
    kernel's and torch's mode="max" (float64 reference); it split it evenly over tied rows."""
    assert results(backend, "round34.max_ties") == "ok"


def test_torch_export_with_a_dynamic_batch(results):
    """torch.export of a model with a ProductKeyMemory and a composite max bag, batch marked dynamic:
    the program serves other batch sizes with the model's outputs (the batch was fixed to the example's)."""
    assert results("torch", "round34.torch_export") == "ok"


def test_jax_export_with_a_fixed_batch_runs_under_tf(results):
    """model.export() under JAX with a fixed-batch input_signature: the SavedModel runs under TF with the
    model's outputs (it exported lax.top_k, which TF 2.21's XlaCallModule could not deserialise)."""
    assert results("jax", "round35.fixed_batch_export") == "ok"


def test_jax2tf_called_eagerly_runs_under_tf(results):
    """jax2tf.convert(product_key_search) called outside a tf.function, then inside one: both run with
    JAX's slots (the eager call exported lax.top_k, and that trace stayed cached for the tf.function)."""
    assert results("jax", "round35.eager_jax2tf") == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_signed_zero_ties_pick_the_lowest_slots(results, backend):
    """Product-key scores tied at 0.0 / -0.0 pick the lowest slots eagerly, jitted and exported (JAX's
    eager top_k put 0.0 first, the exported sort did not), as the float64 reference."""
    assert results(backend, "round35.signed_zero_ties") == "ok"


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_a_list_of_id_tensors_says_what_the_layer_takes(results, backend):
    """EmbeddingBag()([ids, ids]) says the layer takes layer(indices) or layer(indices, weights) and to
    stack the ids (it told of weights the caller did not pass)."""
    assert results(backend, "round35.listed_ids") == "ok"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_unsigned_ids_past_the_table_name_the_callers_value(results, backend):
    """uint32 4294967295 (or 2147483648) into a 10-row table: the error names that id (under JAX it
    named 2147483647, the value the layer clipped it to); uint32 ids in range read int32's rows."""
    assert results(backend, "round35.unsigned_message") == "ok"


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_python_list_ids_are_a_clear_error(results, backend):
    """EmbeddingBag on ids as nested Python lists ([[1, 2], [3, 4]], [], [[]], ragged): a ValueError naming
    np.asarray, as Keras' own Embedding refuses them (it said "pass as a keyword argument", or raised
    AttributeError for [] / [[]]); np.asarray of them gives the float64 reference."""
    assert results(backend, "round36.python_list_ids") == "ok"


def test_torch_export_of_ragged_bags_with_dynamic_sizes(results):
    """torch.export of values + row_splits bags, both sizes dynamic, the way README gives
    (backed_size_oblivious=True): 0, 1 and more bags match the float64 reference (torch alone guards
    B+1 != 2 on every [B, D] tensor and suggests Dim(min=3), so one bag failed; README now says so)."""
    assert results("torch", "round36.torch_ragged_export") == "ok"


def test_jax_sparse_ids_form_bags_of_the_entries_present(results):
    """keras.Input(sparse=True) ids and weights under JAX (BCOO): model(x), predict and jax.jit give the
    float64 reference of the entries present, an id 0 included (the layer failed on a BCOO); weights at
    other positions are a ValueError."""
    assert results("jax", "round36.jax_sparse_ids") == "ok"


def test_jax_sparse_ids_refuse_repeated_positions_and_other_weight_positions(results):
    """BCOO ids with two entries at one position, and BCOO weights at other positions: an error naming
    the position eagerly, under jax.jit and in model.predict (they gave another id's row, and weight 0,
    silently); well-formed batches still give the float64 reference."""
    assert results("jax", "round36.jax_sparse_bad_entries") == "ok"


def test_jitted_search_called_then_exported_runs_under_tf(results):
    """jax.jit(product-key search) called once, then jax2tf into a SavedModel: TF runs it with JAX's slots
    (jax.jit's cached trace exported lax.top_k, which TF's XlaCallModule could not deserialise)."""
    assert results("jax", "review35.jit_then_jax2tf") == "ok"


def test_vmapped_unsigned_ids_take_one_host_check_per_call(results):
    """jax.vmap of an EmbeddingBag over uint32 ids: one host callback per call (it was one per mapped row),
    int32's rows, and an id past int32 still named."""
    assert results("jax", "review35.vmapped_unsigned_ids") == "ok"


def test_sharded_unsigned_ids_past_int32_are_an_error_not_an_abort(results):
    """jax.jit of an EmbeddingBag on uint32 ids sharded over 2 CPU devices: an id past int32 is an error
    (the range check's host callback ran on one device and XLA aborted the process 40 s later)."""
    assert results("jax_2_devices", "review35.sharded_unsigned_ids") == "ok"


def test_bad_sparse_ids_are_an_error_inside_an_export(results):
    """jax.export of an EmbeddingBag on BCOO ids: two ids at one position, or weights missing at an id's,
    fail the CPU kernel's range check (no host callback in an export: another row, or weight 0, was read
    silently); a well-formed batch gives the eager result."""
    assert results("jax", "review35.exported_sparse_bad_entries") == "ok"


def test_bad_sparse_ids_are_an_error_with_several_devices(results):
    """jax.jit of an EmbeddingBag on BCOO ids with 2 CPU devices: the same bad batches fail the range check
    (the host check is skipped with several devices; they were read silently)."""
    assert results("jax_2_devices", "review35.sharded_sparse_bad_entries") == "ok"
