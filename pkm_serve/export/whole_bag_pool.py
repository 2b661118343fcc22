"""Keras AveragePooling1D(pool_size=K) of an Embedding's [B, K, D] rows (tf.nn.avg_pool1d: AvgPool of the rows
expanded to [B, 1, K, D], one window of all K positions, VALID, NHWC) is reduce_mean over the bag axis with two
unit axes kept: [B, 1, 1, D]. Fused as that mean (dense.match_reduce's Mean: unweighted rows the op's mean,
weighted, masked or one-hot rows the sum divided by K read off the ids), the unit axes put back. A window
shorter than the bag, or strides that give more than one output, stay reported (unrecognised.py)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from pkm_serve.export import scales
from pkm_serve.export.dense import apply_rows, leads_to_gather, resolve_rows
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.sites import NotASite, Site, Skip


def _whole_bag_window(fg: FunctionGraph, node) -> Optional[Ref]:
    """The [B, K, D] rows whose expansion to [B, 1, K, D] `node` (AvgPool) averages in one window of all K
    positions, else None."""
    attr = node.attr
    fmt = attr["data_format"].s.decode() if "data_format" in attr else "NHWC"
    ksize, strides = list(attr["ksize"].list.i), list(attr["strides"].list.i)
    expand = fg.producer(fg.inputs(node)[0])
    if fmt != "NHWC" or expand is None or expand.op != "ExpandDims" or len(ksize) != 4:
        return None
    rows, axis = fg.inputs(expand)
    axis, shape = fg.const_value(axis), fg.shape(rows)
    if axis is None or shape.rank != 3 or int(np.reshape(axis, [])) % 4 != 1 or shape[1] is None:
        return None
    bag = shape[1]
    padding = attr["padding"].s.decode()
    one_output = padding == "VALID" or (padding == "SAME" and strides[2] >= bag)
    if ksize != [1, 1, bag, 1] or strides[0] != 1 or strides[3] != 1 or not one_output:
        return None
    return rows


def match_whole_bag_pool(fg: FunctionGraph, node, site: Site) -> Site:
    """AvgPool of one whole-bag window of gathered rows: the mean bag; NotASite where it is no such pool."""
    rows_ref = _whole_bag_window(fg, node)
    if rows_ref is None or not leads_to_gather(fg, rows_ref):
        raise NotASite()
    expand = fg.producer(fg.inputs(node)[0])
    site.pattern, site.combiner = "gather-reduce", "mean"
    rows = resolve_rows(fg, rows_ref, site, scaling=scales)
    if rows.regathers:
        raise Skip("the gathered rows are re-gathered before the pooling")
    rows.nodes.insert(0, expand.name)
    rows.private.insert(0, rows_ref)
    apply_rows(fg, site, rows, node.name, fg.inputs(node)[0])
    if rows.factors:
        scales.check_factors(fg, site, rows.factors, fg.shape(site.indices))
        site.weight_factors = tuple(rows.factors)
    if site.weights is not None or site.mask is not None or site.weight_factors or site.ids_past_rows_padding:
        site.combiner, site.divide_by_bag = "sum", True  # avg_pool divides by the window: K, not the ids kept
        site.divisor = fg.shape(rows_ref)[1]
    site.expand_bag_axis, site.extra_unit_axes = True, 1  # [B, D] -> [B, 1, 1, D]
    return site
