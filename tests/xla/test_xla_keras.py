"""Keras with jit_compile=True and with "auto" on a (faked) GPU machine: both
layers train, dense and ragged inputs, float32 / mixed_float16 / mixed_bfloat16,
and the compiled step runs our custom calls (not the composite)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import _xla, ops  # noqa: E402
from pkm_serve.layers import EmbeddingBag, ProductKeyMemory  # noqa: E402

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
N, D, K, B = 64, 8, 4, 64
PKM = dict(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=4)


@pytest.fixture(autouse=True)
def _policy_and_spy(monkeypatch):
    """Resets the dtype policy; records each embedding_bag trace's XLA device
    and whether it took the composite."""
    ops.load_library()
    keras.config.set_dtype_policy("float32")
    traces = []
    real = _xla.composite_under_xla

    def spy(params, indices):
        used_composite = real(params, indices)
        traces.append((_xla.compile_device_type(), used_composite))
        return used_composite

    monkeypatch.setattr(_xla, "composite_under_xla", spy)
    yield traces
    keras.config.set_dtype_policy("float32")


def assert_ran_fused_under_xla(traces):
    assert ("CPU", False) in traces, f"no fused trace under XLA: {traces}"
    assert all(not composite for _, composite in traces), traces


def bag_data(rng, ragged):
    lengths = rng.integers(0, K + 1, size=B) if ragged else np.full(B, K)
    rows = [list(rng.integers(0, N, size=n)) for n in lengths]
    target = np.array([[np.sin(sum(r)) + 0.1 * len(r)] for r in rows], np.float32)
    x = tf.ragged.constant(rows, dtype=tf.int64) if ragged else np.array(rows, np.int32)
    return x, target


# Epochs (one step each) past the first compile cost little each, but add up: the counts below
# leave a wide margin on each loss bound (measured, last loss / first: EmbeddingBag 0.24-0.27 dense,
# 0.12-0.14 ragged after 10, bound 0.5; ProductKeyMemory 0.63-0.66 after 8, bound 0.9; "auto" 0.16-0.18
# after 8, bound 0.7), where a model that does not learn stays near 1.
BAG_EPOCHS, PKM_EPOCHS, AUTO_EPOCHS = 10, 8, 8


def fit_losses(model, x, y, epochs):
    model.compile(keras.optimizers.Adam(0.05), "mse", jit_compile=True)
    assert model.jit_compile is True
    return model.fit(x, y, epochs=epochs, batch_size=B, verbose=0).history["loss"]


@pytest.mark.parametrize("ragged", [False, True], ids=["dense", "ragged"])
@pytest.mark.parametrize("policy", POLICIES)
def test_embedding_bag_fits_with_jit_compile(policy, ragged, _policy_and_spy):
    keras.config.set_dtype_policy(policy)
    x, y = bag_data(np.random.default_rng(1), ragged)
    inputs = keras.Input((None,) if ragged else (K,), dtype="int64" if ragged else "int32", ragged=ragged)
    hidden = EmbeddingBag(N, D, combiner="mean")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    losses = fit_losses(keras.Model(inputs, outputs), x, y, epochs=BAG_EPOCHS)
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses
    assert_ran_fused_under_xla(_policy_and_spy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_product_key_memory_fits_with_jit_compile(policy, _policy_and_spy):
    keras.config.set_dtype_policy(policy)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, 16)).astype(np.float32)
    y = rng.standard_normal((B, PKM["v_dim"])).astype(np.float32)
    inputs = keras.Input((16,))
    outputs = keras.layers.Activation("linear", dtype="float32")(ProductKeyMemory(**PKM)(inputs))
    losses = fit_losses(keras.Model(inputs, outputs), x, y, epochs=PKM_EPOCHS)
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    assert_ran_fused_under_xla(_policy_and_spy)


def _fake_gpu_machine(monkeypatch, library_targets):
    """What Keras and our layers see on a GPU machine; the graph still runs on
    this CPU (compile_device_type asks TF's logical devices, which are real)."""
    real = tf.config.list_physical_devices
    fake_gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")

    def list_physical_devices(device_type=None):
        devices = real(device_type) if device_type in (None, "CPU") else []
        return devices + ([fake_gpu] if device_type in (None, "GPU") else [])

    monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)
    monkeypatch.setattr(_xla, "_xla_device_types", frozenset(library_targets))


def _auto_model():
    inputs = keras.Input((K,), dtype="int32")
    bag = EmbeddingBag(N, D, combiner="sum")(inputs)
    pkm = ProductKeyMemory(**PKM)(keras.layers.Dense(16)(bag))
    model = keras.Model(inputs, keras.layers.Dense(1)(pkm))
    model.compile(keras.optimizers.Adam(0.02), "mse")  # jit_compile="auto"
    return model


def test_auto_resolves_to_xla_on_a_gpu_machine_with_the_gpu_library(monkeypatch, _policy_and_spy):
    _fake_gpu_machine(monkeypatch, {"CPU", "GPU"})
    model = _auto_model()
    assert all(layer.supports_jit for layer in model._flatten_layers())
    assert model.jit_compile is True  # Keras' own _resolve_auto_jit_compile
    x, y = bag_data(np.random.default_rng(3), ragged=False)
    losses = model.fit(x, y, epochs=AUTO_EPOCHS, batch_size=B, verbose=0).history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert_ran_fused_under_xla(_policy_and_spy)


def test_auto_keeps_the_fused_op_outside_xla_when_the_library_lacks_the_gpu_target(monkeypatch,
                                                                                   _policy_and_spy):
    _fake_gpu_machine(monkeypatch, {"CPU"})
    model = _auto_model()
    assert not model.get_layer(index=1).supports_jit
    assert model.jit_compile is False  # "auto" sees a layer that XLA would slow down
    x, y = bag_data(np.random.default_rng(3), ragged=False)
    losses = model.fit(x, y, epochs=AUTO_EPOCHS, batch_size=B, verbose=0).history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert _policy_and_spy and all(device is None for device, _ in _policy_and_spy)


def test_composite_layer_always_supports_jit(monkeypatch):
    _fake_gpu_machine(monkeypatch, set())
    assert EmbeddingBag(N, D, implementation="composite").supports_jit
    assert not EmbeddingBag(N, D).supports_jit
