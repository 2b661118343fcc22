"""tf.SparseTensor ids (a VarLenFeature's, what tf.nn.embedding_lookup_sparse takes) handed to the
op functions. They take dense or ragged ids; TF's conversion error said only that a SparseTensor is
no Tensor. Now a TypeError names the argument and the ragged form to pass, and that form, followed
as written, gives tf.nn.embedding_lookup_sparse's bags (entries in any order, gaps in a row)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops

N, D = 30, 5
# Row 0 has a gap (columns 0 and 3), row 1 is empty, entries are out of row-major order.
POSITIONS = [[2, 1], [0, 3], [3, 0], [0, 0], [2, 0], [3, 2]]
IDS = [7, 4, 29, 1, 7, 0]
WEIGHTS = [0.5, 2.0, 1.5, 1.0, 0.25, 3.0]


def _table():
    return tf.Variable(np.random.default_rng(3).standard_normal((N, D)).astype(np.float32))


def _sparse(values):
    return tf.SparseTensor(tf.constant(POSITIONS, tf.int64), tf.constant(values), [4, 4])


def _entries():
    table = _table()
    return [("embedding_bag", lambda *a, **k: ops.embedding_bag(table, *a, **k)),
            ("embedding_bag_composite", lambda *a, **k: ops.embedding_bag_composite(table, *a, **k)),
            ("sharded_embedding_bag", lambda *a, **k: ops.sharded_embedding_bag([table[:12], table[12:]], *a, **k))]


@pytest.mark.parametrize("entry", range(3))
def test_sparse_ids_are_refused_naming_the_ragged_form(entry):
    name, lookup = _entries()[entry]
    ids = _sparse(tf.constant(IDS, tf.int64))
    with pytest.raises(TypeError, match=r"indices is a tf\.SparseTensor.*from_value_rowids"):
        lookup(ids)
    with pytest.raises(TypeError, match=r"indices is a tf\.SparseTensor"):
        lookup(ids, _sparse(tf.constant(WEIGHTS)), combiner="mean")
    with pytest.raises(TypeError, match=r"weights is a tf\.SparseTensor"):
        lookup(tf.constant([[1, 2], [3, -1]]), _sparse(tf.constant(WEIGHTS)))


def _as_told(sparse):
    """The message's recipe, verbatim."""
    ids = tf.sparse.reorder(sparse)
    rows = ids.indices[:, 0]
    return tf.RaggedTensor.from_value_rowids(ids.values, rows, nrows=ids.dense_shape[0])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_the_named_ragged_form_equals_embedding_lookup_sparse(combiner):
    table = _table()
    sp_ids, sp_weights = _sparse(tf.constant(IDS, tf.int64)), _sparse(tf.constant(WEIGHTS))
    got = ops.embedding_bag(table, _as_told(sp_ids), _as_told(sp_weights), combiner=combiner)
    # embedding_lookup_sparse needs canonical order itself; the empty row 1 gives zeros there too
    want = tf.nn.embedding_lookup_sparse(table, tf.sparse.reorder(sp_ids), tf.sparse.reorder(sp_weights),
                                         combiner=combiner)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    t = table.numpy().astype(np.float64)
    expected = np.zeros((4, D))
    for row in range(4):
        entries = [(i, w) for (r, _), i, w in zip(POSITIONS, IDS, WEIGHTS) if r == row]
        if not entries:
            continue
        s = sum(w * t[i] for i, w in entries)
        w = np.array([w for _, w in entries])
        expected[row] = s / {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w ** 2).sum())}[combiner]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
