"""Ragged weights of another row partition than the ids, where the graph's check is an Assert that
XLA drops (a graph traced without jit_compile and compiled later, or the composite fallback under
jit for a device without our XLA target). Until round 38 the weights went silently into the ids'
bags there for ragged outer dims over a uniform bag axis (the dense op had no row splits to carry
the mismatch's mark) and for the composite (which ignored the mark)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import _xla, ops, quantized  # noqa: E402
from tests.reference import embedding_bag as reference_bags  # noqa: E402

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3) / 10.0
MISMATCH = r"mismatched partitions of ids and weights: weights must share the row partition of the indices"
IDS = np.array([[1, 2], [3, 4], [5, 6]], np.int64)
WEIGHTS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
SPLITS, OTHER_SPLITS = np.array([0, 1, 3], np.int64), np.array([0, 2, 3], np.int64)
# Uniform bags of 2 ids under one ragged outer dim, and bags of ragged size (ragged rank 1).
UNIFORM = (tf.TensorSpec([None, 2], tf.int64), tf.TensorSpec([None, 2], tf.float32))
RAGGED = (tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.float32))


def _lookup(table_kind):
    """(lookup(ids, weights), the float table it reads) for one kind of table."""
    if table_kind == "int8":
        table = quantized.quantize_table(TABLE)
        return (lambda i, w: quantized.embedding_bag(table, i, w)), quantized.dequantize(table).numpy()
    if table_kind == "sharded":
        shards = [tf.constant(TABLE[:4]), tf.constant(TABLE[4:])]
        return (lambda i, w: ops.embedding_bag(shards, i, w)), TABLE
    if table_kind == "composite":
        return (lambda i, w: ops.embedding_bag_composite(tf.constant(TABLE), i, w)), TABLE
    return (lambda i, w: ops.embedding_bag(tf.constant(TABLE), i, w)), TABLE


def _dense(bags):
    """Uniform bags under a ragged outer dim give a RaggedTensor, bags of ragged size a dense one."""
    return bags.flat_values if isinstance(bags, tf.RaggedTensor) else bags


def _traced_without_jit(table_kind, specs):
    """A concrete function traced without XLA (as a reloaded SavedModel's), called in a jit function."""
    lookup, table = _lookup(table_kind)
    ids_spec, weights_spec = specs

    @tf.function(input_signature=[ids_spec, tf.TensorSpec([None], tf.int64), weights_spec,
                                  tf.TensorSpec([None], tf.int64)])
    def traced(ids, splits, weights, weight_splits):
        return _dense(lookup(tf.RaggedTensor.from_row_splits(ids, splits),
                             tf.RaggedTensor.from_row_splits(weights, weight_splits)))

    concrete = traced.get_concrete_function()
    return tf.function(lambda *args: concrete(*args), jit_compile=True), table


def _inputs(specs):
    if specs is UNIFORM:
        return IDS, WEIGHTS
    return IDS.reshape(-1)[:3], WEIGHTS.reshape(-1)[:3]


def _expected(table, specs):
    ids, weights = _inputs(specs)
    if specs is UNIFORM:
        return reference_bags(table, ids, weights)
    bags = [ids[SPLITS[b]:SPLITS[b + 1]] for b in range(2)]
    return np.stack([reference_bags(table, bag[None], weights[SPLITS[b]:SPLITS[b + 1]][None])[0]
                     for b, bag in enumerate(bags)])


@pytest.mark.parametrize("table_kind", ["float32", "int8", "sharded"])
def test_uniform_bags_of_another_outer_partition_fail_under_jit(table_kind):
    call, table = _traced_without_jit(table_kind, UNIFORM)
    np.testing.assert_allclose(call(IDS, SPLITS, WEIGHTS, SPLITS).numpy(), _expected(table, UNIFORM), rtol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match=MISMATCH):
        call(IDS, SPLITS, WEIGHTS, OTHER_SPLITS)


@pytest.mark.parametrize("specs", [UNIFORM, RAGGED], ids=["uniform_bags", "ragged_bags"])
def test_composite_traced_without_jit_gives_nan_for_another_partition_under_jit(specs):
    """XLA has no stock op that fails at run time: the composite's refusal is NaN bags."""
    call, table = _traced_without_jit("composite", specs)
    ids, weights = _inputs(specs)
    np.testing.assert_allclose(call(ids, SPLITS, weights, SPLITS).numpy(), _expected(table, specs), rtol=1e-5)
    assert np.isnan(call(ids, SPLITS, weights, OTHER_SPLITS).numpy()).all()


@pytest.mark.parametrize("specs", [UNIFORM, RAGGED], ids=["uniform_bags", "ragged_bags"])
def test_composite_fallback_under_jit_gives_nan_for_another_partition(monkeypatch, specs):
    """The fallback where the library has no XLA target for the device (a GPU with the CPU-only
    library, a TPU): there the partition check is an Assert that XLA drops while compiling."""
    monkeypatch.setattr(_xla, "_xla_device_types", frozenset())  # as if the library had no CPU target
    monkeypatch.setattr(_xla, "_xla_fallback_warned", set())  # it warns once per device and process
    table = tf.Variable(TABLE)

    @tf.function(jit_compile=True)
    def step(ids, splits, weights, weight_splits):
        with tf.GradientTape() as tape:
            out = _dense(ops.embedding_bag(table, tf.RaggedTensor.from_row_splits(ids, splits),
                                           tf.RaggedTensor.from_row_splits(weights, weight_splits)))
            loss = tf.reduce_sum(out)
        return out, tf.convert_to_tensor(tape.gradient(loss, table))  # the composite: IndexedSlices

    ids, weights = _inputs(specs)
    with pytest.warns(RuntimeWarning, match="no XLA custom-call target"):
        out, _ = step(ids, SPLITS, weights, SPLITS)
    np.testing.assert_allclose(out.numpy(), _expected(TABLE, specs), rtol=1e-5)
    out, grad = step(ids, SPLITS, weights, OTHER_SPLITS)
    assert np.isnan(out.numpy()).all() and np.isnan(grad.numpy()[IDS.reshape(-1)[:3]]).all()


@pytest.mark.parametrize("table_kind", ["float32", "int8"])
def test_static_weights_for_ids_sized_at_run_time_say_why_under_jit(table_kind):
    """Ids masked inside a jit function have a dimension XLA sizes at run time (shown at its bound);
    weights of a static size cannot be paired with it under XLA even where the sizes agree when it
    runs (stock ops refuse it too). The refusal read 'weights must have the shape of indices [5, 1],
    got [2, 1]' for 2 kept ids, naming a size the user never made; it now says why. Weights of
    another static shape keep the plain message."""
    lookup, table = _lookup(table_kind)
    ids = tf.constant([3, -1, 4, -1, -1], tf.int64)
    masked = tf.function(lambda w: lookup(tf.reshape(tf.boolean_mask(ids, ids >= 0), [-1, 1]), w),
                         jit_compile=True)
    np.testing.assert_allclose(tf.function(lambda w: lookup(tf.reshape(tf.boolean_mask(ids, ids >= 0), [-1, 1]),
                                                            w))(tf.constant([[2.0], [3.0]])).numpy(),
                               reference_bags(table, [[3], [4]], [[2.0], [3.0]]), rtol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"got \[2, 1\] \(under XLA: a dimension sized only at run time"):
        masked(tf.constant([[2.0], [3.0]]))
    static = tf.function(lambda w: lookup(tf.constant([[3], [4]], tf.int64), w), jit_compile=True,
                         input_signature=[tf.TensorSpec([None, 1], tf.float32)])  # compiled at [3, 1]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"got \[3, 1\]\n"):  # no note
        static(tf.constant([[2.0], [3.0], [4.0]]))
