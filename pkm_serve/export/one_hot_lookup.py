"""A lookup written as a one-hot matmul: tf.matmul(tf.one_hot(ids, N), table) (tf-models' OnDeviceEmbedding
with use_one_hot=True, on reshape(ids, [-1]), reshaped back) is tf.gather(table, ids) for ids in [0, N); an id
outside it gets a zero row, where the gather refuses it. A sum of such rows is the bag of the ids with those
ids as padding (Site.negative_ids_padding / ids_past_rows_padding, as one_hot counts fuse them); a reduce_mean
is that sum divided by K (dense.match_reduce). A max, or a mean the op would divide by the ids it reads,
would leave the zero rows out: reported (check_one_hot_combiner)."""
from __future__ import annotations

from typing import Optional

from tensorflow.core.framework import types_pb2

from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import TABLE_DTYPES, Site, Skip


def _table_shape(fg: FunctionGraph, table: Ref):
    read = fg.producer(table)
    if read is not None and read.op == "ReadVariableOp":
        found = fg.variable_shape_dtype(fg.inputs(read)[0])
        if found is not None:
            return found[0]
    return fg.shape(table)


def one_hot_lookup(fg: FunctionGraph, node) -> Optional[Ref]:
    """The ids of MatMul(OneHot(ids, N, on 1, off 0, axis -1), table [N, D]) (neither transposed), else None."""
    if node is None or node.op != "MatMul" or any(
            k in node.attr and node.attr[k].b for k in ("transpose_a", "transpose_b")):
        return None
    one_hot_ref, table = fg.inputs(node)
    one_hot = fg.producer(one_hot_ref)
    # axis -1 is the attr's default, which a SavedModel may leave out
    if one_hot is None or one_hot.op != "OneHot" or ("axis" in one_hot.attr and int(one_hot.attr["axis"].i) != -1) or \
            node.attr["T"].type not in TABLE_DTYPES:
        return None
    ids, depth, on, off = fg.inputs(one_hot)
    depth, on, off = fg.const_value(depth), fg.const_value(on), fg.const_value(off)
    shape = _table_shape(fg, table)
    if depth is None or on is None or off is None or float(on) != 1.0 or float(off) != 0.0 or \
            shape.rank != 2 or shape[0] != int(depth) or len(fg.consumers(one_hot_ref)) != 1:
        return None
    return ids


def check_one_hot_combiner(site: Site) -> None:
    """A one-hot lookup's zero rows (ids outside [0, N)) count in the composite's max and mean; padding does not."""
    if site.ids_past_rows_padding and site.combiner != "sum":
        raise Skip(f"a {site.combiner} of rows looked up by a one-hot matmul: an id outside [0, N) is a zero row "
                   "that counts in the composite's " + site.combiner + ", and padding in the fused op: not fused")


def one_hot_gather(fg: FunctionGraph, ref: Ref, gather_class, nodes):
    """The Gather of a one-hot lookup at `ref` (nodes: Identities before it), else None."""
    node = fg.producer(ref)
    ids = one_hot_lookup(fg, node)
    if ids is None:
        return None
    one_hot = fg.producer(fg.inputs(node)[0])
    table = fg.inputs(node)[1]
    index_dtype = one_hot.attr["TI"].type if "TI" in one_hot.attr else types_pb2.DT_INT64  # TI's default: left out
    gathered = gather_class(ref, table, False, ids, nodes + [node.name, one_hot.name], _table_shape(fg, table),
                            node.attr["T"].type, index_dtype)
    gathered.one_hot = True
    return gathered

