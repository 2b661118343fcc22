"""Second derivatives of the fused op: the gradients of its gradient ops.

A gradient penalty, a Hessian-vector product, MAML-style nested tapes and
forward-mode autodiff (``tf.autodiff.ForwardAccumulator`` transposes the
registered gradient; the in-kernel variable read, whose gradient is
IndexedSlices, gets the dense op's jvp instead) all differentiate the gradient ops. Their outputs are
the composite's gradient (``d_params`` scattered back to the rows, ``d_weights``
from the rows and the bag's output), so their gradients are taken here by
differentiating the composite's gradient once more. That builds the
composite's ``[..., K, D]`` gather, on this path only; the first derivative
keeps the fused kernels. For ``max`` the first derivative routes each column
to the first row holding its maximum (the fused rule, a NaN first), linear in
the incoming gradient and constant in the table and weights between changes
of winner; that is what is differentiated here.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from pkm_serve import _xla
from pkm_serve._composite import bag_of_each_value, embedding_bag_composite


def _first_winners(params, indices):
    """[B, K, D] booleans: the entry of each bag and column that the fused max
    gradient goes to (the first NaN, else the first maximum; none where the
    bag is empty). indices [B, K], -1 or any negative = padding."""
    valid = indices >= 0
    rows = tf.cast(tf.gather(params, tf.where(valid, indices, tf.zeros_like(indices))), tf.float32)
    nan = tf.math.is_nan(rows) & valid[..., None]
    masked = tf.where(valid[..., None] & ~nan, rows, tf.fill(tf.shape(rows), float("-inf")))
    # Where the bag's column has a NaN, its first NaN; said explicitly: XLA's reduce_max skips NaN.
    bag_has_nan = tf.reduce_any(nan, axis=1, keepdims=True)
    top = tf.reduce_max(masked, axis=1, keepdims=True)
    candidate = tf.where(bag_has_nan, nan, masked == top) & valid[..., None]
    earlier = tf.cumsum(tf.cast(candidate, tf.int32), axis=1, exclusive=True)
    return candidate & (earlier == 0)


def _max_params_gradient(grad, params, indices):
    """The fused max gradient d_params [N, D] in stock ops (differentiable in grad)."""
    dim = tf.shape(params)[1]
    indices = tf.reshape(indices, [-1, tf.shape(indices)[-1]])
    grad = tf.reshape(grad, [-1, dim])
    winners = tf.stop_gradient(_first_winners(params, indices))
    routed = tf.where(winners, tf.cast(grad, tf.float32)[:, None, :], tf.zeros([], tf.float32))
    return _summed_into_rows(routed, indices, params)


def _summed_into_rows(routed, ids, params):
    """d_params [N, D]: each entry's routed gradient (float32, shaped like ids + [D]) added into its
    id's row, padding (negative ids) dropped."""
    num_rows = tf.shape(params, out_type=ids.dtype)[0]
    segments = tf.where(ids >= 0, ids, tf.fill(tf.shape(ids), num_rows))
    return tf.cast(tf.math.unsorted_segment_sum(routed, segments, num_rows + 1)[:-1], params.dtype)


def _ragged_max_params_gradient(grad, params, indices):
    """_max_params_gradient for ragged bags (ragged rank 1) with segment ops: XLA cannot compile
    RaggedTensor.to_tensor (no RaggedTensorToTensor kernel), which padded them to dense."""
    ids, bag = indices.values, bag_of_each_value(indices)
    num_bags = indices.nrows(out_type=tf.int32)
    valid = ids >= 0
    rows = tf.cast(tf.gather(params, tf.where(valid, ids, tf.zeros_like(ids))), tf.float32)
    nan = tf.math.is_nan(rows) & valid[:, None]
    # The first NaN wins where a bag's column has one, else the first maximum.
    bag_has_nan = tf.gather(tf.math.unsorted_segment_max(tf.cast(nan, tf.int32), bag, num_bags), bag) > 0
    finite = tf.where(valid[:, None] & ~nan, rows, tf.fill(tf.shape(rows), float("-inf")))
    top = tf.gather(tf.math.unsorted_segment_max(finite, bag, num_bags), bag)
    # unsorted_segment_max starts from the lowest finite value: a column of -inf rows has -inf on top.
    above = tf.cast(finite > float("-inf"), tf.int32)
    top = tf.where(tf.gather(tf.math.unsorted_segment_max(above, bag, num_bags), bag) > 0, top, float("-inf"))
    candidate = tf.where(bag_has_nan, nan, (finite == top) & valid[:, None])
    # The first candidate of each bag and column: its position is the bag's smallest (a segment
    # min, not a cumsum: XLA's cumsum of a tensor of run-time size is wrong on this TF).
    position = tf.broadcast_to(tf.range(tf.shape(ids)[0])[:, None], tf.shape(candidate))
    no_candidate = tf.fill(tf.shape(position), tf.int32.max)
    first = tf.math.unsorted_segment_min(tf.where(candidate, position, no_candidate), bag, num_bags)
    winners = tf.stop_gradient(candidate & (position == tf.gather(first, bag)))
    routed = tf.where(winners, tf.gather(tf.cast(grad, tf.float32), bag), tf.zeros([], tf.float32))
    return _summed_into_rows(routed, ids, params)


def _first_order(grad, params, indices, weights, combiner):
    """The gradient ops' (d_params dense, d_weights or None), recorded on any outer tape."""
    if combiner == "max":
        if isinstance(indices, tf.RaggedTensor):
            return _ragged_max_params_gradient(grad, params, indices), None
        return _max_params_gradient(grad, params, indices), None
    # Ragged weights: their flat values (watching the RaggedTensor would watch its int row splits too).
    weight_values = weights.flat_values if isinstance(weights, tf.RaggedTensor) else weights
    with tf.GradientTape() as inner:
        inner.watch(params)
        if weights is not None:
            inner.watch(weight_values)
        out = embedding_bag_composite(params, indices, weights, combiner)
    if weights is None:
        return tf.convert_to_tensor(inner.gradient(out, params, output_gradients=grad)), None
    d_params, d_weights = inner.gradient(out, [params, weight_values], output_gradients=grad)
    return tf.convert_to_tensor(d_params), d_weights


def _gradients(op, params, bags, d_params_up, d_weights_up):
    """Gradients for (grad, params, weights) of a gradient op whose incoming
    gradients are d_params_up ([N, D] dense) and d_weights_up (or None).
    bags(weights) gives the (indices, weights) the composite takes."""
    _xla.refuse_second_order_across_jit(op)
    combiner = op.get_attr("combiner")
    combiner = combiner.decode() if isinstance(combiner, bytes) else combiner
    has_weights = op.get_attr("has_weights")
    grad, weights = op.inputs[0], op.inputs[-1]
    # A ForwardAccumulator that is busy taking a jvp (e.g. of a tf.function traced earlier without
    # one, through its backward graph) keeps tapes opened here from recording: their gradients came
    # back None, or zero for max (a wrong jvp). TF's own _jvp_helper resets that state the same way.
    with _forwardprop_state_reset():
        with tf.GradientTape() as outer:
            outer.watch([grad, params, weights])
            indices, bag_weights = bags(weights if has_weights else None)
            d_params, d_weights = _first_order(grad, params, indices, bag_weights, combiner)
        if d_params_up is not None:  # its gradient dense (Reshape's is), not the composite gather's
            d_params_up = tf.reshape(d_params_up, tf.shape(d_params_up))  # IndexedSlices (see below)
        targets, upstream = [d_params], [tf.zeros_like(d_params) if d_params_up is None else d_params_up]
        if d_weights is not None:
            targets.append(d_weights)
            upstream.append(tf.zeros_like(d_weights) if d_weights_up is None else d_weights_up)
        d_grad, d_params, d_weights = outer.gradient(targets, [grad, params, weights], output_gradients=upstream,
                                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Dense, not a gather's IndexedSlices (ragged sum): a jvp is read off d_grad, and TF's jvp of
    # a function call fails on IndexedSlices ("no attribute '_id'", as its own ragged composite does).
    return tf.convert_to_tensor(d_grad), d_params, tf.convert_to_tensor(d_weights)


def _dense_rows(rows, row_grads_up, params):
    """A row-sparse gradient op's incoming row gradients as a dense [N, D] one."""
    if row_grads_up is None:
        return None
    shape = tf.shape(params, out_type=tf.int64)
    return tf.scatter_nd(rows[:, None], tf.convert_to_tensor(row_grads_up), shape)


def _resource_lookup_jvp(attr_tuple, inputs, outputs, tangents):
    """Forward mode through ``PkmResourceEmbeddingBag`` (``sparse_gradient=True``
    on a variable): the dense op's jvp on the table as read now. TF takes an
    op's jvp by transposing its registered gradient on a tape, which cannot
    take this op's IndexedSlices table gradient."""
    from tensorflow.python.eager import forwardprop
    from tensorflow.python.ops import resource_variable_ops

    attrs = list(attr_tuple)  # (name, value, ...); the dense op names the table's dtype T
    dtype = attrs[attrs.index("dtype") + 1]
    attrs[attrs.index("dtype")] = "T"
    handle, indices, weights = inputs
    table = resource_variable_ops.read_variable_op(handle, dtype)
    t_table, _, t_weights = tangents
    dense_tangents = [tf.zeros_like(table) if t_table is None else t_table, None,
                      tf.zeros_like(weights) if t_weights is None else t_weights]
    return forwardprop._jvp_helper("PkmEmbeddingBag", tuple(attrs), [table, indices, weights], outputs,
                                   dense_tangents)


def _forwardprop_state_reset():
    """TF's reset of a busy accumulator (private: no public way); a no-op where
    TF lacks it (pre-traced functions' jvps then fail as described above)."""
    try:
        from tensorflow.python.eager import forwardprop_util

        return forwardprop_util.push_forwardprop_state()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def _gradient_op_jvp(ragged, row_sparse):
    """Forward mode through a gradient op (``Pkm[Ragged]EmbeddingBag[Sparse]Grad``): the jvp of the
    composite's gradient, taken by a ForwardAccumulator of its own. A tf.function called under an
    accumulator (``tf.vectorized_map`` is one) builds its backward and takes the jvps of the gradient
    ops there; TF's generic jvp transposes the op's gradient, whose row-sparse table part (kept so
    that a gradient penalty does not densify a large table) it cannot take ("'IndexedSlices' object
    has no attribute '_id'")."""
    def jvp(attr_tuple, inputs, outputs, tangents):
        attrs = dict(zip(attr_tuple[::2], attr_tuple[1::2]))
        combiner = attrs["combiner"].decode() if isinstance(attrs["combiner"], bytes) else attrs["combiner"]
        grad, params, weights = inputs[0], inputs[1], inputs[-1]
        indices = tf.RaggedTensor.from_row_splits(inputs[2], inputs[3], validate=False) if ragged else inputs[2]
        primals = [grad, params] + ([weights] if attrs["has_weights"] else [])
        primal_tangents = [tf.zeros_like(p) if t is None else t for p, t in zip(primals, [tangents[0], tangents[1],
                                                                                           tangents[-1]])]
        with _forwardprop_state_reset(), tf.autodiff.ForwardAccumulator(primals, primal_tangents) as acc:
            bag_weights = None
            if attrs["has_weights"]:
                bag_weights = indices.with_flat_values(weights) if ragged else weights
            d_params, d_weights = _first_order(grad, params, indices, bag_weights, combiner)
        t_params = acc.jvp(d_params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        t_weights = (acc.jvp(d_weights, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                     if d_weights is not None else tf.zeros_like(outputs[-1]))
        if row_sparse:  # (rows, row gradients, d_weights): the rows are integers
            return [None, tf.gather(t_params, outputs[0]), t_weights]
        return [t_params, t_weights]
    return jvp


def _register_jvps():
    """The jvps of the resource lookup and of the gradient ops in TF's private
    table of special cases (there is no public registry). Where TF lacks it, a
    ForwardAccumulator through a sparse_gradient=True variable lookup, or around
    a tf.function (tf.vectorized_map) of the op, fails in TF (IndexedSlices), as it
    did before these jvps existed; nothing else depends on them."""
    try:
        from tensorflow.python.eager import forwardprop

        special_cases = forwardprop._SPECIAL_CASES
    except (ImportError, AttributeError):
        return
    special_cases["PkmResourceEmbeddingBag"] = _resource_lookup_jvp
    for ragged in (False, True):
        for row_sparse in (False, True):
            name = f"Pkm{'Ragged' if ragged else ''}EmbeddingBag{'Sparse' if row_sparse else ''}Grad"
            special_cases[name] = _gradient_op_jvp(ragged, row_sparse)


def register():
    """Registers the gradients of the gradient ops and the jvp of the resource
    lookup (called once, by _fused)."""
    _register_jvps()

    def dense_bags(op):
        return lambda weights: (op.inputs[2], weights)

    def ragged_bags(op):
        def bags(weights):
            values, splits = op.inputs[2], op.inputs[3]
            indices = tf.RaggedTensor.from_row_splits(values, splits, validate=False)
            return indices, None if weights is None else indices.with_flat_values(weights)
        return bags

    @tf.RegisterGradient("PkmEmbeddingBagGrad")
    def _embedding_bag_grad_grad(op, d_params_up, d_weights_up):
        d_grad, d_params, d_weights = _gradients(op, op.inputs[1], dense_bags(op), d_params_up, d_weights_up)
        return [d_grad, d_params, None, d_weights]

    @tf.RegisterGradient("PkmRaggedEmbeddingBagGrad")
    def _ragged_embedding_bag_grad_grad(op, d_params_up, d_weights_up):
        d_grad, d_params, d_weights = _gradients(op, op.inputs[1], ragged_bags(op), d_params_up, d_weights_up)
        return [d_grad, d_params, None, None, d_weights]

    @tf.RegisterGradient("PkmEmbeddingBagSparseGrad")
    def _embedding_bag_sparse_grad_grad(op, _, row_grads_up, d_weights_up):
        params = op.inputs[1]
        d_grad, d_params, d_weights = _gradients(
            op, params, dense_bags(op), _dense_rows(op.outputs[0], row_grads_up, params), d_weights_up)
        return [d_grad, d_params, None, d_weights]

    @tf.RegisterGradient("PkmRaggedEmbeddingBagSparseGrad")
    def _ragged_embedding_bag_sparse_grad_grad(op, _, row_grads_up, d_weights_up):
        params = op.inputs[1]
        d_grad, d_params, d_weights = _gradients(
            op, params, ragged_bags(op), _dense_rows(op.outputs[0], row_grads_up, params), d_weights_up)
        return [d_grad, d_params, None, None, d_weights]

    @tf.RegisterGradient("PkmResourceEmbeddingBagSparseGrad")
    def _resource_embedding_bag_sparse_grad_grad(op, _, row_grads_up, d_weights_up):
        from tensorflow.python.ops import resource_variable_ops

        # The table as read now; its gradient goes to the variable through the handle.
        params = resource_variable_ops.read_variable_op(op.inputs[1], op.get_attr("dtype"))
        d_grad, d_params, d_weights = _gradients(
            op, params, dense_bags(op), _dense_rows(op.outputs[0], row_grads_up, params), d_weights_up)
        return [d_grad, d_params, None, d_weights]
