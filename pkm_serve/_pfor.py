"""``tf.vectorized_map`` (pfor) over the lookup: one op call on the stacked bags.

pfor vectorises a loop body op by op. An op without a converter runs once per
iteration in a while_loop, with a warning; on 256 problems of 32 bags that
took 6.4 ms against 0.7 ms for one call on the stacked ``[P, B, K]`` ids. The
op already takes ``[..., K]`` ids, so a loop-invariant table needs nothing
more: the converter stacks the ids and weights and calls the op once. A table
that differs per iteration is left to pfor's while_loop (the converter
declines). The run-time check under XLA (``PkmCheckThen``) has one too, so a
lookup with a check stays one call. The gradient ops (``tape.jacobian`` vectorises them) keep the
while_loop: their per-iteration ``[N, D]`` table gradients do not batch.
"""

from __future__ import annotations

from pkm_serve._library import load_library

# The lookup ops whose inputs are (table or variable handle, indices, weights).
_LOOKUP_OPS = {"PkmEmbeddingBag": "pkm_embedding_bag", "PkmResourceEmbeddingBag": "pkm_resource_embedding_bag"}


def _vectorized_lookup(pfor_input, wrap):
    """The lookup over all iterations' bags: ids [P, ..., K] -> [P, ..., D]."""
    table = pfor_input.unstacked_input(0)  # raises (pfor then falls back) when the table is per iteration
    has_weights = pfor_input.get_attr("has_weights")
    if has_weights:
        pfor_input.stack_inputs([1, 2])
        weights = pfor_input.stacked_input(2)
    else:
        pfor_input.stack_inputs([1])
        weights = pfor_input.unstacked_input(2)  # the empty "no weights" input
    op = getattr(load_library(), _LOOKUP_OPS[pfor_input.op_type])
    out = op(table, pfor_input.stacked_input(1), weights, combiner=pfor_input.get_attr("combiner"),
             has_weights=has_weights)
    return [wrap(out, True)]


def _vectorized_check(pfor_input, wrap):
    """PkmCheckThen (a run-time check under XLA) over all iterations: every iteration's condition
    must hold; the value passes through stacked or not, as it came in. Without it, vectorized_map
    under jit_compile over a lookup with a check fell back to its while_loop (or failed where
    fallback_to_while_loop=False)."""
    import tensorflow as tf

    condition, value = pfor_input.input(0), pfor_input.input(1)
    holds = tf.reduce_all(condition.t) if condition.is_stacked else condition.t
    out = load_library().pkm_check_then(holds, value.t, message=pfor_input.get_attr("message"))
    return [wrap(out, value.is_stacked)]


def register():
    """Registers the converters in TF's private pfor registry (there is no
    public one). Where TF lacks it, vectorized_map uses its while_loop as
    before."""
    try:
        from tensorflow.python.ops.parallel_for import pfor

        register_converter, wrap = pfor.RegisterPFor, pfor.wrap
    except (ImportError, AttributeError):
        return
    for op_type in _LOOKUP_OPS:
        register_converter(op_type)(lambda pfor_input: _vectorized_lookup(pfor_input, wrap))
    register_converter("PkmCheckThen")(lambda pfor_input: _vectorized_check(pfor_input, wrap))
