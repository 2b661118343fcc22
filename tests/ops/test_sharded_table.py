"""A row-sharded table (a list of shards; ShardedVariable) where the shards'
partial bags used to go wrong: ids past the table under XLA and in a .tflite
(dropped as padding, still counted by mean), half shards' undivided partial
sums (overflowed), second derivatives of sqrtn bags of no weight (NaN); the shards' devices
written into SavedModels: tests/distribute/test_parameter_server.py. Reference: numpy float64, or the
same call on the unsharded table."""

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

TABLE = np.arange(10, dtype=np.float32).reshape(5, 2)


def _shards(table=TABLE, dtype=tf.float32):
    return [tf.Variable(tf.cast(table[:3], dtype)), tf.Variable(tf.cast(table[3:], dtype))]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("ragged", [False, True])
def test_an_id_past_the_table_fails_under_xla(combiner, ragged):
    shards = _shards()
    ids = tf.ragged.constant([[1, 5], [4]], dtype=tf.int64) if ragged else tf.constant([[1, 5], [4, 2]])

    @tf.function(jit_compile=True)
    def lookup(i):
        return ops.embedding_bag(shards, i, combiner=combiner)

    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        lookup(ids)  # was [[2, 3], [12, 14]] (sum): id 5 dropped as padding


@pytest.mark.parametrize("ragged", [False, True])
def test_an_id_past_the_table_is_named_by_its_global_value_under_xla(ragged):
    """The last shard's kernel refused it as "indices[1] = 634 is out of range [0, 400)"
    (the shard's own id and rows); the message now names the id and the whole table."""
    table = np.zeros((1000, 2), np.float32)
    shards = [tf.Variable(table[:600]), tf.Variable(table[600:])]
    ids = tf.ragged.constant([[1, 1234], [4]], dtype=tf.int64) if ragged else tf.constant([[1, 1234], [4, 2]])
    lookup = tf.function(lambda i: ops.embedding_bag(shards, i, combiner="mean"), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 1234 is out of range \[0, 1000\)"):
        lookup(ids)
    unsharded = tf.function(lambda i: ops.embedding_bag(tf.constant(table), i, combiner="mean"), jit_compile=True)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 1234 is out of range \[0, 1000\)"):
        unsharded(ids)  # the reference: the same message from the unsharded op


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("ragged", [False, True])
def test_an_id_past_the_table_is_padding_under_xla_without_a_target(monkeypatch, combiner, ragged):
    """Under XLA for a backend the library has no target for, the shards run the composite and
    nothing can fail (XLA drops the Assert): an id past the table is padding there, as on the
    GPU. The last shard's composite read its clamped last row, and mean / sqrtn counted it."""
    from pkm_serve import _xla
    from tests import reference

    monkeypatch.setattr(_xla, "_xla_device_types", frozenset())  # as if the library had no CPU target
    monkeypatch.setattr(_xla, "_xla_fallback_warned", {"CPU"})  # warned already
    bags, weights = [[1, 5, 3], [4, 7, 2]], [[0.5, 2.0, 1.5], [1.0, 0.25, 3.0]]
    want = reference.embedding_bag(TABLE, [[i if i < 5 else -1 for i in bag] for bag in bags], weights, combiner)
    if ragged:
        ids, w = tf.ragged.constant(bags, dtype=tf.int64), tf.ragged.constant(weights)
    else:
        ids, w = tf.constant(bags), tf.constant(weights)
    shards = _shards()
    got = tf.function(lambda: ops.embedding_bag(shards, ids, w, combiner=combiner), jit_compile=True)()
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), want, rtol=1e-6)


def test_an_id_past_the_table_names_it_outside_xla():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 7 is out of range \[0, 5\)"):
        ops.embedding_bag(_shards(), tf.constant([[0, 7, -1]]))


@pytest.mark.parametrize("combiner,weights,want", [
    ("mean", None, 300.0),            # 480 rows of 300: the float16 partial sum was inf
    ("mean", [[200.0, 200.0]], 300.0),
    ("sqrtn", [[200.0, 200.0]], 300.0 * 2 / np.sqrt(2)),
])
def test_half_shards_do_not_overflow_in_their_partial_sums(combiner, weights, want):
    table = np.full((8, 2), 300.0, np.float32)
    shards = _shards(table, tf.float16)
    ids = np.array([[0, 5]]) if weights is not None else np.tile(np.arange(8), 60)[None]
    w = None if weights is None else tf.constant(weights, tf.float16)
    got = ops.embedding_bag(shards, tf.constant(ids), w, combiner=combiner).numpy().astype(np.float64)
    unsharded = ops.embedding_bag(tf.constant(table, tf.float16), tf.constant(ids), w, combiner=combiner).numpy()
    np.testing.assert_allclose(got, np.full((1, 2), want), rtol=2e-3)
    np.testing.assert_allclose(got, unsharded.astype(np.float64), rtol=2e-3)


def test_sqrtn_second_derivatives_of_a_bag_of_no_weight_are_finite():
    shards = _shards()
    ids = tf.constant([[0, 4], [1, 3], [-1, -1]])
    w = tf.Variable([[1.0, 2.0], [0.0, 0.0], [1.0, 1.0]])  # a bag of weight 0, a bag of padding

    def penalty_gradient(table):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(ops.embedding_bag(table, ids, w, combiner="sqrtn") ** 2)
            penalty = tf.reduce_sum(inner.gradient(loss, w) ** 2)
        return outer.gradient(penalty, w).numpy()

    got = penalty_gradient(shards)
    assert np.isfinite(got).all(), got  # was NaN for the bag of weight 0
    np.testing.assert_allclose(got, penalty_gradient(tf.constant(TABLE)), rtol=1e-5, atol=1e-5)
    with tf.autodiff.ForwardAccumulator(w, tf.ones_like(w)) as acc:
        out = ops.embedding_bag(shards, ids, w, combiner="sqrtn")
    assert np.isfinite(acc.jvp(out).numpy()).all()



@pytest.mark.parametrize("lookup", ["sharded", "composite"])
def test_sqrtn_weight_gradient_of_a_bag_of_no_weight_is_the_kernels(lookup):
    """d/dweights of a sqrtn bag whose weights are all 0 is 0 in the fused kernel; the
    sharded path and the composite follow it (with 1 / sqrt(1) they gave <g, row>)."""
    ids = tf.constant([[0, 4], [1, -1], [3, 2]])
    w = tf.Variable([[1.0, 2.0], [0.0, 5.0], [0.0, 0.0]])
    table = {"sharded": _shards(), "composite": tf.constant(TABLE)}[lookup]
    bag = ops.embedding_bag_composite if lookup == "composite" else ops.embedding_bag

    def weight_gradient(fn, params):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(params, ids, w, combiner="sqrtn") * [1.0, -2.0])
        return tape.gradient(loss, w).numpy()

    want = weight_gradient(ops.embedding_bag, tf.constant(TABLE))
    assert np.all(want[2] == 0)
    np.testing.assert_allclose(weight_gradient(bag, table), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_nested_ragged_ids_under_xla(combiner):
    """Ragged ids of two ragged dimensions: the shards' ragged parts were added as
    RaggedTensors, whose partition checks (RaggedRange) XLA cannot compile."""
    ids = tf.ragged.constant([[[1, 4], [2]], [[0, -1, 3]], []], dtype=tf.int64)
    shards = _shards()
    got = tf.function(lambda i: ops.embedding_bag(shards, i, combiner=combiner), jit_compile=True)(ids)
    want = ops.embedding_bag(tf.constant(TABLE), ids, combiner=combiner)
    np.testing.assert_allclose(got.flat_values.numpy(), want.flat_values.numpy(), rtol=1e-6)
    assert got.bounding_shape().numpy().tolist() == want.bounding_shape().numpy().tolist()


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weights", [[1.0, 2.0, 3.0], [[1.0], [2.0]]])
def test_weights_of_another_shape_are_refused(combiner, weights):
    """As the unsharded op refuses them; mean/sqrtn broadcast them (their denominators'
    tf.where) before the fused op's check saw them."""
    ids, shards = tf.constant([[0, 3, 4], [4, -1, 2]]), _shards()
    with pytest.raises(ValueError, match=r"weights shape .* must equal indices shape \(2, 3\)"):
        ops.embedding_bag(shards, ids, tf.constant(weights), combiner=combiner)
    lookup = tf.function(lambda i, w: ops.embedding_bag(shards, i, w, combiner=combiner),
                         input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec(None, tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError):  # shapes known only when the graph runs
        lookup(ids, tf.constant(weights))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("k", [100_000, 1_000_000])
def test_half_means_of_more_than_2_14_entries_keep_their_precision(weighted, ragged, k):
    """Float16 shards with mean's weights divided in: 1/K under float16's normal
    range (K > 2**14) rounded to its subnormal steps (a mean of 1e6 ones was 1.014),
    and 1/K added up K times in float32 drifted where the unsharded op adds ones."""
    rng = np.random.default_rng(3)
    table = rng.uniform(0.5, 2.0, (16, 4)).astype(np.float16)
    ids = rng.integers(0, 16, (2, k))
    w = np.stack([np.full(k, 0.75), np.full(k, 3.0)]).astype(np.float16) if weighted else None
    ref_w = np.ones((2, k)) if w is None else w.astype(np.float64)
    want = np.einsum("bk,bkd->bd", ref_w, table.astype(np.float64)[ids]) / ref_w.sum(1)[:, None]
    shards = [tf.constant(table[:5]), tf.constant(table[5:])]
    call_ids = tf.RaggedTensor.from_tensor(tf.constant(ids)) if ragged else tf.constant(ids)
    call_w = None if w is None else (tf.RaggedTensor.from_tensor(w) if ragged else tf.constant(w))
    got = ops.embedding_bag(shards, call_ids, call_w, combiner="mean").numpy().astype(np.float64)
    unsharded = ops.embedding_bag(tf.constant(table), tf.constant(ids), w, combiner="mean").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3)  # float16 rounds to 4.9e-4 (relative)
    np.testing.assert_allclose(got, unsharded.astype(np.float64), rtol=1e-3)


def test_half_weights_lifted_out_of_subnormals_stay_finite():
    """The weights' power of two is raised only to float16's normal range: the
    partials of 2**17 rows of 100 (a float16 sum of 1.3e7) stay finite."""
    table = np.full((8, 2), 100.0, np.float16)
    ids = tf.constant(np.tile(np.arange(8), 2 ** 14)[None])
    for combiner in ("mean", "sqrtn"):
        for w in (None, tf.fill(ids.shape, tf.constant(0.5, tf.float16))):
            got = ops.embedding_bag(_shards(table, tf.float16), ids, w, combiner=combiner).numpy()
            want = 100.0 * (1 if combiner == "mean" else np.sqrt(2 ** 17))
            np.testing.assert_allclose(got.astype(np.float64), np.full((1, 2), want), rtol=1e-3)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32], ids=["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_weighted_means_of_every_table_dtype(dtype, combiner):
    """Weighted mean / sqrtn over shards of each table dtype (bfloat16 failed: numpy's finfo has no
    bfloat16, asked for its smallest normal number) equal numpy float64 at the dtype's precision."""
    ids = np.array([[0, 4, 3], [1, -1, 2]])
    weights = np.array([[1.0, 2.0, 0.5], [3.0, 1.0, -2.0]])
    got = ops.embedding_bag(_shards(dtype=dtype), tf.constant(ids), tf.constant(weights, dtype),
                            combiner=combiner).numpy().astype(np.float64)
    valid = ids >= 0
    w = np.where(valid, weights, 0.0)
    rows = TABLE.astype(np.float64)[np.where(valid, ids, 0)]
    total = (w[..., None] * rows).sum(1)
    denominator = w.sum(1) if combiner == "mean" else np.sqrt((w * w).sum(1))
    np.testing.assert_allclose(got, total / denominator[:, None], rtol=1e-2 if dtype != tf.float32 else 1e-6)


def test_max_over_shards_is_refused():
    """As docs/SCALING.md says: no sharded form of `max`, a ValueError naming it."""
    with pytest.raises(ValueError, match="combiner 'max' over a sharded table is not supported"):
        ops.embedding_bag(_shards(), tf.constant([[0, 4]]), combiner="max")
