"""The layers and ops on the JAX and PyTorch Keras backends, each in its own
process (a Keras backend is fixed per process; the two run side by side):
numbers vs the float64 reference, errors, jit/vmap and torch.compile, fit,
memory, no TensorFlow import, .keras files moving between backends (TF
included) and mixed_bfloat16 under jax.jit vs TF. The checks themselves are in
backend_checks.py; jax and torch come from requirements-backends.lock. A
backend that is not installed is skipped.
"""

import os

import numpy as np
import pytest

from tests.backends.check_processes import finish, installed, start

BACKENDS = ["jax", "torch"]
# `memory` first (it measures peak-RSS growth); `no_tf` before `save` (Keras' saving may import TF).
CHECKS = {"jax": ["memory", "no_tf", "ops", "errors", "transforms", "fit", "mask"],
          "torch": ["memory", "memory_composite", "no_tf", "ops", "errors", "transforms", "fit", "mask"]}


# Bad input each backend refuses as the kernels do (backend_checks.py says how):
REFUSAL_CHECKS = {
    # The keras.ops composite raises the fused kernel's ValueError for row_splits that do not
    # start at 0, decrease or do not end at the number of values (it read them unchecked);
    # traced row_splits (jax.jit, torch.compile) drop values outside them, as its docstring says.
    "ragged_splits": "composite row_splits",
    # The composite raises the fused kernel's ValueError for an index >= N on host ids (JAX gave
    # a NaN row, PyTorch a bare IndexError); negative ids stay padding.
    "composite_ids": "composite ids past the table",
    # A [N, 0] table with an index >= N (and ragged row_splits [0] beside values) fails with the
    # kernel's message eagerly, under jax.jit and in the gradient, as on TF (JAX gave no error:
    # XLA dropped the zero-sized custom call; PyTorch said "out is null", for valid ids too).
    "zero_sized": "zero-sized results",
}


def _keras_backend_here():
    """This process's Keras backend (None without Keras)."""
    if not installed("keras"):
        return None
    import keras

    return keras.backend.backend()


_LOADED_UNDER_TF = set()


def _jax_file_under_tf(tmp):
    """The .keras files saved under JAX loaded under TF once (outputs in jax_in_tensorflow.npy*): in this
    process when its Keras runs TF (no third process to import TF, Keras and pkm_serve), else in one."""
    if tmp in _LOADED_UNDER_TF:
        return
    args = [str(tmp / "jax.keras"), str(tmp / "jax_in_tensorflow.npy")]
    if _keras_backend_here() == "tensorflow" and os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        from tests.backends.backend_checks import check_load

        check_load(*args)
    else:
        finish(start("tensorflow", ["load", *args]), "loading the jax file under tensorflow")
    _LOADED_UNDER_TF.add(tmp)


def _tf_training_file(tmp):
    """A .keras file saved under TF with sparse_gradient=True / fused_optimizer=True layers, compiled
    with LazyAdam, and its outputs under TF (None without TensorFlow)."""
    if not installed("tensorflow"):
        return None
    from pkm_serve.optimizers import LazyAdam
    from tests.backends.backend_checks import _inputs, tf_training_model

    model = tf_training_model()
    model.compile(LazyAdam(0.01), "mse")
    model.save(tmp / "tf.keras")
    return model(_inputs()).numpy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One check process per backend, the two side by side (a process per check would import the
    backend, Keras and pkm_serve again each time): every check of this module, then a .keras save."""
    tmp = tmp_path_factory.mktemp("backends")
    tf_outputs = _tf_training_file(tmp)
    procs = {}
    for backend in BACKENDS:
        if installed(backend):
            tf_load = [] if tf_outputs is None else ["load_tf_training", str(tmp / "tf.keras"),
                                                     str(tmp / f"tf_in_{backend}.npy")]
            save = ["save", str(tmp / f"{backend}.keras"), str(tmp / f"{backend}_out.npy")]
            procs[backend] = start(backend, CHECKS[backend] + sorted(REFUSAL_CHECKS) + ["ties"] + tf_load + save)
    done = {}

    def result(backend):  # each process is waited for once, by whichever test needs it first
        if backend not in done:
            done[backend] = finish(procs[backend], f"{backend} checks", timeout=900)
        return done[backend]

    return tmp, {b: (lambda b=b: result(b)) for b in procs}, tf_outputs


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_layers_fit_and_memory(runs, backend):
    """Forward/d_table/d_weights vs float64 (fp32/fp16/bf16, 3 combiners, int32/int64,
    3-D indices with padding, ragged), clear errors, jit+vmap / opcheck + torch.compile,
    no TF import, fit learns, ProductKeyMemory keeps Keras masks, fwd+bwd at B=4096 K=128 D=512
    grows the process < 600 MB."""
    tmp, results, _ = runs
    if backend not in results:
        pytest.skip(f"{backend} is not installed (requirements-backends.lock)")
    got = results[backend]()
    assert got["ops_cases"] == 27 and got["no_tf"] == "ok" and got["transforms"] == "ok", got
    assert got["mask"] == "ok", got
    assert got["memory_growth_mb"] < 600, got


def test_keras_file_moves_between_backends(runs):
    """A .keras file saved under JAX loads under PyTorch and TensorFlow, one saved
    under PyTorch under JAX, each with the saving backend's outputs."""
    tmp, results, _ = runs
    if set(results) != set(BACKENDS):
        pytest.skip("needs both jax and torch")
    for backend in BACKENDS:
        results[backend]()
    loads = [("jax", "torch"), ("torch", "jax")] + ([("jax", "tensorflow")] if installed("tensorflow") else [])
    procs = [(src, dst, start(dst, ["load", str(tmp / f"{src}.keras"), str(tmp / f"{src}_in_{dst}.npy")]))
             for src, dst in loads if dst != "tensorflow"]
    if ("jax", "tensorflow") in loads:
        _jax_file_under_tf(tmp)
        procs.append(("jax", "tensorflow", None))
    for src, dst, proc in procs:
        if proc is not None:
            finish(proc, f"loading the {src} file under {dst}")
        np.testing.assert_allclose(np.load(tmp / f"{src}_in_{dst}.npy"), np.load(tmp / f"{src}_out.npy"),
                                   rtol=1e-5, atol=1e-5, err_msg=f"saved under {src}, loaded under {dst}")
        # mixed_bfloat16: the same slots everywhere, so outputs differ by bfloat16 rounding only
        # (a slot chosen differently moves an output by ~0.1 of its scale).
        mixed, want = np.load(tmp / f"{src}_in_{dst}.npy.mixed.npy"), np.load(tmp / f"{src}_out.npy.mixed.npy")
        np.testing.assert_allclose(mixed, want, rtol=0, atol=1e-2 * np.max(np.abs(want)),
                                   err_msg=f"mixed_bfloat16, saved under {src}, loaded under {dst}")


@pytest.mark.parametrize("check", sorted(REFUSAL_CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_as_the_kernels_refuse_it(runs, backend, check):
    _, results, _ = runs
    if backend not in results:
        pytest.skip(f"{backend} is not installed (requirements-backends.lock)")
    assert results[backend]().get(check) == "ok", results[backend]()


def test_tied_scores_pick_the_same_slots_on_every_backend(runs):
    """Exactly tied key scores: TF (eager and XLA), JAX and PyTorch pick the lowest slots, as the
    float64 reference does (top_k(sorted=False) kept other tied slots on each)."""
    import tensorflow as tf

    from pkm_serve.product_keys import product_key_search
    from tests.backends.backend_checks import tie_inputs

    _, results, _ = runs
    query, keys, knn = tie_inputs()
    heads, n_keys = keys.shape[0], keys.shape[2]
    want = []
    for row in np.asarray(query, np.float64):
        for h in range(heads):
            s1, s2 = keys[h, 0] @ row[h, 0], keys[h, 1] @ row[h, 1]
            top1, top2 = np.argsort(-s1, kind="stable")[:knn], np.argsort(-s2, kind="stable")[:knn]
            pairs = sorted((-(s1[i] + s2[j]), i * n_keys + j) for i in top1 for j in top2)[:knn]
            want.append(sorted(slot for _, slot in pairs))
    got = {"tensorflow": product_key_search(tf.constant(query), tf.constant(keys), knn)[0].numpy(),
           "xla": tf.function(lambda q, k: product_key_search(q, k, knn), jit_compile=True)(query, keys)[0].numpy()}
    for backend, result in results.items():
        got[backend] = np.asarray(result()["tie_slots"])
    for name, slots in got.items():
        assert np.sort(slots.reshape(-1, knn), axis=-1).tolist() == want, f"{name}: {slots.tolist()}"


def test_tf_keras_file_with_tf_training_options_loads(runs):
    """A .keras file saved under TF with sparse_gradient=True / fused_optimizer=True layers, compiled
    with LazyAdam: under JAX and PyTorch it loads with compile=False (outputs as under TF) and trains
    with a Keras optimizer; compiled, the error names compile=False (was "Could not locate class")."""
    tmp, results, want = runs
    if want is None:
        pytest.skip("needs TensorFlow to write the file")
    for backend, result in results.items():
        assert result()["load_tf_training"] == "ok"
        np.testing.assert_allclose(np.load(tmp / f"tf_in_{backend}.npy"), want, rtol=1e-5, atol=1e-5)


def test_mixed_bfloat16_pkm_under_jax_jit_matches_tf(runs):
    """ProductKeyMemory under mixed_bfloat16 in jax.jit against the TF backend (the reference), the
    model saved under JAX loaded under TF: XLA kept float32 between the query projection's bfloat16
    ops under jit, so the query rounded otherwise than eager JAX and TF, and 14 of 256 rows read other
    slots (outputs 29% apart)."""
    tmp, results, _ = runs
    if "jax" not in results or not installed("tensorflow"):
        pytest.skip("needs jax and TensorFlow")
    results["jax"]()
    _jax_file_under_tf(tmp)
    got, want = np.load(tmp / "jax_out.npy.mixed_jit.npy"), np.load(tmp / "jax_in_tensorflow.npy.mixed.npy")
    # The same slots: outputs differ by bfloat16 rounding only (as the .keras round trip above).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.max(np.abs(want)))
