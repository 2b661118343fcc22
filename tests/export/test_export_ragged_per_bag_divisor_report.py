"""Ragged rows divided by a dense divisor per bag (tf.math.divide_no_nan(rt, d[:, :1, None]), or rt / d[:, :1,
None]: ragged broadcasting re-gathers d along with the rows) were neither fused nor listed in the report; they
are reported with that reason. In process: the sites of the traced function, no export (the graph is left as
it is; test_export_divide_no_nan_rows checks a ragged divisor's reported site computes the original)."""
import pytest
import tensorflow as tf

from pkm_serve.export.graph import FunctionGraph
from pkm_serve.export.patterns import find_sites
from round34_forms import IDS, TABLE, WEIGHTS

DIVISIONS = {"divide_no_nan": tf.math.divide_no_nan, "divide": tf.math.divide}


@pytest.fixture(scope="module")
def sites():
    table = tf.Variable(TABLE)

    def body(ids, d):
        rows = tf.gather(table, tf.ragged.boolean_mask(ids, ids > 0))
        return tf.concat([tf.reduce_sum(divide(rows, d[:, :1, None]), 1) for divide in DIVISIONS.values()], 1)

    function = tf.function(input_signature=[IDS, WEIGHTS])(body).get_concrete_function()
    return find_sites(FunctionGraph(function.function_def, {}), 8)


def test_ragged_rows_divided_per_bag_are_listed_with_the_reason(sites):
    assert [(s.status, s.pattern) for s in sites] == [("skipped", "ragged-reduce")] * len(DIVISIONS), \
        [(s.root, s.reason) for s in sites]
    assert all("ragged broadcasting re-gathers" in s.reason for s in sites)
