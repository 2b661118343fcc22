"""What a batch is padded with (BatchScheduler in-process, a fake signature that records
the merged inputs it ran), against TF Serving's batching_session.cc / batching_util.cc."""
import threading
import time

import numpy as np
from google.protobuf import text_format

from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler


class _Recording:
    name = "serving_default"

    def __init__(self):
        self.merged = []

    def run(self, inputs, output_filter=()):
        self.merged.append({k: v.copy() for k, v in inputs.items()})
        return {"y": inputs["x"].reshape(inputs["x"].shape[0], -1).sum(axis=1)}


def _run_together(text, requests, model):
    """Sends requests in order, 50 ms apart, into one batch; returns their answers."""
    sched = BatchScheduler(text_format.Parse(text, protos.BatchingParameters()))
    answers = [None] * len(requests)

    def call(i):
        answers[i] = sched.run("s", model, {"x": requests[i]}, deadline=time.monotonic() + 10)
    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(10)
    finally:
        sched.stop(timeout=10)
    return answers


def test_rows_added_for_allowed_batch_sizes_copy_the_last_tasks_first_row():
    """MergeInputTensors pads with tensor_vec.back().Slice(0, 1): the last task's first row
    (it was the first task's here)."""
    model = _Recording()
    first = np.array([[1.0, 1.0], [2.0, 2.0]])
    last = np.array([[7.0, 8.0]])
    answers = _run_together("max_batch_size { value: 4 } allowed_batch_sizes: 4 num_batch_threads { value: 1 } "
                            "batch_timeout_micros { value: 300000 }", [first, last], model)
    (merged,) = model.merged
    np.testing.assert_array_equal(merged["x"], np.concatenate([first, last, last[:1]]))
    np.testing.assert_array_equal(answers[0]["y"], first.sum(axis=1))
    np.testing.assert_array_equal(answers[1]["y"], last.sum(axis=1))
