"""Each value's bag of a ragged lookup (its value_rowids), which the composite, its second
derivatives and the sharded lookup's mean/sqrtn use, eager and under jit_compile.

Under XLA it was tf.searchsorted, which XLA compiles as a comparison of every value with every row
split: a [values, bags] tensor (a composite max of 4096 bags of 32 ids ran 13x slower under jit than
with value_rowids, and 10**5 bags of 10**6 ids need 10**11 elements). Now a binary search over the
splits: no tensor of values x bags elements, and the bags of numpy's np.repeat."""

import re

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve._composite import bag_of_each_value

SPLITS_CASES = {
    "empty bags first, between and last": [0, 0, 0, 2, 2, 5, 6, 6, 6],
    "one bag": [0, 4],
    "every bag empty": [0, 0, 0],
    "no bags": [0],
    "one value a bag": [0, 1, 2, 3, 4, 5],
}


def _numpy_bags(splits):
    splits = np.asarray(splits)
    return np.repeat(np.arange(len(splits) - 1), np.diff(splits))


@pytest.mark.parametrize("mode", ["eager", "jit", "jit, sizes known at run time"])
@pytest.mark.parametrize("case", list(SPLITS_CASES))
def test_bag_of_each_value_matches_numpy(case, mode):
    splits = SPLITS_CASES[case]
    splits_dtype = tf.int64 if list(SPLITS_CASES).index(case) % 2 else tf.int32

    def bags(values, splits):
        if mode == "jit, sizes known at run time":
            values = tf.boolean_mask(values, values >= 0)  # keeps all, but XLA learns it at run time
            splits = tf.boolean_mask(splits, splits >= 0)
        return bag_of_each_value(tf.RaggedTensor.from_row_splits(values, splits, validate=False))

    fn = bags if mode == "eager" else tf.function(bags, jit_compile=True)
    got = fn(tf.range(splits[-1], dtype=tf.int64), tf.constant(splits, splits_dtype))
    assert got.dtype == tf.int32
    np.testing.assert_array_equal(got.numpy(), _numpy_bags(splits))


def _largest_array(hlo_text):
    sizes = [int(np.prod([int(d) for d in dims.split(",")]))
             for dims in re.findall(r"[a-z]+\d*\[(\d+(?:,\d+)*)\]", hlo_text)]
    return max(sizes)


def test_jit_composite_of_many_ragged_bags_keeps_no_values_by_bags_tensor():
    num_bags, num_values, dim = 2048, 4096, 4
    rng = np.random.default_rng(7)
    splits = np.concatenate([[0], np.sort(rng.integers(0, num_values + 1, num_bags - 1)), [num_values]])
    ids = tf.RaggedTensor.from_row_splits(tf.constant(rng.integers(0, 50, num_values)), tf.constant(splits))
    table = tf.constant(rng.standard_normal((50, dim)).astype(np.float32))
    lookup = tf.function(lambda t, i: ops.embedding_bag_composite(t, i, combiner="max"), jit_compile=True)
    hlo = lookup.experimental_get_compiler_ir(table, ids)(stage="hlo")
    # The gathered rows are [values, dim]; a [values, bags] comparison is 2048 times the values.
    assert _largest_array(hlo) <= num_values * dim
    expected = tf.RaggedTensor.from_row_splits(tf.gather(table, ids.values), splits).numpy()
    got = lookup(table, ids).numpy()
    for bag, rows in zip(got, expected):
        np.testing.assert_array_equal(bag, rows.max(axis=0) if len(rows) else np.zeros(dim, np.float32))
