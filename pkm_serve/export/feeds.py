"""What each signature input of a SavedModel is fed with, read off the graph.

Verification needs inputs the model accepts. A string input that reaches a
ParseExample/ParseExampleV2/ParseSingleExample op is a batch of serialized
tf.Examples: the parse op's own keys, types and dense shapes say which
features to write. Other string inputs (raw text) are drawn from the model's
own vocabularies (string constants of its lookup tables), so a TextVectorization
or StringLookup finds known tokens. Everything here reads the proto; no graph is
built.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Tuple

import numpy as np
from tensorflow.core.framework import attr_value_pb2, types_pb2

from pkm_serve.export.composites import ragged_row_lengths, signature_composites
from pkm_serve.export.lookup_keys import (first_strings, model_int_keys, resource_sources,
                                         table_file_words, table_int_keys, table_words)
from pkm_serve.export.graph import FunctionGraph, Ref
from pkm_serve.export.input_walk import PARSE_OPS, SHAPE_OPS as _SHAPE_OPS, ops_fed_by as _parse_ops_fed_by

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
TABLE_INIT_OPS = ("LookupTableImportV2", "InitializeTableV2")
# Ops that cut a string into tokens (text goes in) and ops that take each string
# whole as a key (a token goes in): which of them a string input reaches says
# which kind of string to generate for it.
SPLIT_OPS = ("StringSplit", "StringSplitV2", "RegexSplitWithOffsets", "WhitespaceTokenizeWithOffsets",
             "WhitespaceTokenizeWithOffsetsV2", "UnicodeScriptTokenizeWithOffsets", "UnicodeDecode",
             "UnicodeDecodeWithOffsets", "SentencepieceTokenizeOp", "StringNGrams")
KEY_OPS = ("LookupTableFindV2", "LookupTableFind", "StringToHashBucketFast", "StringToHashBucketStrong",
           "StringToHashBucket")
# Constants that name checkpoint entries, not words of the model.
SAVE_OPS = ("SaveV2", "RestoreV2", "MergeV2Checkpoints", "SaveSlices", "RestoreSlice")
# Where an input's values go on when its graph is followed: to outputs of its own kind
# (a variant may hold it: a ragged map_fn, a TensorList; input_walk.py).
_INT_FLOW = frozenset((types_pb2.DT_INT64, types_pb2.DT_INT32, types_pb2.DT_VARIANT)).__contains__
_STRING_FLOW = frozenset((types_pb2.DT_STRING, types_pb2.DT_VARIANT)).__contains__
_CONTROL_FLOW_OPS = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase")
_MAX_VOCABULARY = 2000


@dataclasses.dataclass(frozen=True)
class ExampleFeature:
    """One feature a parse op reads: `kind` dense | sparse | ragged."""

    key: str
    kind: str
    dtype: int                       # DT_INT64 | DT_FLOAT | DT_STRING
    shape: Tuple[int, ...] = ()      # dense: per-example shape (-1: variable length)


@dataclasses.dataclass
class Feed:
    """How to feed one signature input: `features` for serialized tf.Examples
    (None for any other input); `vocabulary` words for string values."""

    features: Optional[List[ExampleFeature]] = None
    vocabulary: List[bytes] = dataclasses.field(default_factory=list)
    tokens: bool = False  # each string is one token (a lookup key), not text to split
    sparse_width: Optional[int] = None  # a SparseTensor's dense_shape: columns are rows of a [N, D] table
    # on the first part of a RaggedTensor / SparseTensor the signature takes flattened:
    # ("ragged", values, row_splits) or ("sparse", indices, values, dense_shape)
    composite: Optional[Tuple[str, ...]] = None
    # on a RaggedTensor's flat values: each ragged dimension's row length where its spec fixes it, else None
    row_lengths: Optional[Tuple[Optional[int], ...]] = None
    int_keys: List[int] = dataclasses.field(default_factory=list)  # integer ids that are lookup-table keys
    # "count": a segment op's num_segments (fed the bound of the segment ids generated); "positions": one whose
    # segment ids the graph computes from shapes (fed the most values an input has); "sorted": the segment
    # ids of an op that needs them sorted (tf.sparse.segment_sum, tf.math.segment_sum); "ids": an unsorted one's
    segments: Optional[str] = None


class ModelTables:
    """What every signature's feeds read of the model's lookup tables, each worked out once, when
    first asked (string constants decoded, vocabulary files read)."""

    def __init__(self, meta_graph, assets_dir: Optional[str] = None):
        self.meta_graph, self.assets_dir = meta_graph, assets_dir

    @functools.cached_property
    def file_words(self):
        return table_file_words(self.meta_graph, self.assets_dir) if self.assets_dir else {}

    @functools.cached_property
    def vocabulary(self):
        # Words of vocabulary files where no string constant has any (a TextVectorization(vocabulary=PATH))
        return model_vocabulary(self.meta_graph) or sorted(
            {w for words in self.file_words.values() for w in words})[:_MAX_VOCABULARY]

    @functools.cached_property
    def keys_of_table(self):
        return table_int_keys(self.meta_graph)

    @functools.cached_property
    def int_keys(self):
        return model_int_keys(self.keys_of_table)

    @functools.cached_property
    def sources(self):
        return resource_sources(self.meta_graph)

    @functools.cached_property
    def words_of_table(self):
        return {**table_words(self.meta_graph), **self.file_words}


def signature_feeds(proto, signature: str, assets_dir: Optional[str] = None,
                    tables: Optional[ModelTables] = None) -> Dict[str, Feed]:
    """{input name: Feed} for the string inputs of one signature, integer ids
    that are table keys or sparse shapes, and the parts of composites
    (`assets_dir`: the SavedModel's assets/, where vocabulary files are; `tables`:
    the model's, shared by the calls for its several signatures)."""
    meta_graph = proto.meta_graphs[0]
    sig = meta_graph.signature_def.get(signature)
    if sig is None:
        return {}
    tables = tables or ModelTables(meta_graph, assets_dir)
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    sigs = {name: f.signature for name, f in library.items()}
    graphs: Dict[str, FunctionGraph] = {}
    int_keys = tables.int_keys
    feeds = {}
    partitions = _row_splits_placeholders(meta_graph, sig, signature)
    for name, info in sig.inputs.items():
        placeholder = info.name.split(":")[0]
        if info.dtype == types_pb2.DT_INT64:
            width = _sparse_matmul_width(meta_graph.graph_def, placeholder, library, sigs, graphs)
            if width is not None:
                feeds[name] = Feed(sparse_width=width)
        role = _segment_role(meta_graph.graph_def, placeholder, library, sigs, graphs, partitions) \
            if info.dtype in (types_pb2.DT_INT64, types_pb2.DT_INT32) else None
        if role:
            feeds[name] = dataclasses.replace(feeds.get(name, Feed()), segments=role)
        lookups = int_keys and info.dtype in (types_pb2.DT_INT64, types_pb2.DT_INT32) and _parse_ops_fed_by(
            meta_graph.graph_def, placeholder, library, sigs, graphs, follow=_INT_FLOW,
            accept=lambda node, pos: node.op in ("LookupTableFindV2", "LookupTableFind") and pos == 1)
        if lookups:
            feeds[name] = dataclasses.replace(feeds.get(name, Feed()),
                                              int_keys=_keys_of(lookups, tables.keys_of_table, tables.sources)
                                              or int_keys)
        if info.dtype != types_pb2.DT_STRING:
            continue
        parses = _parse_ops_fed_by(meta_graph.graph_def, placeholder, library, sigs, graphs)
        features = None
        if parses:
            features = []
            for fg, node in parses:
                for feature in parse_op_features(fg, node):
                    if feature.key not in {f.key for f in features}:
                        features.append(feature)
        lookups = None if parses else _token_lookups(meta_graph.graph_def, placeholder, library, sigs, graphs)
        # The words of the tables it is looked up in (text: its tokens'), where the graph says which.
        found = lookups if lookups is not None or parses else _parse_ops_fed_by(
            meta_graph.graph_def, placeholder, library, sigs, graphs, follow=_STRING_FLOW, accept=_is_lookup)
        words = _keys_of(found, tables.words_of_table, tables.sources) if found else []
        feeds[name] = Feed(features=features, vocabulary=words or tables.vocabulary, tokens=lookups is not None)
    for group in signature_composites(meta_graph, signature):
        first = group[1]
        feeds[first] = dataclasses.replace(feeds.get(first, Feed()), composite=group)
    for first, lengths in ragged_row_lengths(meta_graph, signature).items():
        feeds[first] = dataclasses.replace(feeds.get(first, Feed()), row_lengths=lengths)
    return feeds


def _row_splits_placeholders(meta_graph, sig, signature: str) -> frozenset:
    """The placeholders of ragged row_splits (segment ids computed from them, value_rowids(), are positions in
    the batch): read off the saved function's RaggedTensorSpec, else NAME_1 beside a rank-1 NAME as
    tf.function flattens a rank-2 RaggedTensor (verify._ragged_groups)."""
    keys = {key for kind, _, *splits in signature_composites(meta_graph, signature) if kind == "ragged"
            for key in splits}
    ints = (types_pb2.DT_INT64, types_pb2.DT_INT32)
    keys |= {name + "_1" for name, info in sig.inputs.items() if name + "_1" in sig.inputs and
             name + "_2" not in sig.inputs and len(info.tensor_shape.dim) == 1 and
             sig.inputs[name + "_1"].dtype in ints and len(sig.inputs[name + "_1"].tensor_shape.dim) == 1}
    return frozenset(sig.inputs[key].name.split(":")[0] for key in keys if key in sig.inputs)


def _is_lookup(node, pos: int) -> bool:
    return node.op in ("LookupTableFindV2", "LookupTableFind") and pos == 1


def _keys_of(lookups, keys_of_table, sources) -> list:
    """The keys (ints or words) of the tables these lookups read, where each lookup's table is
    a top-level table (a model with several: user ids 1001.. and item ids
    1..50 into tables of their own); [] where one is not."""
    keys = set()
    for found in lookups:
        fg, node = found
        ref = fg.inputs(node)[0]
        while fg.producer(ref) is not None and fg.producer(ref).op == "Identity":
            ref = fg.inputs(fg.producer(ref))[0]
        # The call path's own tables where the walk knows them: a nested function called with one table
        # here and another there reads only this one on this path.
        bound = getattr(found, "bindings", {}).get(ref.node)
        tables = (bound or sources.get((fg.fdef.signature.name, ref.node))) if fg.producer(ref) is None else None
        if not tables or not all(t in keys_of_table for t in tables):
            return []
        keys.update(k for t in tables for k in keys_of_table[t])
    return sorted(keys)


# {op: input position} of num_segments, of segment ids that must be sorted, and of other segment ids
_NUM_SEGMENTS = {**{op: 2 for op in ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                                     "UnsortedSegmentProd")},
                 **{op: 3 for op in ("SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
                                     "SparseSegmentSqrtNWithNumSegments")}}
_SORTED_SEGMENT_IDS = {**{op: 1 for op in ("SegmentSum", "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd")},
                       **{op: 2 for op in ("SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN")},
                       **{op + "WithNumSegments": 2 for op in ("SparseSegmentSum", "SparseSegmentMean",
                                                                "SparseSegmentSqrtN")}}
_SEGMENT_IDS = {op: 1 for op in ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                                 "UnsortedSegmentProd")}


def _segment_role(graph_def, placeholder: str, library, sigs, graphs, partitions=frozenset()) -> Optional[str]:
    """"count" where the input is a segment op's num_segments, "positions" where it is one whose segment ids
    the graph computes from shapes alone (tf.repeat(tf.range(B), K)), "sorted" where it is segment ids an op
    needs sorted, "ids" where it is other segment ids, as it is passed on (through Identity, Cast and calls):
    random ids in [0, rows) as num_segments were below some segment id, unsorted ids refused ("segment ids
    must be < num_segments", "... not increasing")."""
    for role, positions in (("count", _NUM_SEGMENTS), ("sorted", _SORTED_SEGMENT_IDS), ("ids", _SEGMENT_IDS)):
        found = _parse_ops_fed_by(graph_def, placeholder, library, sigs, graphs, through=("Cast",),
                                  accept=lambda node, pos, at=positions: at.get(node.op) == pos)
        if found and role == "count" and all(_ids_from_shapes(item, partitions) for item in found):
            return "positions"
        if found:
            return role
    return None


def _ids_from_shapes(reached, partitions) -> bool:
    """The segment op's segment ids are computed from constants, the shapes of the function's inputs and
    ragged row_splits (the placeholders `partitions`) only: positions in the batch (tf.repeat(tf.range(B), K),
    ragged.value_rowids()), never from other values nor a call's outputs."""
    fg, node = reached
    seg_position = next(at[node.op] for at in (_SORTED_SEGMENT_IDS, _SEGMENT_IDS) if node.op in at)
    refs, seen = [fg.inputs(node)[seg_position]], set()
    while refs:
        ref = refs.pop()
        producer = fg.producer(ref)
        if ref in seen or (producer is not None and producer.op in _SHAPE_OPS):
            continue
        seen.add(ref)
        if producer is None and reached.bindings.get(ref.node) and reached.bindings[ref.node] <= partitions:
            continue
        if producer is None or producer.op in CALL_OPS + _CONTROL_FLOW_OPS or producer.op in fg.library_sigs:
            return False
        refs.extend(fg.inputs(producer))
    return True


def _sparse_matmul_width(graph_def, placeholder: str, library, sigs, graphs) -> Optional[int]:
    """N where the input is the dense_shape of a SparseTensor that
    sparse_dense_matmul multiplies by an [N, D] table: its columns must be < N."""
    for fg, node in _parse_ops_fed_by(graph_def, placeholder, library, sigs, graphs,
                                      accept=lambda node, pos: node.op == "SparseTensorDenseMatMul" and pos == 2):
        table = fg.shape(fg.inputs(node)[3])
        adjoint_b = "adjoint_b" in node.attr and node.attr["adjoint_b"].b
        if table.rank == 2 and table[1 if adjoint_b else 0] is not None:
            return int(table[1 if adjoint_b else 0])
    return None


def _token_lookups(graph_def, placeholder: str, library, sigs, graphs):
    """The lookups ([(FunctionGraph, node)], maybe none: a hash op) a string
    input reaches as whole strings, through any ops but no tokenizer (a
    [batch, K] list of item ids looked up in a StaticHashTable or StringLookup);
    None where it is text or reaches no key op: text would be one unknown key
    per cell there, so verification would barely read the table."""
    found = _parse_ops_fed_by(graph_def, placeholder, library, sigs, graphs,
                              accept=lambda node, pos: node.op in SPLIT_OPS + KEY_OPS, follow=_STRING_FLOW)
    reached = {node.op for _, node in found}
    if not reached & set(KEY_OPS) or reached & set(SPLIT_OPS):
        return None
    return [item for item in found if item[1].op in ("LookupTableFindV2", "LookupTableFind")]


def _strings(fg: FunctionGraph, ref: Ref) -> List[str]:
    nodes: List[str] = []
    node = fg.producer(ref)
    while node is not None and node.op == "Identity":
        nodes.append(node.name)
        ref = fg.inputs(node)[0]
        node = fg.producer(ref)
    value = fg.const_value(ref)
    if value is None:
        raise ValueError(f"parse keys {fg.render(ref)} are not constants")
    return [v.decode() for v in np.ravel(value)]


def parse_op_features(fg: FunctionGraph, node) -> List[ExampleFeature]:
    """The features one parse op reads, from its attrs and constant keys."""
    # Read through a copy: indexing a proto map inserts missing (default) keys.
    attr = attr_value_pb2.NameAttrList(attr=node.attr).attr
    for key in ("sparse_types", "Tdense", "dense_shapes", "ragged_value_types",
                "Nsparse", "Ndense", "sparse_keys", "dense_keys"):
        attr[key]  # noqa: B018 - defaults stripped at save time read as empty
    ins = fg.inputs(node)
    sparse_types = list(attr["sparse_types"].list.type)
    dense_types = list(attr["Tdense"].list.type)
    dense_shapes = [tuple(d.size for d in s.dim) for s in attr["dense_shapes"].list.shape]
    ragged_types: List[int] = []
    if node.op == "ParseExampleV2":
        sparse_keys, dense_keys = _strings(fg, ins[2]), _strings(fg, ins[3])
        ragged_keys = _strings(fg, ins[4])
        ragged_types = list(attr["ragged_value_types"].list.type)
    elif node.op == "ParseExample":
        n_sparse, n_dense = attr["Nsparse"].i, attr["Ndense"].i
        sparse_keys = [k for r in ins[2:2 + n_sparse] for k in _strings(fg, r)]
        dense_keys = [k for r in ins[2 + n_sparse:2 + n_sparse + n_dense]
                      for k in _strings(fg, r)]
        ragged_keys = []
    else:
        sparse_keys = [k.decode() for k in attr["sparse_keys"].list.s]
        dense_keys = [k.decode() for k in attr["dense_keys"].list.s]
        ragged_keys = []
    features = [ExampleFeature(k, "dense", t, s)
                for k, t, s in zip(dense_keys, dense_types, dense_shapes)]
    features += [ExampleFeature(k, "sparse", t) for k, t in zip(sparse_keys, sparse_types)]
    features += [ExampleFeature(k, "ragged", t) for k, t in zip(ragged_keys, ragged_types)]
    return features


def model_vocabulary(meta_graph) -> List[bytes]:
    """Words of the model's string lookup tables: the string constants that
    initialise them, or, where they come in from outside a function (Keras
    captures them), every rank-1 string constant of the model that is not a
    list of parse keys."""
    words: List[bytes] = []
    top = meta_graph.graph_def.node
    saved_names = _save_inputs(top)
    candidates = [n for n in top if n.op == "Const" and n.name not in saved_names]
    for fdef in meta_graph.graph_def.library.function:
        consts = {n.name: n for n in fdef.node_def if n.op == "Const"}
        not_words = _save_inputs(fdef.node_def)
        for n in fdef.node_def:
            if n.op in PARSE_OPS:
                not_words.update(i.split(":")[0] for i in n.input)
        candidates.extend(c for name, c in consts.items() if name not in not_words)
    for node in candidates:
        tensor = node.attr["value"].tensor
        if tensor.dtype != types_pb2.DT_STRING or len(tensor.tensor_shape.dim) != 1:
            continue
        values = first_strings(tensor, 8 * _MAX_VOCABULARY)
        if len(values) < 2:
            continue
        words.extend(v for v in values if 0 < len(v) <= 64)
        if len(words) >= _MAX_VOCABULARY:
            break
    return sorted(set(words))[:_MAX_VOCABULARY]


def _save_inputs(nodes) -> set:
    """Names of the nodes feeding checkpoint ops (their tensor names are keys
    such as 'table/.ATTRIBUTES/VARIABLE_VALUE', no words of the model)."""
    return {i.lstrip("^").split(":")[0] for n in nodes if n.op in SAVE_OPS for i in n.input}


def _words(rng, vocabulary: List[bytes], count: int) -> List[bytes]:
    """Mostly known words, one in five out of vocabulary (OOV buckets are real too)."""
    out = []
    for _ in range(count):
        if vocabulary and rng.random() < 0.8:
            out.append(vocabulary[int(rng.integers(len(vocabulary)))])
        else:
            out.append(b"w%d" % int(rng.integers(1000)))
    return out


def make_text(rng, vocabulary: List[bytes], shape) -> np.ndarray:
    """Strings of 1-6 words each."""
    flat = [b" ".join(_words(rng, vocabulary, int(rng.integers(1, 7))))
            for _ in range(int(np.prod(shape, dtype=np.int64)))]
    return np.array(flat, dtype=object).reshape(shape)


def make_tokens(rng, vocabulary: List[bytes], shape) -> np.ndarray:
    """One word per string; a row of the last axis (K > 1 ids of a bag) ends
    in 0 to K-1 empty strings, and the middle row is all empty, as a padded
    batch of ids (tf.data's padded_batch pads strings with b"", which a
    StringLookup(mask_token="") masks)."""
    out = np.array(_words(rng, vocabulary, int(np.prod(shape, dtype=np.int64))) or [b""],
                   dtype=object)[:int(np.prod(shape, dtype=np.int64))].reshape(shape)
    if len(shape) < 2 or shape[-1] < 2:
        return out
    rows = out.reshape(-1, shape[-1])
    for r, row in enumerate(rows):
        keep = 0 if (len(rows) > 2 and r == len(rows) // 2) else int(rng.integers(1, shape[-1] + 1))
        row[keep:] = b""
    return rows.reshape(shape)


def make_examples(rng, features: List[ExampleFeature], vocabulary: List[bytes],
                  batch: int, index_limit: int) -> np.ndarray:
    """[batch] serialized tf.Examples holding every feature. Variable-length
    features share one count per example (weighted columns pair an id list with
    a weight list of the same length); one example in the middle has none."""
    from tensorflow.core.example import example_pb2, feature_pb2

    out = []
    for b in range(batch):
        count = 0 if (batch > 2 and b == batch // 2) else int(rng.integers(1, 5))
        example = example_pb2.Example()
        for feature in features:
            if feature.kind == "dense":
                shape = [2 if d < 0 else d for d in feature.shape]
                n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            else:
                n = count
            entry: feature_pb2.Feature = example.features.feature[feature.key]
            if feature.dtype == types_pb2.DT_STRING:
                entry.bytes_list.value.extend(_words(rng, vocabulary, n))
            elif feature.dtype == types_pb2.DT_INT64:
                entry.int64_list.value.extend(
                    int(v) for v in rng.integers(0, max(index_limit, 1), n))
            else:
                entry.float_list.value.extend(float(v) for v in rng.uniform(0.5, 1.5, n))
        out.append(example.SerializeToString())
    return np.array(out, dtype=object)
