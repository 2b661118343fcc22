"""Checks of the layers and the op used the way a PyTorch user would (KERAS_BACKEND=torch), run in a
process of their own; test_torch_habits.py runs them. Each check raises AssertionError with a message
on failure and prints {"<check>": "ok"}.

    KERAS_BACKEND=torch python -m tests.backends.torch_habit_checks double_backward
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _loop_lookup(table, bags, weights, combiner):
    """float64 reference, one bag at a time: bags a list of id lists (negative = padding)."""
    import torch

    outs = []
    for b, ids in enumerate(bags):
        rows = [(table[i], 1.0 if weights is None else weights[b][k]) for k, i in enumerate(ids) if i >= 0]
        if not rows:
            outs.append(torch.zeros(table.shape[1], dtype=table.dtype))
        elif combiner == "max":
            outs.append(torch.stack([r for r, _ in rows]).max(0).values)
        else:
            total = sum(r * c for r, c in rows)
            scale = {"sum": 1.0, "mean": sum(c for _, c in rows),
                     "sqrtn": sum(c * c for _, c in rows) ** 0.5}[combiner]
            outs.append(total / scale)
    return torch.stack(outs)


def _penalty_gradient(lookup, table, weights):
    """d/d(table, weights) of the gradient penalty |d sum(sin(out)) / d(table, weights)|^2."""
    import torch

    inputs = [table] + ([weights] if weights is not None else [])
    first = torch.autograd.grad(lookup(table, weights).sin().sum(), inputs, create_graph=True)
    return torch.autograd.grad(sum((g * g).sum() for g in first), inputs)


def check_first_call_compiled():
    """The process's first lookup inside torch.compile(fullgraph=True) (run first: nothing has loaded
    our library yet) gives the eager numbers and gradient; it failed on the library loader's lock
    ("Dynamo does not know how to enter a `lock` context manager")."""
    import torch

    from pkm_serve.backends import embedding_bag, torch_ops

    assert not torch_ops._available, "run first: the library was loaded already"
    table = torch.randn(20, 4, requires_grad=True)
    ids = torch.tensor([[1, 2, -1], [19, 0, 0]])
    got = torch.compile(lambda t, i: embedding_bag(t, i, None, "mean"), fullgraph=True)(table, ids)
    d_got, = torch.autograd.grad(got.sum(), table)
    want = torch.stack([(table[1] + table[2]) / 2, (table[19] + 2 * table[0]) / 3])
    d_want, = torch.autograd.grad(want.sum(), table)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(d_got, d_want)
    print(json.dumps({"first_call_compiled": "ok"}))


def check_double_backward():
    """torch.autograd.grad(create_graph=True) through the op (a gradient penalty) matches float64
    loops for every combiner, dense and ragged bags, and through an EmbeddingBag in an nn.Module: it
    failed with "no autograd formula was registered" for pkm_serve.embedding_bag_backward."""
    import torch

    from pkm_serve.backends import embedding_bag
    from pkm_serve.layers import EmbeddingBag

    torch.manual_seed(0)
    bags = [[3, -1, 7, 3], [-1, -1, -1, -1], [0, 11, 5, 2], [9, 9, -1, 4]]
    ids = torch.tensor(bags)
    table64 = torch.randn(12, 5, dtype=torch.float64)
    weights64 = torch.rand(4, 4, dtype=torch.float64) + 0.25
    for combiner, weighted in (("sum", True), ("mean", True), ("sqrtn", True), ("sqrtn", False), ("max", False)):
        w = weights64 if weighted else None
        got = _penalty_gradient(lambda t, w_: embedding_bag(t.float(), ids, None if w_ is None else w_.float(),
                                                            combiner).double(),
                                table64.clone().requires_grad_(), None if w is None else w.clone().requires_grad_())
        want = _penalty_gradient(lambda t, w_: _loop_lookup(t, bags, w_, combiner),
                                 table64.clone().requires_grad_(), None if w is None else w.clone().requires_grad_())
        for name, g, r in zip(("table", "weights"), got, want):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4, msg=f"{combiner}: d penalty / d {name}")
    values, splits = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 5])
    ragged = [[1, 2], [], [3, 4, 5]]
    ragged_w = [weights64[0, :2], [], weights64[1, :3]]
    got = _penalty_gradient(lambda t, w_: embedding_bag(t.float(), values, w_.float(), "mean", splits).double(),
                            table64.clone().requires_grad_(), weights64[:2, :3].flatten()[[0, 1, 3, 4, 5]]
                            .clone().requires_grad_())
    ref_table = table64.clone().requires_grad_()
    ref_w = torch.cat([ragged_w[0], ragged_w[2]]).clone().requires_grad_()
    want = _penalty_gradient(lambda t, w_: _loop_lookup(t, ragged, [w_[:2], [], w_[2:]], "mean"), ref_table, ref_w)
    for name, g, r in zip(("table", "weights"), got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4, msg=f"ragged mean: d penalty / d {name}")

    layer = EmbeddingBag(12, 5, combiner="mean")
    layer.build((None, 4))
    table = layer.embeddings.value
    first, = torch.autograd.grad(layer(ids).sin().sum(), table, create_graph=True)
    got, = torch.autograd.grad((first * first).sum(), table)
    want, = _penalty_gradient(lambda t, _: _loop_lookup(t, bags, None, "mean"),
                              table.detach().double().requires_grad_(), None)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg="EmbeddingBag layer")
    # opcheck differentiates the gradient op (its autograd registration, under AOT dispatch too).
    grad_op = torch.ops.pkm_serve.embedding_bag_backward.default
    args = (torch.randn(4, 5, requires_grad=True), table64.float().requires_grad_(), ids,
            weights64.float().requires_grad_(), None, 1)
    assert all(v == "SUCCESS" for v in torch.library.opcheck(grad_op, args).values())
    print(json.dumps({"double_backward": "ok"}))


def check_uint64_ids():
    """uint64 ids: in range they read int64's rows; one >= 2**63 into a 10-row table fails naming it,
    eagerly (fused and composite) and under torch.compile (fused; the clipped id). keras.ops.minimum
    cast them to int64 first, so they wrapped negative and were read as padding, without an error."""
    import torch

    from pkm_serve.layers import EmbeddingBag

    ids = torch.tensor([[1, 2, 9], [0, 0, 4]])
    for implementation in ("fused", "composite"):
        layer = EmbeddingBag(10, 3, implementation=implementation)
        torch.testing.assert_close(layer(ids.to(torch.uint64)), layer(ids), rtol=0, atol=0)
        calls = [(past, layer, past) for past in (2**63 + 5, 2**64 - 1)]
        if implementation == "fused":  # (the composite reads traced ids past the table as padding)
            calls.append((2**63 + 5, torch.compile(layer, fullgraph=True), 2**63 - 1))
        for past, call, named in calls:
            try:
                got = call(torch.tensor([[1, 2, past]], dtype=torch.uint64))
            except Exception as err:  # noqa: BLE001 - Keras / dynamo wrap the ValueError
                message = str(err)
            else:
                raise AssertionError(f"{implementation}: uint64 id {past} into a 10-row table gave {got.tolist()}")
            assert f"indices[2] = {named} is out of range [0, 10)" in message, (implementation, past, message)
    print(json.dumps({"uint64_ids": "ok"}))


def check_exported_program(directory):
    """torch.export of a module holding an EmbeddingBag (dynamic batch), saved to directory/bag.pt2
    with its table, ids and weights (.npy), for a process that only imports torch and pkm_serve."""
    import numpy as np
    import torch

    from pkm_serve.layers import EmbeddingBag

    layer = EmbeddingBag(20, 4, combiner="mean")
    layer.build((None, 3))

    class Bags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = layer

        def forward(self, ids, weights):
            return self.bag(ids, weights)

    ids, weights = torch.tensor([[1, 5, -1], [19, 19, 0]]), torch.rand(2, 3) + 0.5
    batch = torch.export.Dim("batch")
    program = torch.export.export(Bags(), (ids, weights), dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, os.path.join(directory, "bag.pt2"))
    np.save(os.path.join(directory, "table.npy"), layer.embeddings.value.detach().numpy())
    print(json.dumps({"exported_program": "ok"}))


def _sum_jacobian(ids, weights, rows):
    """d out[b, :] / d table[r, :] of weighted-sum bags (float64): the bag's weights on ids equal to r."""
    import numpy as np

    jac = np.zeros((ids.shape[0], rows))
    for b, k in np.argwhere(ids >= 0):
        jac[b, ids[b, k]] += weights[b, k]
    return jac


def check_func_transforms():
    """torch.func.grad, per-sample grads (vmap of grad), jacfwd, forward_ad and hessian through the op
    match float64 numpy derivatives: torch.func.grad failed ("must override the setup_context
    staticmethod", register_autograd's generated Function) and forward-mode AD gave zero tangents."""
    import numpy as np
    import torch

    from pkm_serve.backends import embedding_bag

    table = np.random.default_rng(7).standard_normal((6, 3))
    ids = np.array([[1, 4, -1], [2, 2, 5]])
    weights = np.array([[0.5, 2.0, 1.0], [1.5, 0.25, 3.0]])
    t, i, w = torch.tensor(table, dtype=torch.float32), torch.tensor(ids), torch.tensor(weights, dtype=torch.float32)
    jac = _sum_jacobian(ids, weights, 6)
    grad = torch.func.grad(lambda t: embedding_bag(t, i, w, "sum").pow(2).sum())(t)
    np.testing.assert_allclose(grad.numpy(), 2 * jac.T @ (jac @ table), rtol=1e-5, atol=1e-6)
    per_bag = torch.func.vmap(torch.func.grad(lambda t, i, w: embedding_bag(t, i[None], w[None], "sum").sum()),
                              in_dims=(None, 0, 0))(t, i, w)
    np.testing.assert_allclose(per_bag.numpy(), np.repeat(jac[..., None], 3, -1), atol=1e-6)
    forward = torch.func.jacfwd(lambda t: embedding_bag(t, i, w, "sum"))(t)
    np.testing.assert_allclose(forward.numpy(), np.einsum("br,de->bdre", jac, np.eye(3)), atol=1e-6)
    # functionalize has no rule for the autograd.Function jvp needs ("NYI"): it keeps calling the op
    functional = torch.func.functionalize(lambda t: embedding_bag(t, i, w, "sum"))(t)
    np.testing.assert_allclose(functional.numpy(), jac @ table, rtol=1e-5, atol=1e-6)
    # torch.compile traced the op under jvp with a zero tangent, silently: now the jvp runs eagerly
    d_table = np.random.default_rng(8).standard_normal(table.shape)
    compiled = torch.compile(lambda t, dt: torch.func.jvp(lambda u: embedding_bag(u, i, w, "sum"), (t,), (dt,))[1])
    np.testing.assert_allclose(compiled(t, torch.tensor(d_table, dtype=torch.float32)).numpy(), jac @ d_table,
                               rtol=1e-5, atol=1e-6)
    # mean's tangent along the weights: (sum dw_k T[id_k] - out * sum dw_k) / sum w_k over valid ids
    d_weights = np.array([[1.0, -1.0, 5.0], [0.5, 0.0, 2.0]])
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(w, torch.tensor(d_weights, dtype=torch.float32))
        tangent = torch.autograd.forward_ad.unpack_dual(embedding_bag(t, i, dual, "mean")).tangent
    valid = ids >= 0
    rows, total_w = table[np.where(valid, ids, 0)] * valid[..., None], (weights * valid).sum(1, keepdims=True)
    out = (rows * weights[..., None]).sum(1) / total_w
    want = ((rows * d_weights[..., None]).sum(1) - out * (d_weights * valid).sum(1, keepdims=True)) / total_w
    np.testing.assert_allclose(tangent.numpy(), want, rtol=1e-5, atol=1e-6)
    # hessian (jacfwd of jacrev) of sum(max^3): 6 * value on the row holding each column's maximum
    hess = torch.func.hessian(lambda t: embedding_bag(t, i, None, "max").pow(3).sum())(t)
    want = np.zeros(table.shape * 2)
    for b in range(ids.shape[0]):
        members = [r for r in ids[b] if r >= 0]
        for d in range(3):
            row = members[int(np.argmax(table[members, d]))]
            want[row, d, row, d] += 6 * table[row, d]
    np.testing.assert_allclose(hess.numpy(), want, rtol=1e-5, atol=1e-5)
    print(json.dumps({"func_transforms": "ok"}))


def check_keras_variable_table():
    """pkm_serve.backends.embedding_bag on a layer's Keras Variable (and Keras Variable weights) under
    PyTorch, as keras.ops take them, and on a nested-list table: float64 numpy's bags, the gradient in
    the variable's tensor (it raised "object of type 'Variable' has no len()"; a list table
    "'list' object has no attribute 'device'")."""
    import keras
    import numpy as np

    from pkm_serve.backends import embedding_bag
    from pkm_serve.layers import EmbeddingBag

    layer = EmbeddingBag(6, 3)
    layer.build()
    table = keras.ops.convert_to_numpy(layer.embeddings.value).astype(np.float64)
    ids, weights = np.array([[1, 4, -1], [2, 2, 5]]), np.array([[0.5, 2.0, 1.0], [1.5, 0.25, 3.0]])
    out = embedding_bag(layer.embeddings, ids, keras.Variable(weights.astype("float32")), "sum")
    out.sum().backward()
    want = [0.5 * table[1] + 2.0 * table[4], 1.75 * table[2] + 3.0 * table[5]]
    # atol: the table is Keras' random init, so a bag's terms can cancel to near 0, where float32 rounding
    # of terms ~0.1 (~1e-8) is far past rtol alone; a wrong row is off by ~0.01 or more.
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.embeddings.value.grad.numpy()[:, 0], [0, 0.5, 1.75, 0, 2.0, 3.0], rtol=1e-6)
    listed = embedding_bag(table.astype("float32").tolist(), ids.tolist(), None, "sum")
    np.testing.assert_allclose(listed.numpy(), [table[1] + table[4], 2 * table[2] + table[5]], rtol=1e-6, atol=1e-6)
    print(json.dumps({"keras_variable_table": "ok"}))


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    import pkm_serve  # noqa: F401  (registers the layers)

    args = sys.argv[1:]
    while args:
        name = args.pop(0)
        CHECKS[name](*([args.pop(0)] if name == "exported_program" else []))
