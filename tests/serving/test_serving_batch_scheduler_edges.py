"""BatchScheduler at the edges of BatchingParameters' ranges (in-process, fake signature)."""
import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

from serving_helpers import run_concurrently

from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import ServingError


class _Doubling:
    name = "serving_default"

    def run(self, inputs, output_filter=()):
        return {"y": inputs["x"] * 2}


def _scheduler(text):
    return BatchScheduler(text_format.Parse(text, protos.BatchingParameters()))


def _concurrently(sched, values, seconds):
    return run_concurrently(sched, _Doubling(), values, seconds=seconds)


def test_int64_max_batch_timeout_waits_for_a_full_batch_without_killing_the_batch_thread():
    """batch_timeout_micros at int64 max ("close only when full"): waiting for it overflowed
    the lock's timeout (OverflowError), the only batch thread died, and every request hung."""
    sched = _scheduler("max_batch_size { value: 2 } batch_timeout_micros { value: 9223372036854775807 } "
                       "num_batch_threads { value: 1 }")
    try:
        out = _concurrently(sched, [1.0, 2.0], seconds=5)
        assert sorted(float(r["y"][0, 0]) for r in out.values()) == [2.0, 4.0]
        (lone,) = _concurrently(sched, [3.0], seconds=0.5).values()   # no partner: waits
        assert isinstance(lone, ServingError) and lone.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert all(t.is_alive() for t in sched._threads)
    finally:
        sched.stop(timeout=10)


@pytest.mark.parametrize("rows", [3, 9])
def test_request_over_max_batch_size_is_refused_with_upstreams_words(rows):
    sched = _scheduler("max_batch_size { value: 2 } num_batch_threads { value: 1 }")
    try:
        with pytest.raises(ServingError) as err:
            sched.run("servable", _Doubling(), {"x": np.ones((rows, 1), np.float32)})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == f"Task size {rows} is larger than maximum input batch size 2"
    finally:
        sched.stop(timeout=10)


def test_unset_max_enqueued_batches_is_tf_servings_ten():
    """SharedBatchScheduler::QueueOptions: max_enqueued_batches defaults to 10; beyond that a
    request is refused UNAVAILABLE (it used to default to 100: ten times the queueing
    latency before an overloaded server shed load)."""
    sched = _scheduler("max_batch_size { value: 1 } num_batch_threads { value: 1 }")
    gate = threading.Event()

    class _Gated(_Doubling):
        def run(self, inputs, output_filter=()):
            gate.wait(10)
            return super().run(inputs)
    one = {"x": np.ones((1, 1), np.float32)}
    waiting = [threading.Thread(target=sched.run, args=("s", _Gated(), one)) for _ in range(11)]
    try:
        for t in waiting:   # one runs (held at the gate), ten wait in the queue
            t.start()
            time.sleep(0.05)
        with pytest.raises(ServingError) as err:   # (the deadline: a regression fails, not hangs)
            sched.run("s", _Gated(), one, deadline=time.monotonic() + 1)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert err.value.message == ("The batch scheduling queue to which this task was submitted is full; "
                                     "currently 10 batches enqueued and max_enqueued_batches is 10")
    finally:
        gate.set()
        for t in waiting:
            t.join(10)
        sched.stop(timeout=10)


class _FixedBatchOfFour:
    """A model that, like a graph with a fixed [4, 1] input, refuses any other batch, and
    refuses a negative value (as an out-of-range id); `runs` holds each run's rows."""
    name = "serving_default"

    def __init__(self):
        self.runs = []

    def run(self, inputs, output_filter=()):
        x = inputs["x"]
        self.runs.append(len(x))
        if len(x) != 4:
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"the model takes 4 rows, not {len(x)}")
        if (x < 0).any():
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "a negative value")
        return {"y": x * 2}


def test_a_failed_batchs_requests_rerun_alone_padded_to_allowed_batch_sizes():
    """A good and a bad request in one batch padded to 4 (allowed_batch_sizes): the batch fails,
    each request is rerun alone; unpadded, the fixed-batch model refused both with its
    batch-size complaint. Padded as a batch: the good one answers, the bad one its own error."""
    sched = _scheduler("max_batch_size { value: 4 } batch_timeout_micros { value: 300000 } "
                       "num_batch_threads { value: 1 } allowed_batch_sizes: 4")
    model = _FixedBatchOfFour()
    try:
        out = run_concurrently(sched, model, [1.5, -1.0], seconds=10)
    finally:
        sched.stop(timeout=10)
    assert model.runs == [4, 4, 4]   # the batch of both, then each alone
    good, bad = out[0], out[1]
    assert not isinstance(good, ServingError), good.message
    np.testing.assert_array_equal(good["y"], [[3.0]])
    assert isinstance(bad, ServingError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.message == "a negative value"
