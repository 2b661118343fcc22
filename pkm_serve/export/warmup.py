"""`--warmup-requests N`: DST/<version>/assets.extra/tf_serving_warmup_requests.

TF Serving's warmup file (and `pkm-serve serve`'s, pkm_serve.serving.servable):
a TFRecord file of PredictionLog records, each a PredictRequest that the
server replays on the version before it serves it, so the first real requests
do not pay for graph initialisation and allocations. Here: N requests per
verified signature, built as the verification's inputs are (request 1 is the
very batch the signature was verified on, requests 2..N the same generator
with the next seeds; --sample-inputs makes every request those samples). Each
request is run on the exported model before the file is written: a record the
model refuses would fail the version's load in the server. A signature that
writes variables or tables gets none (its replay at each load would change the
model); no file is written where every signature does.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from pkm_serve.export import verify as V
from pkm_serve.export.errors import ExportError

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")


def check_request_count(src: str, count: Optional[int]) -> None:
    """Refuses, before anything is written, a count < 1 and a SRC that has a
    warmup file of its own (the export copies it: it would be replaced)."""
    if count is None:
        return
    if count < 1:
        raise ExportError(f"--warmup-requests must be >= 1, got {count}")
    if os.path.exists(os.path.join(src, WARMUP_FILE)):
        raise ExportError(f"{src} has its own {WARMUP_FILE}, which the export copies as it is: drop "
                          "--warmup-requests to keep it, or remove it from SRC to write new ones")


# Ops that change a model's state: a signature holding one is not warmed up, as the
# server would replay it at every load of the version (TF Serving does the same
# with whatever the file holds) and change the model before its first request.
_STATE_WRITERS = ("Assign", "ResourceScatter", "ResourceApply", "ResourceSparseApply",
                  "ResourceStridedSliceAssign", "LookupTableInsert", "LookupTableImport",
                  "LookupTableRemove", "PkmEmbeddingBagFusedUpdate")


def state_writers(fn) -> list:
    """The op types of `fn` (a concrete function, its nested functions too) that write
    variables or tables."""
    graph_def = fn.graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sorted({n.op for n in nodes if n.op.startswith(_STATE_WRITERS)})


def _request(name: str, model_name: str, inputs: dict):
    import tensorflow as tf
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name=model_name, signature_name=name))
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))


def write_warmup_requests(export_dir: str, signatures: Sequence[str], count: int, index_limit: int,
                          samples, batch_size: int, feeds: dict, model_name: str) -> int:
    """Writes `count` PredictionLog records per signature that writes no state
    into export_dir's warmup file; returns (records written, {signature left
    out: the op types it writes state with})."""
    import tensorflow as tf

    model = tf.saved_model.load(export_dir)
    records, skipped = [], {}
    for name in signatures:
        fn = model.signatures[name]
        writers = state_writers(fn)
        if writers:
            skipped[name] = writers
            continue
        specs = V.signature_input_specs(fn)
        for i in range(count):
            inputs = (V.sample_inputs_for(name, specs, samples) if samples is not None else
                      V.generate_inputs(specs, index_limit, batch_size, seed=i, feeds=feeds.get(name)))
            try:
                fn(**inputs)
            except tf.errors.OpError as e:
                raise ExportError(f"--warmup-requests: signature {name!r} fails on warmup request {i + 1}: "
                                  f"{V.error_line(e.message)}") from None
            records.append(_request(name, model_name, inputs).SerializeToString())
    if records:
        path = os.path.join(export_dir, WARMUP_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tf.io.TFRecordWriter(path) as writer:
            for record in records:
                writer.write(record)
    return len(records), skipped
