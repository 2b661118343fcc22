"""Which flat signature inputs are the parts of one RaggedTensor or SparseTensor.

A signature takes only dense tensors, so a model called on composite tensors
(tf_keras `Input(ragged=True)` / `Input(sparse=True)`) is saved with each
composite flattened into numbered inputs: a tf_keras model of ragged ids and
ragged weights gets `args_0, args_0_1` (ids' values, row_splits) and
`args_0_2, args_0_3` (the weights'). Names alone cannot tell those apart from
dense inputs; the function the signature calls can: its saved input signature
(the SavedModel's object graph) holds the RaggedTensorSpec / SparseTensorSpec,
and its call node takes their components in flattened order.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def _decoded_specs(concrete):
    """The flat leaves of a saved function's input signature that are inputs
    (TypeSpecs), in call order; None where it cannot be decoded."""
    import tensorflow as tf
    from tensorflow.python.saved_model import nested_structure_coder

    try:
        structure = nested_structure_coder.decode_proto(concrete.canonicalized_input_signature)
    except Exception:  # noqa: BLE001 - an older or unknown encoding: no groups, as before
        return None
    return [leaf for leaf in tf.nest.flatten(structure) if isinstance(leaf, tf.TypeSpec)]


def _leaves_of_call(specs, arg_keys: List[str]) -> List[Tuple[object, Tuple[str, ...]]]:
    """(spec, component keys) per composite leaf, given the signature key
    (or None) of each call input in order."""
    import tensorflow as tf

    leaves, pos = [], 0
    for spec in specs:
        count = len(tf.nest.flatten(spec, expand_composites=True))
        keys = arg_keys[pos:pos + count]
        pos += count
        if len(keys) != count or None in keys:
            continue
        if (isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank >= 1) or \
                isinstance(spec, tf.SparseTensorSpec):
            leaves.append((spec, tuple(keys)))
    return leaves


def _group(spec, keys: Tuple[str, ...]) -> Tuple[str, ...]:
    import tensorflow as tf

    # ragged: flat values, then row_splits outermost first
    return ("ragged" if isinstance(spec, tf.RaggedTensorSpec) else "sparse",) + keys


def signature_composites(meta_graph, signature: str) -> List[Tuple[str, ...]]:
    """[("ragged", values, row_splits...) | ("sparse", indices, values, dense_shape)]
    of signature input keys, read off the function the signature's wrapper
    calls; [] where nothing says so."""
    return [_group(spec, keys) for spec, keys in _signature_leaves(meta_graph, signature)]


def ragged_row_lengths(meta_graph, signature: str) -> Dict[str, Tuple[Optional[int], ...]]:
    """{flat values key: the row length of each ragged dimension, outermost first, where the
    RaggedTensorSpec fixes it (None where rows vary)}: a spec of shape [None, 3, None] takes
    row_splits [0, 3, 6, ...] outermost (tf.RaggedTensor.from_uniform_row_length)."""
    import tensorflow as tf

    lengths = {}
    for spec, keys in _signature_leaves(meta_graph, signature):
        if isinstance(spec, tf.RaggedTensorSpec):
            dims = spec.shape.as_list()[1:spec.ragged_rank + 1] if spec.shape.rank is not None else []
            lengths[keys[0]] = tuple(dims) + (None,) * (spec.ragged_rank - len(dims))
    return lengths


def _signature_leaves(meta_graph, signature: str) -> List[Tuple[object, Tuple[str, ...]]]:
    sig = meta_graph.signature_def.get(signature)
    if sig is None:
        return []
    key_of = {info.name.split(":")[0]: key for key, info in sig.inputs.items()}
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    saved = meta_graph.object_graph_def.concrete_functions
    leaves: List[Tuple[object, Tuple[str, ...]]] = []
    for node in meta_graph.graph_def.node:
        wrapper = library.get(node.attr["f"].func.name) if node.op in CALL_OPS else None
        if wrapper is None or not any(i.split(":")[0] in key_of for i in node.input):
            continue
        # wrapper arg name -> signature key, through the top-level call's inputs
        arg_key: Dict[str, str] = {}
        for arg, text in zip(wrapper.signature.input_arg, node.input):
            if text.split(":")[0] in key_of:
                arg_key[arg.name] = key_of[text.split(":")[0]]
        for inner in wrapper.node_def:
            if inner.op not in CALL_OPS or inner.attr["f"].func.name not in saved:
                continue
            specs = _decoded_specs(saved[inner.attr["f"].func.name])
            if specs:
                leaves += _leaves_of_call(specs, [arg_key.get(i.split(":")[0]) for i in inner.input])
    return leaves
