"""Where the fused op runs under XLA (``jit_compile=True``).

The op library lowers the ops to XLA custom calls into our kernels for the
backends it has a target for (kernels/xla, docs/XLA.md). Under XLA for any
other backend (TPU, a GPU with the CPU-only library) ``ops.embedding_bag``
uses the composite instead, which XLA compiles everywhere, and says once what
that costs.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import tensorflow as tf

from pkm_serve import _library

# Exported by the op library per backend it has custom-call targets for.
_XLA_TARGET_SYMBOLS = {"CPU": "pkm_xla_has_cpu_target", "GPU": "pkm_xla_has_gpu_target"}
_xla_fallback_warned = set()
_xla_device_types = None


def xla_device_types() -> frozenset:
    """XLA device types ("CPU", "GPU") the loaded op library has custom-call
    targets for; empty when the library is missing or predates the lowering."""
    global _xla_device_types
    if _xla_device_types is None:
        try:
            _library.load_library()
            # The library is loaded already: NOLOAD returns its handle.
            handle = ctypes.CDLL(_library.library_path(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (_library.OpLibraryNotFoundError, tf.errors.NotFoundError, OSError):
            return frozenset()
        _xla_device_types = frozenset(
            dev for dev, symbol in _XLA_TARGET_SYMBOLS.items() if hasattr(handle, symbol))
    return _xla_device_types


def compile_device_type():
    """The device XLA compiles the graph being built for, or None outside XLA.

    A jit_compile=True tf.function traces inside an XLA control-flow context;
    TPU replication uses one too. The device is the innermost tf.device scope,
    else the GPU when TF sees one (where tf.function places jit code), else CPU.
    """
    from tensorflow.python.ops import control_flow_util  # no public API for the XLA context

    graph = tf.compat.v1.get_default_graph()
    if not control_flow_util.GraphOrParentsInXlaContext(graph):
        return None
    g = graph
    while g is not None:
        ctxt = g._get_control_flow_context()  # pylint: disable=protected-access
        while ctxt is not None:
            if type(ctxt).__name__ == "TPUReplicateContext":
                return "TPU"
            ctxt = ctxt.outer_context
        g = getattr(g, "outer_graph", None)
    return _requested_device_type(graph) or ("GPU" if tf.config.list_logical_devices("GPU") else "CPU")


def _requested_device_type(graph):
    """The device type the innermost tf.device scope of `graph` names ("CPU", "GPU"), else None."""
    try:
        requested = graph._device_function_stack.peek_top_obj().display_name  # pylint: disable=protected-access
        device_type = tf.DeviceSpec.from_string(requested).device_type
    except Exception:  # no device scope
        device_type = None
    return device_type.upper() if device_type else None


def composite_under_xla(params, indices):
    """True (after a one-time warning) when the graph being built is compiled
    by XLA for a backend the op library has no custom-call target for."""
    device = compile_device_type()
    if device is None or device in xla_device_types():
        return False
    if device not in _xla_fallback_warned:
        _xla_fallback_warned.add(device)
        shape = getattr(indices, "shape", None)
        dim = getattr(params, "shape", [None])[-1]
        warnings.warn(
            f"pkm_serve.embedding_bag: the op library has no XLA custom-call target for {device} "
            f"(it has: {', '.join(sorted(xla_device_types())) or 'none'}); under jit_compile it uses "
            "the composite gather-multiply-reduce, which materialises the [..., K, D] gather in the "
            f"forward and backward (indices {shape} x D = {dim} elements per call) "
            "instead of running the fused kernel.",
            RuntimeWarning, stacklevel=3)
    return True


def _flag_value(flags, name):
    """The value of `--name[=value]` in a TF_XLA_FLAGS string ("true" for a bare flag), else None."""
    for token in flags.split():
        key, sep, value = token.partition("=")
        if key == "--" + name:
            return value.lower() if sep else "true"
    return None


def cpu_autoclustering() -> bool:
    """Whether TF's auto-clustering may compile the lookups of the graph being built with XLA on
    the CPU: it needs TF_XLA_FLAGS' --tf_xla_cpu_global_jit, and --tf_xla_auto_jit=1/2/fusible or
    (where that flag leaves CPU graphs at the session's level: absent, 0, single-gpu(N))
    tf.config.optimizer.set_jit(True). Not where the lookups would run on a GPU."""
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if _flag_value(flags, "tf_xla_cpu_global_jit") not in ("true", "1"):
        return False
    if tf.executing_eagerly() or _lookups_on_gpu(tf.compat.v1.get_default_graph()):
        return False
    auto_jit = _flag_value(flags, "tf_xla_auto_jit")
    if auto_jit in ("1", "2", "fusible"):
        return True
    session_level = auto_jit in (None, "0") or auto_jit.startswith("single-gpu")
    return session_level and bool(tf.config.optimizer.get_jit())


def _lookups_on_gpu(graph) -> bool:
    """Whether the lookups built in `graph` are placed on a GPU: TF sees one, the op library has
    GPU kernels (its GPU XLA target comes with them) and no tf.device scope (in the function, or
    the eager one it is traced in) names another device. With a GPU, lookups of the CPU-only library or under tf.device("/CPU:0") run on the CPU, where
    --tf_xla_cpu_global_jit clusters them too."""
    if not tf.config.list_logical_devices("GPU"):
        return False
    from tensorflow.python.eager import context  # the eager tf.device scope a tf.function traces in

    requested = _requested_device_type(graph) or \
        tf.DeviceSpec.from_string(context.context().device_name or "").device_type
    return requested.upper() == "GPU" if requested else "GPU" in xla_device_types()


def checked_when_compiled(condition, value, message):
    """`value` after an InvalidArgumentError(message) where `condition` (a scalar, or a function
    that builds it) is false when the graph runs, for a graph XLA compiles for the CPU (jit_compile,
    or auto-clustering that may compile it): XLA drops tf.debugging.Assert (a user error passed
    silently), but keeps the op library's PkmCheckThen, a custom call that can fail (outside a
    cluster its CPU kernel checks the same). None elsewhere (outside XLA, or a backend without the
    op): there the caller's Assert holds or is dropped as before."""
    device = compile_device_type()
    if device is None and cpu_autoclustering():
        device = "CPU"
    if device != "CPU" or "CPU" not in xla_device_types():
        return None
    lib = _library.load_library()
    if not hasattr(lib, "pkm_check_then"):  # a library built before the op
        return None
    return lib.pkm_check_then(condition() if callable(condition) else condition, value, message=message)


# Ops whose output XLA sizes at run time, below a static bound.
_RUN_TIME_SIZE_OPS = frozenset(["Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2", "ListDiff"])
# The composite's backward fails also on tf.dynamic_partition's parts ("Invalid shape broadcast from
# f32[8,3] to [0,2]"); the fused op's differentiates them.
_COMPOSITE_RUN_TIME_SIZE_OPS = _RUN_TIME_SIZE_OPS | {"DynamicPartition"}
_SECOND_ORDER_ACROSS_JIT_ERROR = (
    "embedding_bag: a second derivative taken outside the jit_compile function that took the first one, "
    "of bags whose sizes are known only at run time inside it (a {op} op: tf.boolean_mask, tf.where, "
    "tf.unique), is not supported: TF's XLA passes "
    "such tensors from the compiled forward to the compiled backward with wrong shapes (an error naming "
    "arbitrary shapes, or an abort of the process). Take both derivatives inside the jit_compile function "
    "(open the outer GradientTape there too), or call the function without jit_compile.")


def _run_time_size_source(tensors, sizing_ops=_RUN_TIME_SIZE_OPS, into_functions=False, limit=10000):
    """The type of an op that sizes one of `tensors` at run time under XLA (tf.boolean_mask's Where,
    tf.unique), found among their producers in their graph (and, with into_functions, the
    tf.functions it calls: the composite's process aborted on ids masked in one), else None.
    Tensors of a fully defined static shape are left out: XLA sizes them at compile time, whatever
    computed their values (ids put back with tf.scatter_nd(tf.where(mask), ...) differentiate)."""
    seen = set()
    pending = [t.op for t in tensors if getattr(t, "op", None) is not None and not t.shape.is_fully_defined()]
    while pending and len(seen) < limit:
        op = pending.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in sizing_ops:
            return op.type
        pending.extend(i.op for i in op.inputs)
        if into_functions:  # not for the fused op: its backward took ids masked there (static splits)
            pending.extend(t.op for t in _called_function_outputs(op))
    return None


def _called_function_outputs(op):
    """The outputs of the tf.function graph that a call op (PartitionedCall) runs, else []."""
    if op.type not in ("PartitionedCall", "StatefulPartitionedCall"):
        return []
    try:
        function = op.graph._get_function(op.get_attr("f").name)  # pylint: disable=protected-access
    except (AttributeError, ValueError, TypeError):
        return []
    return list(getattr(getattr(function, "graph", None), "outputs", None) or [])


def _enclosing_graphs(graph):
    """`graph`, the graph it is built in, and so on outward (the eager context's graph last)."""
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


def _built_outside_the_compilation(graph):
    """Whether the graph being built now lies outside the jit_compile function's graph that holds
    `graph`: the gradient-of-gradient of a tape outside that function. Not the gradient branch of
    a tf.cond inside it (another graph, compiled with it by XLA)."""
    current = tf.compat.v1.get_default_graph()
    if current is graph:
        return False
    # TF enters the XLA context on the graph a jit_compile function is traced (or differentiated)
    # in; the function's own graph is the one just inside the outermost such graph.
    chain = list(_enclosing_graphs(graph))
    in_xla = [i for i, g in enumerate(chain) if _has_xla_context(g)]
    if not in_xla or in_xla[-1] == 0:
        return True
    return chain[in_xla[-1] - 1] not in set(_enclosing_graphs(current))


def _has_xla_context(graph):
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    return context is not None and context.IsXLAContext()


def refuse_second_order_across_jit(forward_op):
    """ValueError where the gradient of `forward_op` (a gradient op) is being built in another graph
    than its own (a tape outside a jit_compile function differentiates the first derivative taken
    inside it) and XLA sizes its bags at run time there: TF's XLA then hands the backward tensors of
    wrong shapes (errors naming arbitrary shapes, or "Check failed" aborts of the process)."""
    from tensorflow.python.ops import control_flow_util  # no public API for the XLA context

    graph = getattr(forward_op, "graph", None)  # an eager op's gradient gets a mock op without one
    if graph is None or not _built_outside_the_compilation(graph) \
            or not control_flow_util.GraphOrParentsInXlaContext(graph):
        return
    source = _run_time_size_source([t for t in forward_op.inputs if t.dtype.is_integer])
    if source is not None:
        raise ValueError(_SECOND_ORDER_ACROSS_JIT_ERROR.format(op=source))


def refusing_second_order_across_jit(value, ids):
    """`value` (the composite's bags of `ids`), whose second derivative fails as
    refuse_second_order_across_jit's where XLA sizes `ids` at run time in the graph being built:
    the composite's gradient is stock ops, so the check sits in the gradient of its gradient."""
    from tensorflow.python.ops import control_flow_util  # no public API for the XLA context

    graph = tf.compat.v1.get_default_graph()
    if not control_flow_util.GraphOrParentsInXlaContext(graph):
        return value
    source = _run_time_size_source([t for t in ids if t is not None], _COMPOSITE_RUN_TIME_SIZE_OPS,
                                   into_functions=True)
    if source is None:
        return value

    @tf.custom_gradient
    def bags(x):
        def grad(d_bags):
            first_order_graph = tf.compat.v1.get_default_graph()

            @tf.custom_gradient
            def checked(d):
                def second_order(dd):
                    if _built_outside_the_compilation(first_order_graph):
                        raise ValueError(_SECOND_ORDER_ACROSS_JIT_ERROR.format(op=source))
                    return dd
                return tf.identity(d), second_order
            return checked(d_bags)
        return tf.identity(x), grad

    return bags(value)


@tf.RegisterGradient("PkmCheckThen")
def _check_then_grad(op, grad):  # the value passes through; the condition is boolean
    return [None, grad]
