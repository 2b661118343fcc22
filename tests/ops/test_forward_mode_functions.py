"""tf.autodiff.ForwardAccumulator around a traced function of the op (tf.vectorized_map, which
pfor traces into one, or a plain tf.function): TF builds the function's backward under the
accumulator and takes the jvps of the gradient ops there, by transposing their gradients, whose
row-sparse table part it cannot take (AttributeError: 'IndexedSlices' object has no attribute
'_id'). The gradient ops' own jvps (pkm_serve/_second_order.py) give stock TF's jvp of the
composite gather -> multiply -> reduce, taken eagerly without a function."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

RNG = np.random.default_rng(3)
TABLE = tf.constant(RNG.standard_normal((12, 4)), tf.float32)
IDS = tf.constant(RNG.integers(-1, 12, (3, 5, 4)))
WEIGHTS = tf.constant(RNG.uniform(0.2, 1.5, (3, 5, 4)), tf.float32)
TANGENTS = [tf.constant(RNG.standard_normal((12, 4)), tf.float32),
            tf.constant(RNG.standard_normal((3, 5, 4)), tf.float32)]


def jvp(call, weighted):
    primals = [tf.identity(TABLE), tf.identity(WEIGHTS)]
    with tf.autodiff.ForwardAccumulator(primals, TANGENTS) as acc:
        out = call(primals[0], primals[1] if weighted else None)
    return tf.convert_to_tensor(acc.jvp(out, unconnected_gradients=tf.UnconnectedGradients.ZERO)).numpy()


def composite(table, weights, combiner):
    return ops.embedding_bag_composite(table, IDS, weights, combiner=combiner)


@pytest.mark.parametrize("sparse_gradient", [False, True])
@pytest.mark.parametrize("combiner,weighted", [("sum", True), ("mean", True), ("sqrtn", True), ("sum", False),
                                               ("max", False)])
@pytest.mark.parametrize("around", ["vectorized_map", "tf.function"])
def test_jvp_around_a_traced_function_of_the_op_matches_the_composite(around, combiner, weighted,
                                                                      sparse_gradient):
    def lookup(table, weights):
        if around == "tf.function":
            return tf.function(lambda t, w: ops.embedding_bag(t, IDS, w, combiner=combiner,
                                                              sparse_gradient=sparse_gradient))(table, weights)
        problems = (IDS, weights) if weights is not None else IDS

        def one(problem):
            ids, w = problem if weights is not None else (problem, None)
            return ops.embedding_bag(table, ids, w, combiner=combiner, sparse_gradient=sparse_gradient)
        return tf.vectorized_map(one, problems)

    want = jvp(lambda t, w: composite(t, w, combiner), weighted)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(jvp(lookup, weighted), want, rtol=1e-5, atol=1e-5)
