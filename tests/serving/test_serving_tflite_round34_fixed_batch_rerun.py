"""A .tflite that fixes its batch at 8 rows under --num_tflite_interpreters_per_pool above 1:
a batch holding a good request and a bad one (an out-of-range id) fails INVALID_ARGUMENT and
each request is rerun alone. The rerun was not padded to the model's batch, so the model
refused both with its batch-size complaint; each rerun is now padded as a batch is, the good
request answers its outputs and the bad one its own out-of-range error. Reference: numpy
float64 of the same model (the model file comes from the round-34 fixed-batch test)."""
import threading
import time

import grpc
import numpy as np

from test_serving_tflite_round34_fixed_batch import K, N, _reference, model_dir  # noqa: F401

from pkm_serve.serving.errors import ServingError


def _queued_tasks(scheduler):
    with scheduler._cv:
        return sum(len(b.tasks) for q in scheduler._queues.values() for b in q.batches)


def _running_batches(scheduler):
    with scheduler._cv:
        return sum(q.running for q in scheduler._queues.values())


def _wait_for(condition, what):
    end = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_good_request_batched_with_a_bad_one_still_answers(model_dir):  # noqa: F811
    from pkm_serve.serving.tflite_servable import TfLiteServable
    servable = TfLiteServable("m", 1, model_dir, warmup=False, num_interpreters=2, interpreters_per_pool=2)
    signature, answers = servable.signature(""), {}
    good = np.random.default_rng(7).integers(0, N, size=(2, K)).astype(np.int32)
    bad = np.full((2, K), N + 949, np.int32)

    def call(name, ids):
        try:
            answers[name] = next(iter(signature.run({"ids": ids}).values()))
        except ServingError as e:
            answers[name] = e
    held = [servable._pool.take() for _ in range(2)]
    callers = []
    try:
        for c in held:
            c.__enter__()
        # Two requests take both batch threads, which wait for an interpreter; the next two
        # then share one batch. Each of the two waits for its thread to run its batch: started
        # together, both could land in one batch (seen on a loaded 2-core machine) and the
        # second thread would never be busy.
        for name, ids in (("first", good), ("second", good), ("good", good), ("bad", bad)):
            callers.append(threading.Thread(target=call, args=(name, ids)))
            callers[-1].start()
            if name in ("first", "second"):
                busy = 1 if name == "first" else 2
                _wait_for(lambda: _running_batches(servable._scheduler) == busy, f"{busy} batch thread(s) busy")
        _wait_for(lambda: _queued_tasks(servable._scheduler) == 2, "the good and bad request queued")
        assert len(servable._scheduler._queues) == 1
        assert len(next(iter(servable._scheduler._queues.values())).batches) == 1
    finally:
        for c in held:
            c.__exit__(None, None, None)
        for t in callers:
            t.join(30)
        servable.release()
    for name in ("first", "second", "good"):
        assert isinstance(answers[name], np.ndarray), (name, answers[name])
        np.testing.assert_allclose(answers[name], _reference(good), rtol=1e-5, atol=1e-5)
    err = answers["bad"]
    assert isinstance(err, ServingError) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"indices[0] = {N + 949} is out of range [0, {N})" in err.message, err.message
    assert "fixes its batch" not in err.message, err.message
