"""enable_large_batch_splitting + max_execution_batch_size (BatchScheduler in-process, with
a fake signature that records the rows of every run): max_batch_size bounds a request,
max_execution_batch_size each run, and a split request's answer is its rows' answers in
order. The reference is numpy on the request alone."""
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchOptions, BatchScheduler
from pkm_serve.serving.errors import ServingError
from serving_helpers import run_staggered


class _RowwiseModel:
    """y = 3x + 1 per row (so a row answered from another row's place shows), and the
    rows of every run it was given."""
    name = "serving_default"

    def __init__(self, gate=None):
        self.runs = []
        self.gate = gate

    def run(self, inputs, output_filter=()):
        if self.gate is not None:
            self.gate.wait(10)
        x = inputs["x"]
        if (x < 0).any():
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "negative input")
        self.runs.append(x.shape[0])
        return {"y": 3 * x + 1, "row_sum": x.sum(axis=1)}


def _params(text):
    return text_format.Parse(text, protos.BatchingParameters())


def _scheduler(text):
    return BatchScheduler(_params(text))


def _rows(n, start=0):
    return np.arange(start, start + 2 * n, dtype=np.float64).reshape(n, 2)


def _assert_answers(inputs, got):
    np.testing.assert_array_equal(got["y"], 3 * inputs + 1)
    np.testing.assert_array_equal(got["row_sum"], inputs.sum(axis=1))


SPLIT = ("max_batch_size { value: 10 } enable_large_batch_splitting { value: true } "
         "max_execution_batch_size { value: 3 } ")


def test_a_large_request_runs_in_pieces_and_is_answered_in_order():
    sched, model = _scheduler(SPLIT + "num_batch_threads { value: 2 }"), _RowwiseModel()
    try:
        x = _rows(10)
        _assert_answers(x, sched.run("s", model, {"x": x}))
        assert sorted(model.runs) == [1, 3, 3, 3]
    finally:
        sched.stop(timeout=10)


def test_a_request_first_fills_the_open_batch():
    """SharedBatchScheduler's split: 2 rows wait in the open batch; a 5-row request puts 1
    row into it (closing it at 3), then 3, then 1."""
    sched = _scheduler(SPLIT + "batch_timeout_micros { value: 300000 } num_batch_threads { value: 1 }")
    model, answers = _RowwiseModel(), {}
    first, second = _rows(2), _rows(5, start=100)

    def call(name, x):
        answers[name] = sched.run("s", model, {"x": x}, deadline=time.monotonic() + 10)
    try:
        t = threading.Thread(target=call, args=("first", first))
        t.start()
        time.sleep(0.05)
        call("second", second)
        t.join(10)
        _assert_answers(first, answers["first"])
        _assert_answers(second, answers["second"])
        assert model.runs == [3, 3, 1]
    finally:
        sched.stop(timeout=10)


def test_without_splitting_max_execution_batch_size_is_ignored_as_upstream(caplog):
    with caplog.at_level(logging.WARNING, logger="pkm_serve.serving"):
        opts = BatchOptions(_params("max_batch_size { value: 8 } max_execution_batch_size { value: 2 }"))
    assert opts.max_execution_batch_size == 8 and not opts.split_large_batches
    assert "max_execution_batch_size is used only with enable_large_batch_splitting" in caplog.text


def test_unset_max_execution_batch_size_is_max_batch_size():
    opts = BatchOptions(_params("max_batch_size { value: 6 } enable_large_batch_splitting { value: true }"))
    assert opts.split_large_batches and opts.max_execution_batch_size == 6


@pytest.mark.parametrize("text, needle", [
    # shared_batch_scheduler.h AddQueue refuses it with these words.
    ("max_batch_size { value: 4 } enable_large_batch_splitting { value: true } "
     "max_execution_batch_size { value: 8 }",
     "max_batch_size (4) must be greater than or equal to max_execution_batch_size (8)"),
    # Upstream takes max_batch_size's value, 0 when unset: a queue that holds nothing.
    ("enable_large_batch_splitting { value: true }", "needs a positive max_execution_batch_size"),
    ("max_batch_size { value: 4 } enable_large_batch_splitting { value: true } "
     "max_execution_batch_size { value: 0 }", "needs a positive max_execution_batch_size"),
])
def test_bad_splitting_values_are_refused(text, needle):
    with pytest.raises(ValueError) as e:
        BatchOptions(_params(text))
    assert needle in str(e.value)


def test_request_over_max_batch_size_is_still_refused_whole():
    sched = _scheduler(SPLIT)
    try:
        with pytest.raises(ServingError) as err:
            sched.run("s", _RowwiseModel(), {"x": _rows(11)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == "Task size 11 is larger than maximum input batch size 10"
    finally:
        sched.stop(timeout=10)


def test_request_larger_than_the_queue_can_take_is_refused_before_any_piece_runs():
    """Capacity is max_enqueued_batches batches of max_execution_batch_size rows (the open
    batch counted); upstream answers UNAVAILABLE and queues none of the pieces."""
    sched = _scheduler("max_batch_size { value: 10 } enable_large_batch_splitting { value: true } "
                       "max_execution_batch_size { value: 2 } max_enqueued_batches { value: 2 } "
                       "num_batch_threads { value: 1 }")
    model = _RowwiseModel()
    try:
        with pytest.raises(ServingError) as err:
            sched.run("s", model, {"x": _rows(5)})
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert err.value.message == (   # shared_batch_scheduler.h's words
            "The batch scheduling queue to which this task was submitted is full; task size is 5 but "
            "scheduling capacity is only 4 (num_enqueued_batches=1, max_enqueued_batches=2, "
            "open_batch_size=0, max_execution_batch_size=2)")
        assert model.runs == []
        x = _rows(4)
        _assert_answers(x, sched.run("s", model, {"x": x}))
        assert model.runs == [2, 2]
    finally:
        sched.stop(timeout=10)


def test_a_failing_piece_fails_its_request_and_spares_its_batch_mates():
    sched = _scheduler(SPLIT + "batch_timeout_micros { value: 200000 } num_batch_threads { value: 1 }")
    model = _RowwiseModel()
    good, bad = _rows(2), _rows(5, start=10)
    bad[4, 0] = -1   # in the last piece only
    try:
        answers = dict(zip(("good", "bad"), run_staggered(sched, model, [{"x": good}, {"x": bad}])))
        _assert_answers(good, answers["good"])
        assert isinstance(answers["bad"], ServingError)
        assert answers["bad"].code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        sched.stop(timeout=10)


def test_the_pieces_of_a_split_request_run_on_the_free_batch_threads_at_once():
    """SharedBatchScheduler's batch threads each take a closed batch: a request cut into 3
    pieces on 3 threads runs them together (each run below waits for the other two at a
    barrier, which breaks after 5 s when they run one after another). One wake-up per request
    woke one thread, which ran the pieces in turn."""
    barrier = threading.Barrier(3, timeout=5)

    class _Together(_RowwiseModel):
        def run(self, inputs, output_filter=()):
            barrier.wait()
            return super().run(inputs)
    sched = _scheduler(SPLIT + "batch_timeout_micros { value: 0 } num_batch_threads { value: 3 }")
    try:
        rows = _rows(9)
        _assert_answers(rows, sched.run("s", _Together(), {"x": rows}, deadline=time.monotonic() + 20))
    finally:
        sched.stop(timeout=10)
