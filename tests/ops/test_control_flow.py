"""The op inside TF's program transformations: tf.cond branches (the other
branch's gradient is dense zeros), tf.vectorized_map / tf.map_fn over a batch
of bag problems, and tape.jacobian / batch_jacobian (pfor and while_loop),
against the float64 numpy reference of the values and gradients."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from tests.reference import bag_forward_backward

N, D = 13, 5


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b) / (1.0 + np.abs(b))))


def problem(seed, shape=(4, 3)):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=shape)
    idx.reshape(-1, shape[-1])[0, :2] = 7  # a repeated row
    weights = rng.uniform(0.1, 1.0, size=shape).astype(np.float32)
    return table, idx, weights


def reference(table, idx, weights, combiner, grad):
    """(out, d_table, d_weights) of bags [..., K] in float64."""
    k = idx.shape[-1]
    bags = idx.reshape(-1, k).tolist()
    w = None if weights is None else weights.reshape(-1, k).tolist()
    out, d_table, d_w = bag_forward_backward(table, bags, w, combiner, grad.reshape(-1, table.shape[1]))
    return out.reshape(idx.shape[:-1] + (table.shape[1],)), d_table, np.reshape(d_w, idx.shape)


TABLE_KINDS = ("constant", "variable", "shards")


def as_table(kind, table):
    if kind == "variable":
        return tf.Variable(table)
    if kind == "shards":
        return [tf.constant(table[:6]), tf.constant(table[6:])]
    return tf.constant(table)


# Sharded tables take no max (a documented ValueError).
@pytest.mark.parametrize("kind,combiner", [(kind, combiner) for kind in TABLE_KINDS for combiner in ("mean", "max")
                                           if (kind, combiner) != ("shards", "max")])
def test_sparse_gradient_inside_a_tf_cond_branch(kind, combiner):
    """The other branch's gradient is dense zeros, which tf.cond turns into IndexedSlices with an
    int32 dense_shape; the lookup's gradient had an int64 one and tape.gradient failed ("true_fn
    and false_fn ... must have the same ... structure")."""
    table, idx, w = problem(1)
    w = None if combiner == "max" else w
    params = as_table(kind, table)
    sources = params if kind == "shards" else [params]
    grad = np.random.default_rng(2).standard_normal((idx.shape[0], D)).astype(np.float32)

    @tf.function
    def step(take_lookup):
        with tf.GradientTape() as tape:
            if kind != "variable":
                tape.watch(sources)
            out = tf.cond(take_lookup,
                          lambda: ops.embedding_bag(params, tf.constant(idx), w, combiner, sparse_gradient=True),
                          lambda: tf.zeros([idx.shape[0], D]))
            loss = tf.reduce_sum(out * grad)
        d_sources = tape.gradient(loss, sources)
        return out, tf.concat([tf.convert_to_tensor(g) for g in d_sources], axis=0)

    want_out, want_d_table, _ = reference(table, idx, w, combiner, grad)
    out, d_table = step(tf.constant(True))
    assert rel_err(out, want_out) < 1e-5 and rel_err(d_table, want_d_table) < 1e-5
    out, d_table = step(tf.constant(False))
    assert not np.any(out.numpy()) and not np.any(d_table.numpy())


def gradient_step(kind, params, grad, forward, **gradient_options):
    """A tf.function (ids, weights) -> (forward's output, d_table, d_weights) of sum(output * grad)."""
    @tf.function
    def step(ids, bag_weights):
        with tf.GradientTape() as tape:
            tape.watch(bag_weights)
            if kind == "constant":
                tape.watch(params)
            out = forward(ids, bag_weights)
            loss = tf.reduce_sum(out * grad)
        d_table, d_weights = tape.gradient(loss, [params, bag_weights], **gradient_options)
        return out, tf.convert_to_tensor(d_table), d_weights

    return step


def graph_op_types(concrete):
    """Op types of a concrete function's graph and every function it calls."""
    graph_def = concrete.graph.as_graph_def()
    types = [node.op for node in graph_def.node]
    for function in graph_def.library.function:
        types += [node.op for node in function.node_def]
    return types


@pytest.mark.parametrize("kind", ("constant", "variable"))
@pytest.mark.parametrize("combiner", ("sqrtn", "max"))
@pytest.mark.parametrize("sparse_gradient", (False, True))
def test_vectorized_map_is_one_lookup_on_the_stacked_bags(kind, combiner, sparse_gradient):
    """tf.vectorized_map over problems sharing a table: one lookup on the stacked [P, B, K] ids (it
    was a while_loop of P lookups, with a warning, 9x slower), with the reference's values and
    gradients."""
    table, idx, w = problem(3, shape=(5, 4, 3))  # 5 problems of 4 bags
    w = None if combiner == "max" else w
    params = as_table(kind, table)
    grad = np.random.default_rng(4).standard_normal(idx.shape[:-1] + (D,)).astype(np.float32)
    weights = tf.constant(np.ones_like(idx, np.float32) if w is None else w)

    step = gradient_step(kind, params, grad, lambda ids, bag_weights: tf.vectorized_map(
        lambda a: ops.embedding_bag(params, a[0], None if w is None else a[1], combiner,
                                    sparse_gradient=sparse_gradient), (ids, bag_weights)),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)

    ids = tf.constant(idx, tf.int32)
    loops = [op for op in graph_op_types(step.get_concrete_function(ids, weights)) if "While" in op]
    assert not loops, loops
    out, d_table, d_weights = step(ids, weights)
    want_out, want_d_table, want_d_weights = reference(table, idx, w, combiner, grad)
    assert rel_err(out, want_out) < 1e-5 and rel_err(d_table, want_d_table) < 1e-5
    if w is not None:
        assert rel_err(d_weights, want_d_weights) < 1e-5


def test_vectorized_map_over_a_table_per_problem_keeps_the_while_loop():
    """A table that differs per problem does not batch: pfor's while_loop, with the reference's values
    and gradients."""
    rng = np.random.default_rng(5)
    tables = rng.standard_normal((3, N, D)).astype(np.float32)
    idx = rng.integers(-1, N, size=(3, 4, 2))
    grad = rng.standard_normal((3, 4, D)).astype(np.float32)
    stacked = tf.constant(tables)
    with tf.GradientTape() as tape:
        tape.watch(stacked)
        out = tf.vectorized_map(lambda a: ops.embedding_bag(a[0], a[1], combiner="mean"),
                                (stacked, tf.constant(idx)))
    d_tables = tape.gradient(out, stacked, output_gradients=grad)
    for p in range(3):
        want_out, want_d_table, _ = reference(tables[p], idx[p], None, "mean", grad[p])
        assert rel_err(out[p], want_out) < 1e-5 and rel_err(d_tables[p], want_d_table) < 1e-5


def reference_jacobians(table, idx, weights, combiner):
    """d out[b, d] / d table [B, D, N, D] and / d weights [B, D, B, K], one one-hot upstream
    gradient per output element."""
    bags = idx.shape[0]
    j_table, j_weights = np.zeros((bags, D, N, D)), np.zeros((bags, D) + idx.shape)
    for b in range(bags):
        for d in range(D):
            one_hot = np.zeros((bags, D))
            one_hot[b, d] = 1.0
            _, j_table[b, d], j_weights[b, d] = reference(table, idx, weights, combiner, one_hot)
    return j_table, j_weights


@pytest.mark.parametrize("use_pfor", (True, False))
@pytest.mark.parametrize("combiner,sparse_gradient", [("sum", True), ("mean", False), ("max", True)])
def test_jacobians_match_the_reference(use_pfor, combiner, sparse_gradient):
    """tape.jacobian w.r.t. the table and the weights and batch_jacobian w.r.t. the weights, vectorised
    by pfor (the gradient ops run in its while_loop) or not, in a tf.function."""
    table, idx, w = problem(6, shape=(3, 4))
    w = None if combiner == "max" else w
    params, weights = tf.constant(table), tf.constant(np.ones_like(idx, np.float32) if w is None else w)

    @tf.function
    def jacobians():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([params, weights])
            out = ops.embedding_bag(params, tf.constant(idx), None if w is None else weights, combiner,
                                    sparse_gradient=sparse_gradient)
        return (tape.jacobian(out, params, experimental_use_pfor=use_pfor),
                tape.jacobian(out, weights, experimental_use_pfor=use_pfor,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO),
                tape.batch_jacobian(out, weights, experimental_use_pfor=use_pfor,
                                    unconnected_gradients=tf.UnconnectedGradients.ZERO))

    j_table, j_weights, batch_j_weights = jacobians()
    want_table, want_weights = reference_jacobians(table, idx, w, combiner)
    assert rel_err(j_table, want_table) < 1e-5 and rel_err(j_weights, want_weights) < 1e-5
    per_bag = np.stack([want_weights[b, :, b] for b in range(idx.shape[0])])  # [B, D, K]
    assert rel_err(batch_j_weights, per_bag) < 1e-5


@pytest.mark.parametrize("kind", ("constant", "variable"))
@pytest.mark.parametrize("sparse_gradient", (False, True))
def test_recompute_grad_and_map_fn(kind, sparse_gradient):
    """tf.recompute_grad (the lookup run again in the backward) around a tf.map_fn over problems
    (a while_loop), in a tf.function: the reference's values and gradients."""
    table, idx, w = problem(7, shape=(3, 4, 3))
    params = as_table(kind, table)
    grad = np.random.default_rng(8).standard_normal(idx.shape[:-1] + (D,)).astype(np.float32)
    # A captured tensor gets no gradient through recompute_grad (tf.gather's neither): a constant
    # table is an argument, a variable is captured.
    lookups = lambda ids, bag_weights, *table_arg: tf.map_fn(  # noqa: E731
        lambda a: ops.embedding_bag(table_arg[0] if table_arg else params, a[0], a[1], "sqrtn",
                                    sparse_gradient=sparse_gradient),
        (ids, bag_weights), fn_output_signature=tf.float32)

    step = gradient_step(kind, params, grad, lambda ids, bag_weights: tf.recompute_grad(lookups)(
        ids, bag_weights, *([params] if kind == "constant" else [])))

    out, d_table, d_weights = step(tf.constant(idx), tf.constant(w))
    want_out, want_d_table, want_d_weights = reference(table, idx, w, "sqrtn", grad)
    assert rel_err(out, want_out) < 1e-5 and rel_err(d_table, want_d_table) < 1e-5
    assert rel_err(d_weights, want_d_weights) < 1e-5
