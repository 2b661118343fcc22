"""Every `.keras` file the project writes reloads in a fresh process that imports only
``pkm_serve`` and keras, and computes what the saved model did:

* models compiled with ``pkm_serve.optimizers.LazyAdam`` / ``RowwiseAdagrad`` (the optimizer,
  its state, and the next training step);
* a ``ProductKeyMemory`` saved under ``mixed_bfloat16`` and loaded under the default float32
  policy (and the reverse): the layer and every sub-layer keep the saved policy.
"""
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import pkm_serve  # noqa: F401  (registers the layers and optimizers)
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, D, K, B = 64, 8, 5, 16


def _run(script, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _batch():
    rng = np.random.default_rng(3)
    return (rng.integers(0, N, (B, K)).astype(np.int64),
            rng.standard_normal((B, 4)).astype(np.float32))


def _optimizer_model(optimizer):
    """Stock layers only, so the optimizer is the one pkm_serve class in the file; the
    Embedding's gradient is a tf.IndexedSlices, which takes the optimizers' sparse path."""
    keras.utils.set_random_seed(4)
    bags = keras.Input((K,), dtype="int64")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(N, D)(bags))
    model = keras.Model(bags, keras.layers.Dense(4)(hidden))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model


# The PKM models: written in their own process, since the policy is global state.
SAVE_PKM = """
    import sys, numpy as np
    import pkm_serve, keras
    d = sys.argv[1]
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    for policy in ("mixed_bfloat16", "float32"):
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(0)
        inp = keras.Input((16,))
        out = pkm_serve.layers.ProductKeyMemory(v_dim=8, k_dim=8, n_keys=6, heads=2, knn=3,
                                                name="pkm")(inp)
        model = keras.Model(inp, out)
        model.compile("adam", "mse", jit_compile=False)
        model.fit(x, np.zeros((32, 8)), epochs=1, verbose=0)  # moves the batch-norm statistics
        np.save(f"{d}/pkm_{policy}_out.npy",
                keras.ops.convert_to_numpy(model(x, training=False)).astype(np.float32))
        model.save(f"{d}/pkm_{policy}.keras")
    np.save(f"{d}/pkm_x.npy", x)
    print("{}")
"""

LOAD = """
    import json, sys, numpy as np
    d, policy, models = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    import keras
    keras.mixed_precision.set_global_policy(policy)
    result = {"loader_policy": keras.config.dtype_policy().name, "error_without_pkm_serve": {}}
    for name in models:  # the control: without pkm_serve, Keras cannot find our classes
        try:
            keras.models.load_model(f"{d}/{name}.keras")
        except Exception as e:
            result["error_without_pkm_serve"][name] = str(e)
    import pkm_serve
    batch = np.load(f"{d}/batch.npz")
    for name in models:
        model = keras.models.load_model(f"{d}/{name}.keras")
        if name.startswith("pkm"):
            out = model(np.load(f"{d}/pkm_x.npy"), training=False)
            np.save(f"{d}/{name}_reloaded.npy", keras.ops.convert_to_numpy(out).astype(np.float32))
            result[name] = {l.name: l.dtype_policy.name
                            for l in model.get_layer("pkm")._flatten_layers()}
            continue
        opt = model.optimizer
        np.savez(f"{d}/{name}_state.npz", *[keras.ops.convert_to_numpy(v) for v in opt.variables])
        model.train_on_batch(batch["bags"], batch["target"])
        np.savez(f"{d}/{name}_next.npz", *[keras.ops.convert_to_numpy(w) for w in model.weights])
        result[name] = {"class": type(opt).__module__ + "." + type(opt).__name__,
                        "config": opt.get_config()}
    print(json.dumps(result, default=str))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("keras_reload")
    bags, target = _batch()
    np.savez(d / "batch.npz", bags=bags, target=target)
    expected = {}
    for name, optimizer in (("lazy_adam", LazyAdam(0.05)),
                            ("rowwise_adagrad", RowwiseAdagrad(0.2, initial_accumulator_value=0.05))):
        model = _optimizer_model(optimizer)
        for _ in range(2):
            model.train_on_batch(bags, target)
        model.save(d / f"{name}.keras")
        state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
        config = json.loads(json.dumps(model.optimizer.get_config(), default=str))
        model.train_on_batch(bags, target)
        expected[name] = {"state": state, "config": config,
                          "next": [keras.ops.convert_to_numpy(w) for w in model.weights]}
    _run(SAVE_PKM, d)
    return d, expected


def _load(d, loader_policy, *names):
    return _run(LOAD, d, loader_policy, ",".join(names))


@pytest.fixture(scope="module")
def float32_loader(saved):
    """One fresh float32 process reloads the optimizer models and the mixed_bfloat16 PKM."""
    return _load(saved[0], "float32", "lazy_adam", "rowwise_adagrad", "pkm_mixed_bfloat16")


def test_optimizer_compiled_models_reload_with_only_import_pkm_serve(saved, float32_loader):
    d, expected = saved
    result = float32_loader
    assert "Could not locate class 'LazyAdam'" in result["error_without_pkm_serve"]["lazy_adam"], result
    for name, cls in (("lazy_adam", LazyAdam), ("rowwise_adagrad", RowwiseAdagrad)):
        assert result[name]["class"] == f"pkm_serve.optimizers.{cls.__name__}"
        assert result[name]["config"] == expected[name]["config"]
        state = list(np.load(d / f"{name}_state.npz").values())
        assert len(state) == len(expected[name]["state"]) > 2  # iterations, lr, moments
        for got, want in zip(state, expected[name]["state"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=0)
        # The restored moments / accumulators drive the next step as the saved ones did.
        for got, want in zip(np.load(d / f"{name}_next.npz").values(), expected[name]["next"]):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("saved_policy, loader_policy",
                         [("mixed_bfloat16", "float32"), ("float32", "mixed_bfloat16")])
def test_product_key_memory_reloads_its_policy_whatever_the_loaders(saved, saved_policy,
                                                                    loader_policy, request):
    d, _ = saved
    name = f"pkm_{saved_policy}"
    result = request.getfixturevalue("float32_loader") if loader_policy == "float32" \
        else _load(d, loader_policy, name)
    assert result["loader_policy"] == loader_policy
    assert "Could not locate class 'ProductKeyMemory'" in result["error_without_pkm_serve"][name]
    assert set(result[name]) >= {"pkm", "query_proj", "query_bn", "values"}, result[name]
    assert set(result[name].values()) == {saved_policy}, result[name]
    want = np.load(d / f"{name}_out.npy")
    got = np.load(d / f"{name}_reloaded.npy")
    assert np.abs(want).max() > 0.05  # a real output, not zeros
    assert np.abs(got - want).max() <= 1e-6, np.abs(got - want).max()
