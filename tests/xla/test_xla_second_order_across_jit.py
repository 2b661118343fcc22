"""A second derivative taken by a tape outside a jit_compile function, of a first derivative taken
inside it, of bags whose sizes XLA knows only at run time there (ids masked with tf.boolean_mask).

TF's XLA hands such tensors from the compiled forward to the compiled backward with wrong shapes:
"Incompatible shapes: [4,3] vs. [0,1325386458]", or an abort of the process ("Check failed: size ==
kUnboundedSize"), also for a plain tf.gather. The fused op's second derivative, and the composite's
(XLA's fallback; until round 36 it did not compile there, a clear error), now refuse it with a
ValueError while the backward is built; ids of static sizes still differentiate across the boundary,
also where a tf.where computed them (until round 37 refused too: the look-back found the Where), and
both derivatives taken in the function differentiate also where the first is in a tf.cond branch
(until round 37 refused: the branch's gradient is built in another graph).
One subprocess for the cases: before the fix the process could abort."""

import os
import subprocess
import sys

SCRIPT = r'''
import numpy as np, tensorflow as tf
from pkm_serve import ops
N, D = 9, 3
VALUES = tf.constant([1, 4, 2, 8, 0, 3, 3, 7, 5, -1], tf.int64)
SPLITS = tf.constant([0, 2, 2, 5, 6, 10], tf.int64)
KEEP = tf.constant([True, True, False, True, True, True])
rng = np.random.default_rng(36)
table = tf.constant(np.round(rng.standard_normal((N, D)) * 2).astype(np.float32))
weights = tf.constant(rng.uniform(0.5, 2.0, size=10).astype(np.float32))

def penalty(table, values, splits, keep, weights, combiner, mask, lookup):
    if mask == "restored":  # masked, then put back at their positions: static sizes again
        in_range = values < N
        values = tf.scatter_nd(tf.where(in_range), tf.boolean_mask(values, in_range), tf.shape(values, tf.int64))
    elif mask == "partitioned":  # tf.dynamic_partition's first part, in two bags
        parts = tf.cast(values < 0, tf.int32)
        values, weights = tf.dynamic_partition(values, parts, 2)[0], tf.dynamic_partition(weights, parts, 2)[0]
        size = tf.shape(values, tf.int64)[0]
        splits = tf.stack([tf.constant(0, tf.int64), size // 2, size])
    elif mask == "in_a_tf_function":  # masked in a tf.function the jit_compile function calls
        values, weights = tf.function(lambda v, w: (tf.boolean_mask(v, v < N), tf.boolean_mask(w, v < N)))(
            values, weights)
    elif mask:
        in_range = values < N
        values, weights = tf.boolean_mask(values, in_range), tf.boolean_mask(weights, in_range)
        splits = tf.boolean_mask(splits, keep)
    ids = tf.RaggedTensor.from_row_splits(values, splits, validate=False)
    with tf.GradientTape() as inner:
        inner.watch([table, weights])
        bag_weights = None if combiner == "max" else ids.with_flat_values(weights)
        loss = tf.reduce_sum(lookup(table, ids, bag_weights, combiner=combiner) ** 2)
    d_table = tf.convert_to_tensor(inner.gradient(loss, table))
    return tf.reduce_sum(d_table ** 2)

def outer_gradient(combiner, mask, jit, lookup):
    fn = tf.function(lambda *a: penalty(*a, combiner=combiner, mask=mask, lookup=lookup), jit_compile=jit)
    with tf.GradientTape() as outer:
        outer.watch(table)
        p = fn(table, VALUES, SPLITS, KEEP, weights)
    return tf.convert_to_tensor(outer.gradient(p, table)).numpy()

def both_inside(table, values, splits, keep, weights):
    """Both derivatives in the jit_compile function, the first in a tf.cond branch (another graph)."""
    with tf.GradientTape() as outer:
        outer.watch(table)
        p = tf.cond(tf.reduce_any(keep), lambda: penalty(table, values, splits, keep, weights, "sum", True,
                                                           ops.embedding_bag), lambda: tf.reduce_sum(table))
    return tf.convert_to_tensor(outer.gradient(p, table))

np.testing.assert_allclose(tf.function(both_inside, jit_compile=True)(table, VALUES, SPLITS, KEEP, weights),
                           both_inside(table, VALUES, SPLITS, KEEP, weights), rtol=1e-5, atol=1e-5)
# Static sizes (no mask: KEEP's dropped split kept) still differentiate across the boundary.
np.testing.assert_allclose(outer_gradient("sum", False, True, ops.embedding_bag),
                           outer_gradient("sum", False, False, ops.embedding_bag), rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(outer_gradient("sum", "restored", True, ops.embedding_bag),
                           outer_gradient("sum", "restored", False, ops.embedding_bag), rtol=1e-5, atol=1e-5)
for name, lookup in (("fused", ops.embedding_bag), ("composite", ops.embedding_bag_composite)):
    for combiner in ("sum", "max"):
        try:
            outer_gradient(combiner, True, True, lookup)
            print(name, combiner, "no error")
        except ValueError as err:
            print(name, combiner, str(err).split(":")[1].strip()[:58])
for mask in ("partitioned", "in_a_tf_function"):  # the process aborted on the latter
    try:
        outer_gradient("sum", mask, True, ops.embedding_bag_composite)
        print("composite", mask, "no error")
    except ValueError as err:
        print("composite", mask, str(err).split(":")[1].strip()[:58])
'''


def test_second_derivative_across_jit_of_run_time_sized_bags_is_refused():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "a second derivative taken outside the jit_compile function"
    assert proc.stdout.splitlines()[-6:] == [f"{lookup} {combiner} {expected}" for lookup in ("fused", "composite")
                                             for combiner in ("sum", "max")] + \
        [f"composite {mask} {expected}" for mask in ("partitioned", "in_a_tf_function")], proc.stdout
