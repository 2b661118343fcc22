"""Whether a gradient tape could record the op being built. TF has no public
query; its private ``record.could_possibly_record`` answers it. Where a TF
lacks it, each caller says which answer is the safe one for it."""

from __future__ import annotations


def tape_could_record(if_unknown: bool) -> bool:
    """``record.could_possibly_record()``, or `if_unknown` where TF lacks it."""
    try:
        from tensorflow.python.eager import record  # no public "is a tape recording" query

        return bool(record.could_possibly_record())
    except (ImportError, AttributeError):
        return if_unknown


def tape_watches(tensor, if_unknown: bool) -> bool:
    """Whether an active tape records gradients through `tensor` (``record.should_record_backprop``),
    or `if_unknown` where TF lacks the query."""
    try:
        from tensorflow.python.eager import record

        return bool(record.should_record_backprop([tensor]))
    except (ImportError, AttributeError, TypeError):
        return if_unknown


def tape_watches_variable(variable, if_unknown: bool) -> bool:
    """Whether an active tape records gradients for `variable` once the lookup reads it: watched
    explicitly, or trainable and read under a tape that watches accessed variables (the read is
    announced here as the lookup's own read would announce it). `if_unknown` where TF lacks the
    queries or the variable has no handle here (a distributed variable outside a replica)."""
    try:
        from tensorflow.python.eager import record
        from tensorflow.python.ops import resource_variable_ops

        resource_variable_ops.variable_accessed(variable)
        return bool(record.should_record_backprop([variable.handle]))
    except (ImportError, AttributeError, TypeError, ValueError):
        return if_unknown


_CONTROL_FLOW_GRAPHS = ("CondBranchFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph")


def is_control_flow_graph(graph) -> bool:
    """Whether `graph` itself is a tf.cond / tf.switch_case branch or a tf.while_loop (tf.map_fn)
    body (also where TF builds such control flow's gradient)."""
    return any(cls.__name__ in _CONTROL_FLOW_GRAPHS for cls in type(graph).__mro__)  # gradients subclass them


def in_control_flow_branch(graph) -> bool:
    """Whether `graph` is a tf.cond / tf.switch_case branch or a tf.while_loop (tf.map_fn) body,
    directly or in a nested tf.function inside one."""
    while graph is not None:
        if is_control_flow_graph(graph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False
