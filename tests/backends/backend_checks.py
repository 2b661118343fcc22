"""Checks that run inside one process with KERAS_BACKEND set (jax or torch).

    KERAS_BACKEND=jax python -m tests.backends.backend_checks ops fit no_tf
    KERAS_BACKEND=torch python -m tests.backends.backend_checks memory
    ... save PATH.keras OUT.npy | load PATH.keras OUT.npy

Each check raises AssertionError with a message on failure; the process exits
non-zero. test_backends.py runs them in subprocesses (a backend is fixed per
process). PKM_TEST_DEVICE=cuda runs the op checks on the GPU (the H200 run).
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.reference import bag_forward_backward  # noqa: E402

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")  # Keras' default
DEVICE = os.environ.get("PKM_TEST_DEVICE", "cpu")
TOL = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
N, D = 300, 24


def assert_close(actual, expected, dtype_name, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    err = np.max(np.abs(actual - expected) / (1.0 + np.abs(expected))) if actual.size else 0.0
    assert err <= TOL[dtype_name], f"{what}: max relative error {err:.3g} > {TOL[dtype_name]}"


class Jax:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        from pkm_serve.backends import jax_ops

        self.jax, self.jnp, self.ops = jax, jnp, jax_ops
        assert jax_ops.kernel_device() == DEVICE, f"JAX kernels on {jax_ops.kernel_device()}, want {DEVICE}"

    def tensor(self, x, dtype):
        return self.jnp.asarray(np.asarray(x, np.float32) if "float" in dtype else x, dtype)

    def numpy(self, x):
        return np.asarray(x.astype(self.jnp.float32) if self.jnp.issubdtype(x.dtype, self.jnp.floating) else x)

    def fwd_bwd(self, table, indices, weights, combiner, grad, row_splits=None):
        f = lambda t, w: self.ops.embedding_bag(t, indices, w, combiner, row_splits)  # noqa: E731
        out, vjp = self.jax.vjp(self.jax.jit(f), table, weights)
        d_table, d_w = vjp(grad)
        return out, d_table, d_w


class Torch:
    def __init__(self):
        import torch

        from pkm_serve.backends import torch_ops

        self.torch, self.ops = torch, torch_ops
        assert torch_ops.kernel_device(DEVICE) == DEVICE, f"no torch kernels on {DEVICE}"

    def tensor(self, x, dtype):
        return self.torch.as_tensor(np.asarray(x, np.float32) if "float" in dtype else np.asarray(x),
                                    device=DEVICE).to(getattr(self.torch, dtype))

    def numpy(self, x):
        x = x.detach()
        return (x.float() if x.is_floating_point() else x).cpu().numpy()

    def fwd_bwd(self, table, indices, weights, combiner, grad, row_splits=None):
        table = table.clone().requires_grad_(True)
        weights = None if weights is None else weights.clone().requires_grad_(True)
        out = self.ops.embedding_bag(table, indices, weights, combiner, row_splits)
        out.backward(grad)
        return out, table.grad, None if weights is None else weights.grad


def runtime():
    return Jax() if BACKEND == "jax" else Torch()


def check_ops():
    """Forward, d_table, d_weights vs the float64 reference: dtypes, combiners,
    int32/int64, 3-D indices with padding, ragged bags."""
    rt = runtime()
    rng = np.random.default_rng(7)
    cases = 0
    for dtype in ("float32", "float16", "bfloat16"):
        for combiner in ("sum", "mean", "sqrtn", "max"):
            for weighted in ((False,) if combiner == "max" else (True, False)):
                idx = rng.integers(0, N, size=(3, 9, 7))
                idx[rng.random(idx.shape) < 0.2] = -1
                idx[1, 2] = -1  # an empty bag
                table = rng.normal(size=(N, D))
                w = rng.uniform(0.1, 2.0, size=idx.shape) if weighted else None
                grad = rng.normal(size=(3, 9, D))
                itype = "int32" if weighted else ("int64" if BACKEND == "torch" else "int32")
                got = rt.fwd_bwd(rt.tensor(table, dtype), rt.tensor(idx, itype),
                                 None if w is None else rt.tensor(w, dtype), combiner, rt.tensor(grad, dtype))
                # The reference sees the values the backend saw (rounded to dtype).
                t64, g64 = rt.numpy(rt.tensor(table, dtype)), rt.numpy(rt.tensor(grad, dtype))
                w64 = None if w is None else rt.numpy(rt.tensor(w, dtype)).reshape(-1, 7).tolist()
                ref = bag_forward_backward(t64, idx.reshape(-1, 7).tolist(), w64, combiner, g64.reshape(-1, D))
                what = f"{dtype} {combiner} weighted={weighted}"
                assert_close(rt.numpy(got[0]).reshape(-1, D), ref[0], dtype, f"{what}: output")
                assert_close(rt.numpy(got[1]), ref[1], dtype, f"{what}: d_table")
                if weighted:
                    assert_close(rt.numpy(got[2]).reshape(-1, 7), np.asarray(ref[2]), dtype, f"{what}: d_weights")
                cases += 1
    lengths = rng.integers(0, 10, size=40)
    lengths[3] = 0
    bags = [list(rng.integers(-1, N, size=n)) for n in lengths]
    splits = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate(bags)
    w = rng.uniform(0.1, 2.0, size=values.shape)
    table, grad = rng.normal(size=(N, D)), rng.normal(size=(len(bags), D))
    for combiner in ("sum", "mean", "sqrtn"):
        got = rt.fwd_bwd(rt.tensor(table, "float32"), rt.tensor(values, "int32"), rt.tensor(w, "float32"),
                         combiner, rt.tensor(grad, "float32"), row_splits=rt.tensor(splits, "int32"))
        w_rows = [list(w[splits[i]:splits[i + 1]]) for i in range(len(bags))]
        ref = bag_forward_backward(table, bags, w_rows, combiner, grad)
        assert_close(rt.numpy(got[0]), ref[0], "float32", f"ragged {combiner}: output")
        assert_close(rt.numpy(got[1]), ref[1], "float32", f"ragged {combiner}: d_table")
        assert_close(rt.numpy(got[2]), np.concatenate(ref[2]), "float32", f"ragged {combiner}: d_weights")
        cases += 1
    got = rt.fwd_bwd(rt.tensor(table, "float32"), rt.tensor(values, "int32"), None, "max",
                     rt.tensor(grad, "float32"), row_splits=rt.tensor(splits, "int32"))
    ref = bag_forward_backward(table, bags, None, "max", grad)
    assert_close(rt.numpy(got[0]), ref[0], "float32", "ragged max: output")
    assert_close(rt.numpy(got[1]), ref[1], "float32", "ragged max: d_table")
    cases += 1
    for combiner in ("sum", "max"):  # a bag axis of length 0: every bag empty, zeros (as on TF)
        got = rt.fwd_bwd(rt.tensor(table, "float32"), rt.tensor(np.zeros((4, 0)), "int32"), None, combiner,
                         rt.tensor(grad[:4], "float32"))
        assert_close(rt.numpy(got[0]), np.zeros((4, D)), "float32", f"K=0 {combiner}: output")
        assert_close(rt.numpy(got[1]), np.zeros((N, D)), "float32", f"K=0 {combiner}: d_table")
        cases += 1
    print(json.dumps({"ops_cases": cases}))


def check_errors():
    """Bad input gets a clear error, as under TF."""
    rt = runtime()
    table = rt.tensor(np.ones((N, D)), "float32")
    idx = np.zeros((4, 3), np.int64)
    idx[2, 1] = N + 5
    try:
        rt.ops.embedding_bag(table, rt.tensor([[0, 1]], "int32"), rt.tensor([[1.0, 2.0]], "float32"), "max")
        raise AssertionError("combiner='max' with weights was accepted")
    except ValueError as err:
        assert "combiner 'max' takes no weights" in str(err), err
    try:
        rt.ops.embedding_bag(rt.tensor(np.ones((N, D)), "float32"), rt.tensor([[0.0]], "float32"))
        raise AssertionError("float indices were accepted by the op")
    except TypeError as err:
        assert "indices must be int32 or int64" in str(err), err
    for dtype in ("float32", "int16", "uint8", "float64"):  # torch's kernel read them as int32 bits
        try:
            rt.ops.embedding_bag(table, rt.tensor([1, 2, 3], "int32"), None, "sum",
                                 row_splits=rt.tensor([0, 1, 3], dtype))
            raise AssertionError(f"{dtype} row_splits were accepted")
        except TypeError as err:
            assert "row_splits must be int32 or int64" in str(err), err
    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    for make in (lambda: EmbeddingBag(10, 4, fused_optimizer=True),  # did nothing here but turn jit off
                 lambda: ProductKeyMemory(k_dim=4, n_keys=4, heads=1, knn=2, fused_optimizer=True)):
        try:
            make()
            raise AssertionError("fused_optimizer=True was accepted")
        except ValueError as err:
            assert "fused_optimizer=True needs the TensorFlow backend" in str(err), err
    out = None
    try:
        out = rt.numpy(rt.ops.embedding_bag(table, rt.tensor(idx, "int32"), None, "sum"))
    except Exception as err:  # noqa: BLE001 - CPU: the core's InvalidArgument, through XLA or ctypes
        assert DEVICE == "cpu", f"GPU raised for an out-of-range index: {err}"
        assert f"indices[7] = {N + 5} is out of range [0, {N})" in str(err), err
    if DEVICE == "cuda":  # read as padding on the GPU, as the TF GPU kernel does
        assert out is not None and np.allclose(out[2], 2.0), out  # rows 0 + 0, the bad one skipped
    else:
        assert out is None, "an out-of-range index gave no error on the CPU"
    print(json.dumps({"errors": "ok"}))


BAD_ROW_SPLITS = {  # row_splits for values [1, 2, 3] -> the core's message (kernels/core/embedding_bag.cc)
    (1, 2, 3): "row_splits[0] must be 0, got 1",
    (0, 3, 2, 3): "row_splits must be non-decreasing: row_splits[2] = 2 < row_splits[1] = 3",
    (0, 1, 2): "row_splits[-1] = 2 must equal the number of values (3)",
    (0, 1, 4): "row_splits[-1] = 4 must equal the number of values (3)",
}


def check_ragged_splits():
    """The keras.ops composite refuses bad row_splits with the fused kernel's message (it read them
    unchecked: a value outside the splits was dropped, decreasing splits made other bags); traced
    row_splits are not checked, and do what the composite's docstring says."""
    from pkm_serve.backends.composite import embedding_bag_composite as composite

    rt = runtime()
    table64 = np.arange(20, dtype=np.float64).reshape(5, 4)
    table = rt.tensor(table64, "float32")
    values = rt.tensor([1, 2, 3], "int32")
    # The CUDA kernels do not check row_splits (they live on the device: each is clamped into
    # [0, V], kernels/cuda/README.md), so on a GPU only the composite (host row_splits) refuses.
    lookups = (("fused", rt.ops.embedding_bag), ("composite", composite)) if DEVICE == "cpu" else (
        ("composite", composite),)
    for splits, message in BAD_ROW_SPLITS.items():
        for name, lookup in lookups:
            for combiner in ("sum", "max"):
                try:
                    lookup(table, values, None, combiner, rt.tensor(splits, "int32"))
                except Exception as err:  # noqa: BLE001 - the fused one fails through XLA (JAX) or ctypes
                    assert message in str(err), f"{name} {combiner} row_splits {splits}: {err!r}"
                    assert name == "fused" or isinstance(err, ValueError), f"{name}: {err!r}"
                else:
                    raise AssertionError(f"{name} {combiner} accepted row_splits {splits}")
    for splits, error, message in (([0.0, 1.0, 3.0], TypeError, "row_splits must be int32 or int64"),
                                   ([[0, 1, 3]], ValueError, "ragged bags need values [V] and row_splits [B+1]")):
        try:
            composite(table, values, None, "sum", np.array(splits))
            raise AssertionError(f"the composite accepted row_splits {splits}")
        except error as err:
            assert message in str(err), err
    # Good row_splits (an empty bag, a padding value) still match the reference.
    bags = [[1, 4], [], [-1, 3, 0]]
    ragged = (rt.tensor([1, 4, -1, 3, 0], "int32"), rt.tensor([0, 2, 2, 5], "int32"))
    for combiner in ("sum", "mean", "max"):
        want = bag_forward_backward(table64, bags, None, combiner, np.zeros((3, 4)))[0]
        assert_close(rt.numpy(composite(table, ragged[0], None, combiner, ragged[1])), want, "float32",
                     f"composite ragged {combiner}")
    # Traced row_splits (the values unknown while tracing) are not checked: a value before
    # row_splits[0] or from row_splits[-1] on is dropped. A constant row_splits is checked under jit.
    if BACKEND == "jax":
        traced = rt.jax.jit(lambda t, s: composite(t, values, None, "sum", s))
        try:
            rt.jax.jit(lambda t: composite(t, values, None, "sum", np.array([0, 1, 2], np.int32)))(table)
            raise AssertionError("jit with constant bad row_splits was accepted")
        except ValueError as err:
            assert BAD_ROW_SPLITS[(0, 1, 2)] in str(err), err
    else:
        traced = rt.torch.compile(lambda t, s: composite(t, values, None, "sum", s), fullgraph=True)
    for splits, kept in (((1, 2, 3), [[2], [3]]), ((0, 1, 2), [[1], [2]])):
        want = bag_forward_backward(table64, kept, None, "sum", np.zeros((2, 4)))[0]
        assert_close(rt.numpy(traced(table, rt.tensor(splits, "int32"))), want, "float32", f"traced {splits}")
    print(json.dumps({"ragged_splits": "ok"}))


def check_composite_ids():
    """The keras.ops composite refuses an index >= N on host ids with the fused kernel's message
    (JAX's take gave a NaN row, PyTorch's a bare IndexError); on the GPU (ids not copied back) it
    reads them as padding, as the kernels do (PyTorch's CUDA take hit a device-side assert);
    negative ids stay padding."""
    from pkm_serve.backends.composite import embedding_bag_composite as composite

    rt = runtime()
    table64 = np.arange(20, dtype=np.float64).reshape(5, 4)
    table = rt.tensor(table64, "float32")
    cases = ((rt.tensor([[1, 2], [4, 7]], "int32"), None, "indices[3] = 7 is out of range [0, 5)"),
             (np.array([[1, 5]], np.int64), None, "indices[1] = 5 is out of range [0, 5)"),
             (rt.tensor([1, 9, 2], "int32"), rt.tensor([0, 2, 3], "int32"), "indices[1] = 9 is out of range [0, 5)"))
    if DEVICE == "cuda":  # both read an index >= N as padding there (device ids are not checked)
        for name, lookup in (("fused", rt.ops.embedding_bag), ("composite", composite)):
            for combiner in ("sum", "max"):
                out = lookup(table, rt.tensor([[1, 2], [4, 7]], "int32"), None, combiner)
                want = bag_forward_backward(table64, [[1, 2], [4, -1]], None, combiner, np.zeros((2, 4)))[0]
                assert_close(rt.numpy(out), want, "float32", f"{name} {combiner}: an index >= N as padding")
        cases = cases[1:2]  # numpy ids are on the host: the composite still refuses them
    elif BACKEND == "jax":  # traced ids cannot be checked: padding (take alone gave a NaN row)
        import jax

        for combiner in ("sum", "max"):
            out = jax.jit(lambda t, i, c=combiner: composite(t, i, None, c))(table, rt.tensor([[1, 2], [4, 7]], "int32"))
            want = bag_forward_backward(table64, [[1, 2], [4, -1]], None, combiner, np.zeros((2, 4)))[0]
            assert_close(rt.numpy(out), want, "float32", f"composite {combiner} under jax.jit: an index >= N")
    lookups = (("fused", rt.ops.embedding_bag), ("composite", composite)) if DEVICE == "cpu" else (
        ("composite", composite),)
    for ids, splits, message in cases:
        for name, lookup in lookups:
            for combiner in ("sum", "max"):
                try:
                    lookup(table, ids, None, combiner, splits)
                except Exception as err:  # noqa: BLE001 - the fused one fails through XLA (JAX) or ctypes
                    assert message in str(err), f"{name} {combiner}: {err!r}"
                    assert name == "fused" or isinstance(err, ValueError), f"{name}: {err!r}"
                else:
                    raise AssertionError(f"{name} {combiner} accepted {message.split(' is')[0]}")
    want = bag_forward_backward(table64, [[-1, 4], [0, 3]], None, "mean", np.zeros((2, 4)))[0]
    assert_close(rt.numpy(composite(table, rt.tensor([[-1, 4], [0, 3]], "int32"), None, "mean")), want,
                 "float32", "composite with padding")
    print(json.dumps({"composite_ids": "ok"}))


def check_zero_sized():
    """A [N, 0] table takes an index >= N, and ragged bags with no bags row_splits [0] beside values,
    with the kernel's error, eager and jitted: JAX had no error (XLA replaced the zero-sized custom
    call by a constant), PyTorch said "forward: out is null" (an empty tensor's data_ptr), for valid
    ids too. Valid ids give [B, 0] and a [N, 0] gradient, no bags [0, D]. CPU only (the GPU reads
    such an index as padding)."""
    rt = runtime()
    assert DEVICE == "cpu", "check_zero_sized checks the CPU's index error"
    table = rt.tensor(np.zeros((N, 0)), "float32")
    lookup = lambda t, i, s=None: rt.ops.embedding_bag(t, i, None, "sum", s)  # noqa: E731
    if BACKEND == "jax":
        runs = {"eager": lookup, "jit": rt.jax.jit(lookup),
                "grad": rt.jax.jit(rt.jax.grad(lambda t, i, s=None: lookup(t, i, s).sum()))}
    else:
        def grad(t, i, s=None):
            t = t.clone().requires_grad_(True)
            lookup(t, i, s).sum().backward()
            return t.grad

        runs = {"eager": lookup, "grad": grad}
    cases = [((rt.tensor([[1, -1], [0, N]], "int32"),), f"indices[3] = {N} is out of range [0, {N})"),
             ((rt.tensor([1, N, 2], "int32"), rt.tensor([0, 2, 3], "int32")),
              f"indices[1] = {N} is out of range [0, {N})")]
    for name, run in runs.items():
        got = rt.numpy(run(table, rt.tensor([[1, -1], [0, N - 1]], "int32")))
        assert got.shape == ((N, 0) if name == "grad" else (2, 0)), f"{name}: {got.shape}"
        for args, message in cases:
            try:
                run(table, *args)
            except Exception as err:  # noqa: BLE001 - XLA's runtime error (JAX), ValueError (PyTorch)
                assert message in str(err), f"{name}: {err!r}"
            else:
                raise AssertionError(f"{name}: a [N, 0] table took {message}")
        full = rt.tensor(np.ones((N, D)), "float32")
        got = rt.numpy(run(full, rt.tensor(np.zeros([0]), "int32"), rt.tensor([0], "int32")))
        assert got.shape == ((N, D) if name == "grad" else (0, D)) and not got.any(), f"{name} no bags: {got}"
        try:  # no bags: the [0, D] result is zero-sized too
            run(full, rt.tensor([1, 2], "int32"), rt.tensor([0], "int32"))
        except Exception as err:  # noqa: BLE001
            assert "row_splits[-1] = 0 must equal the number of values (2)" in str(err), f"{name}: {err!r}"
        else:
            raise AssertionError(f"{name}: row_splits [0] beside 2 values was accepted")
    print(json.dumps({"zero_sized": "ok"}))


def check_transforms():
    """jit/vmap (JAX) and opcheck + torch.compile (PyTorch) keep the numbers."""
    rt = runtime()
    rng = np.random.default_rng(3)
    table = rng.normal(size=(N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=(5, 6, 4)).astype(np.int32)
    ref = np.stack([bag_forward_backward(table, i.tolist(), None, "mean", np.zeros((6, D)))[0] for i in idx])
    if BACKEND == "jax":
        f = rt.jax.jit(rt.jax.vmap(lambda i: rt.ops.embedding_bag(table, i, None, "mean")))
        assert_close(rt.numpy(f(idx)), ref, "float32", "jit(vmap)")
    else:
        torch = rt.torch
        t = rt.tensor(table, "float32").requires_grad_(True)
        i2 = rt.tensor(idx.reshape(-1, 4), "int32")
        w = rt.tensor(rng.uniform(0.5, 1.5, size=(30, 4)), "float32").requires_grad_(True)
        torch.library.opcheck(torch.ops.pkm_serve.embedding_bag.default, (t, i2, w, None, 1))
        f = torch.compile(lambda t, i: rt.ops.embedding_bag(t, i, None, "mean"), fullgraph=True)
        assert_close(rt.numpy(f(t, rt.tensor(idx, "int32"))), ref, "float32", "torch.compile")
        # The documented entry point and the layer, whole-graph too (no importlib in the trace).
        from pkm_serve import backends
        from pkm_serve.layers import EmbeddingBag

        f = torch.compile(lambda t, i: backends.embedding_bag(t, i, None, "mean"), fullgraph=True)
        assert_close(rt.numpy(f(t, rt.tensor(idx, "int32"))), ref, "float32", "torch.compile of backends")
        layer = EmbeddingBag(N, D, combiner="mean")
        layer.build()
        layer.embeddings.assign(table)
        f = torch.compile(lambda i: layer(i), fullgraph=True)
        assert_close(rt.numpy(f(rt.tensor(idx, "int32"))), ref, "float32", "torch.compile of the layer")
    print(json.dumps({"transforms": "ok"}))


def check_no_tf():
    import keras

    import pkm_serve  # noqa: F401
    from pkm_serve import backends  # noqa: F401
    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=1, knn=2)(np.zeros((2, 8), "float32"))
    EmbeddingBag(10, 4)(np.zeros((2, 3), "int32"))
    assert keras.backend.backend() == BACKEND
    assert "tensorflow" not in sys.modules, "importing/using pkm_serve under this backend imported TensorFlow"
    print(json.dumps({"no_tf": "ok"}))


def check_fit():
    """EmbeddingBag and ProductKeyMemory models learn a target under model.fit."""
    import keras

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    idx = rng.integers(-1, 64, size=(512, 5)).astype("int32")
    target = bag_forward_backward(rng.normal(size=(64, 8)), idx.tolist(), None, "mean", np.zeros((512, 8)))[0]
    bag = keras.Sequential([keras.Input((5,), dtype="int32"), EmbeddingBag(64, 8, combiner="mean")])
    bag.compile(keras.optimizers.Adam(0.1), "mse")
    hist = bag.fit(idx, target.astype("float32"), epochs=12, batch_size=128, verbose=0).history["loss"]
    assert hist[-1] < 0.05 * hist[0], f"EmbeddingBag did not learn: loss {hist[0]:.4f} -> {hist[-1]:.4f}"
    x = rng.normal(size=(512, 16)).astype("float32")
    y = np.tanh(x[:, :8] * 2).astype("float32")
    pkm = keras.Sequential([keras.Input((16,)), ProductKeyMemory(v_dim=8, k_dim=8, n_keys=16, heads=2, knn=4)])
    pkm.compile(keras.optimizers.Adam(0.02), "mse")
    hist2 = pkm.fit(x[:256], y[:256], epochs=8, batch_size=64, verbose=0).history["loss"]
    assert hist2[-1] < 0.7 * hist2[0], f"ProductKeyMemory did not learn: loss {hist2[0]:.4f} -> {hist2[-1]:.4f}"
    print(json.dumps({"fit_embedding_bag": [hist[0], hist[-1]], "fit_pkm": [hist2[0], hist2[-1]]}))


def tie_inputs():
    """(query [3, 2, 2, 4], sub_keys [2, 2, 16, 4], knn): a zero row (every score tied), a row with one
    zero half, and repeated sub-keys (tied non-zero scores)."""
    rng = np.random.default_rng(21)
    keys = rng.normal(size=(2, 2, 16, 4)).astype("float32")
    keys[:, :, 9:] = keys[:, :, :7]
    query = rng.normal(size=(3, 2, 2, 4)).astype("float32")
    query[0] = 0.0
    query[1, :, 1] = 0.0
    return query, keys, 5


def check_ties():
    """The slots the backend's product-key search picks on tied scores (test_backends compares them)."""
    import keras

    from pkm_serve.backends.product_keys import product_key_search

    query, keys, knn = tie_inputs()
    slots = product_key_search(keras.ops.convert_to_tensor(query), keras.ops.convert_to_tensor(keys), knn)[0]
    print(json.dumps({"tie_slots": keras.ops.convert_to_numpy(slots).tolist()}))


def check_mask():
    """ProductKeyMemory passes a Keras mask on (a masked mean ignores the padding length) and keeps
    masked rows out of the query batch-norm's training moments."""
    import keras

    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(2)
    embedding = keras.layers.Embedding(30, 16, mask_zero=True)
    layer = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3)
    ids = np.array([[3, 5, 0, 0], [1, 2, 3, 4]], "int32")
    outs = []
    for length in (4, 7):
        inputs = keras.Input((length,), dtype="int32")
        model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(layer(embedding(inputs))))
        outs.append(keras.ops.convert_to_numpy(model(np.pad(ids, ((0, 0), (0, length - 4))))))
    assert np.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6), f"padding changed the masked mean: {outs}"
    x = np.random.default_rng(4).normal(size=(2, 5, 16)).astype("float32")
    mask = np.array([[True] * 3 + [False] * 2, [True] * 5])
    x[~mask] = 50.0
    bn = layer.query_bn
    before = keras.ops.convert_to_numpy(bn.moving_mean).astype(np.float64)
    kernel, bias = (keras.ops.convert_to_numpy(v) for v in (layer.query_proj.kernel, layer.query_proj.bias))
    want = before * bn.momentum + (x[mask].astype(np.float64) @ kernel + bias).mean(0) * (1 - bn.momentum)
    layer(x, training=True, mask=mask)
    got = keras.ops.convert_to_numpy(bn.moving_mean)
    # JAX on a GPU multiplies float32 in TF32 (about 1e-3 relative): 2e-6 off here on the H200.
    # The two masked rows counted would move every element of it by 2e-3 or more.
    atol = 1e-5 if DEVICE == "cuda" else 1e-6
    assert np.allclose(got, want, rtol=1e-5, atol=atol), f"batch-norm moving mean {got} vs {want}"
    print(json.dumps({"mask": "ok"}))


def _status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024.0


def _reset_peak_rss_mb():
    """Resets the peak (VmHWM) to the current RSS and returns it: a process-wide
    peak (ru_maxrss) would hide growth below an earlier check's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def _peak_rss_mb():
    return _status_mb("VmHWM")


def check_memory():
    """fwd+bwd at B=4096 K=128 D=512 grows the process < 600 MB (the composite's
    [B, K, D] float32 gather alone is 1 GiB)."""
    rt = runtime()
    b, k, d, n = 4096, 128, 512, 20000
    rng = np.random.default_rng(1)
    table = rt.tensor(rng.normal(size=(n, d)).astype(np.float32), "float32")
    idx = rt.tensor(rng.integers(-1, n, size=(b, k)), "int32")
    w = rt.tensor(rng.uniform(0.5, 1.5, size=(b, k)).astype(np.float32), "float32")
    grad = rt.tensor(np.ones((b, d), np.float32), "float32")
    small = [rt.tensor(np.zeros((8, d), np.float32), "float32"), rt.tensor(np.zeros((8, k)), "int32"),
             rt.tensor(np.ones((8, k), np.float32), "float32")]
    rt.fwd_bwd(table, small[1], small[2], "sum", small[0])  # libraries loaded, code paths warm
    before = _reset_peak_rss_mb()
    out, d_table, d_w = rt.fwd_bwd(table, idx, w, "sum", grad)
    assert rt.numpy(d_table).shape == (n, d)
    grew = _peak_rss_mb() - before
    print(json.dumps({"memory_growth_mb": round(grew, 1)}))
    assert grew < 600, f"fwd+bwd at B={b} K={k} D={d} grew the process by {grew:.0f} MB (>= 600)"


def check_memory_composite():
    """The control for check_memory: the composite at the same shape does grow the
    process by more than 600 MB (its [B, K, D] gather), so the measure can fail."""
    rt = runtime()
    from pkm_serve.backends.composite import embedding_bag_composite

    b, k, d, n = 4096, 128, 512, 20000
    rng = np.random.default_rng(1)
    table = rt.tensor(rng.normal(size=(n, d)).astype(np.float32), "float32").requires_grad_(True)
    idx = rt.tensor(rng.integers(-1, n, size=(b, k)), "int32")
    before = _reset_peak_rss_mb()
    embedding_bag_composite(table, idx, None, "sum").sum().backward()
    grew = _peak_rss_mb() - before
    print(json.dumps({"composite_memory_growth_mb": round(grew, 1)}))
    assert grew >= 600, f"the composite grew the process by only {grew:.0f} MB: the measure is blind"


def _pkm_model():
    import keras

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(5)
    x = keras.Input((16,))
    ids = keras.Input((4,), dtype="int32")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3, name="pkm")(x)
    z = EmbeddingBag(30, 8, combiner="sqrtn", name="bag")(ids)
    return keras.Model([x, ids], keras.layers.Add()([y, z]))


def _mixed_pkm_model():
    """A PKM under mixed_bfloat16, large enough that 16-bit scores would tie: the slots
    must not depend on the backend's top_k."""
    import keras

    from pkm_serve.layers import ProductKeyMemory

    keras.utils.set_random_seed(6)
    x = keras.Input((32,))
    y = ProductKeyMemory(v_dim=16, k_dim=16, n_keys=64, heads=2, knn=8, query_batchnorm=False,
                         dtype="mixed_bfloat16", name="pkm")(x)
    return keras.Model(x, y)


def _mixed_inputs():
    return np.random.default_rng(12).normal(size=(256, 32)).astype("float32")


def _inputs():
    rng = np.random.default_rng(11)
    return [rng.normal(size=(6, 16)).astype("float32"), rng.integers(-1, 30, size=(6, 4)).astype("int32")]


def check_save(path, out_path):
    import keras

    model = _pkm_model()
    model.save(path)
    np.save(out_path, keras.ops.convert_to_numpy(model(_inputs())))
    mixed = _mixed_pkm_model()
    mixed.save(path + ".mixed.keras")
    np.save(out_path + ".mixed.npy", keras.ops.convert_to_numpy(mixed(_mixed_inputs())).astype("float32"))
    if BACKEND == "jax":   # test_mixed_bfloat16_pkm_under_jax_jit_matches_tf compares it with TF's
        import jax

        jitted = jax.jit(lambda x: mixed(x))(_mixed_inputs())
        np.save(out_path + ".mixed_jit.npy", np.asarray(jitted).astype("float32"))


def check_load(path, out_path):
    import keras

    import pkm_serve.layers  # noqa: F401  (registers the layers)

    model = keras.models.load_model(path)
    out = keras.ops.convert_to_numpy(model(_inputs()))
    np.save(out_path, out)
    mixed = keras.models.load_model(path + ".mixed.keras")
    np.save(out_path + ".mixed.npy", keras.ops.convert_to_numpy(mixed(_mixed_inputs())).astype("float32"))
    if BACKEND == "tensorflow":
        _check_tf_export(model, out, out_path + ".savedmodel")


def tf_training_model():
    """Saved under TF by test_backends: TF-only training options on every layer, compiled with LazyAdam."""
    import keras

    from pkm_serve.layers import EmbeddingBag, ProductKeyMemory

    keras.utils.set_random_seed(8)
    x, ids = keras.Input((16,)), keras.Input((4,), dtype="int32")
    y = ProductKeyMemory(v_dim=8, k_dim=8, n_keys=8, heads=2, knn=3, sparse_gradient=True, name="pkm")(x)
    z = EmbeddingBag(30, 8, sparse_gradient=True, name="sparse")(ids)
    f = EmbeddingBag(30, 8, fused_optimizer=True, name="fused")(ids)
    return keras.Model([x, ids], keras.layers.Add()([y, z, f]))


def check_load_tf_training(path, out_path):
    """A TF .keras file whose layers ask for sparse_gradient / fused_optimizer loads (the options
    are kept for TF); compiled with LazyAdam, it needs compile=False, and the error says so."""
    import keras

    import pkm_serve.layers  # noqa: F401  (registers the layers)

    try:
        keras.models.load_model(path)
        raise AssertionError("a model compiled with LazyAdam loaded compiled under " + BACKEND)
    except ValueError as err:
        assert "LazyAdam runs on the TensorFlow Keras backend only" in str(err) and "compile=False" in str(err), err
    model = keras.models.load_model(path, compile=False)
    assert [(model.get_layer(n).sparse_gradient, model.get_layer(n).fused_optimizer)
            for n in ("pkm", "sparse", "fused")] == [(True, False), (True, False), (False, True)]
    np.save(out_path, keras.ops.convert_to_numpy(model(_inputs())))
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(_inputs(), np.zeros((6, 8), "float32"), verbose=0)  # dense gradients, jit on
    print(json.dumps({"load_tf_training": "ok"}))


def _check_tf_export(model, expected, directory):
    """Under TF the reloaded model exports a SavedModel with the fused op in its graph,
    whose serving signature (what pkm-serve serve and TF Serving call) gives the same outputs."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    model.export(directory, format="tf_saved_model", verbose=False)
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(directory, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    op_types = {n.op for n in graph.node} | {n.op for fn in graph.library.function for n in fn.node_def}
    assert "PkmEmbeddingBag" in op_types, f"no fused op in the exported graph: {sorted(op_types)[:30]}"
    serve = tf.saved_model.load(directory).signatures["serving_default"]
    names = [i.name for i in model.inputs]
    (served,) = serve(**{n: tf.constant(v) for n, v in zip(names, _inputs())}).values()
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-6, atol=1e-6)


CHECKS = {"ops": check_ops, "errors": check_errors, "transforms": check_transforms, "no_tf": check_no_tf,
          "fit": check_fit, "composite_ids": check_composite_ids, "memory": check_memory, "memory_composite": check_memory_composite, "ties": check_ties,
          "mask": check_mask, "ragged_splits": check_ragged_splits,
          "zero_sized": check_zero_sized}

def main(args):
    """Runs the named checks in order; `save`/`load`/`load_tf_training` take two arguments (the
    .keras path and the .npy file for the model's outputs). `memory` must come
    first: it measures the growth of the process's peak RSS."""
    while args:
        name, args = args[0], args[1:]
        if name in ("save", "load", "load_tf_training"):
            {"save": check_save, "load": check_load, "load_tf_training": check_load_tf_training}[name](args[0], args[1])
            args = args[2:]
        else:
            CHECKS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
