"""What a batch is padded with (BatchScheduler in-process, a fake signature that records
the merged inputs it ran), against TF Serving's batching_session.cc / batching_util.cc."""
import time

import numpy as np
import pytest
from google.protobuf import text_format

from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchScheduler
from pkm_serve.serving.errors import ServingError
from serving_helpers import run_staggered


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
    try:
        answers = run_staggered(sched, model, [{"x": x} for x in requests])
    finally:
        sched.stop(timeout=10)
    for a in answers:
        if isinstance(a, Exception):
            raise a
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


PAD = ("num_batch_threads { value: 1 } batch_timeout_micros { value: 300000 } "
       "pad_variable_length_inputs: true ")


def _pad_like_upstream(value, shape):
    """Independent of the server's code: np.pad after each dimension but the 0th, with the
    tensor's first element (batching_util.h: "First element of a tensor is used as padding
    value")."""
    widths = [(0, 0)] + [(0, n - m) for n, m in zip(shape, value.shape[1:])]
    return np.pad(value, widths, mode="constant", constant_values=value.flat[0])


def test_inputs_of_different_lengths_share_a_batch_padded_with_their_first_element():
    model = _Recording()
    short = np.array([[5.0, 1.0], [6.0, 2.0]])
    long = np.array([[1.0, 2.0, 3.0, 4.0]])
    answers = _run_together(PAD + "max_batch_size { value: 3 }", [short, long], model)
    (merged,) = model.merged   # one run: upstream pads instead of batching apart
    padded_short = _pad_like_upstream(short, (4,))
    np.testing.assert_array_equal(merged["x"], np.concatenate([padded_short, long]))
    # Outputs are split along dimension 0 only (SplitOutputTensors): the answer is the
    # model's on the padded rows.
    np.testing.assert_array_equal(answers[0]["y"], padded_short.sum(axis=1))
    np.testing.assert_array_equal(answers[1]["y"], long.sum(axis=1))


def test_string_inputs_and_higher_ranks_pad_every_dimension_but_the_0th():
    a = np.array([[[b"a", b"b"]]], dtype=object)            # [1, 1, 2]
    b = np.array([[[b"x"], [b"y"], [b"z"]]], dtype=object)  # [1, 3, 1]

    class _Strings(_Recording):
        def run(self, inputs, output_filter=()):
            self.merged.append(inputs)
            return {"y": inputs["x"]}
    model = _Strings()
    answers = _run_together(PAD + "max_batch_size { value: 2 }", [a, b], model)
    want_a, want_b = _pad_like_upstream(a, (3, 2)), _pad_like_upstream(b, (3, 2))
    assert want_a[0, 2, 1] == b"a" and want_b[0, 0, 1] == b"x"
    np.testing.assert_array_equal(model.merged[0]["x"], np.concatenate([want_a, want_b]))
    np.testing.assert_array_equal(answers[0]["y"], want_a)
    np.testing.assert_array_equal(answers[1]["y"], want_b)


def test_an_empty_input_that_needs_padding_gets_upstreams_error_alone():
    model = _Recording()
    empty, full = np.zeros((1, 0)), np.array([[3.0, 4.0]])
    sched = BatchScheduler(text_format.Parse(PAD + "max_batch_size { value: 2 }", protos.BatchingParameters()))
    try:
        out = dict(zip(("empty", "full"), run_staggered(sched, model, [{"x": empty}, {"x": full}])))
    finally:
        sched.stop(timeout=10)
    assert out["empty"].message == "Got empty tensor in batch of non-empty tensors."
    np.testing.assert_array_equal(out["full"]["y"], full.sum(axis=1))


def test_without_padding_other_lengths_are_batched_apart_unpadded():
    model = _Recording()
    short, long = np.array([[5.0, 1.0]]), np.array([[1.0, 2.0, 3.0]])
    answers = _run_together("max_batch_size { value: 2 } num_batch_threads { value: 1 } "
                            "batch_timeout_micros { value: 100000 }", [short, long], model)
    assert sorted(m["x"].shape for m in (r for r in model.merged)) == [(1, 2), (1, 3)]
    np.testing.assert_array_equal(answers[0]["y"], short.sum(axis=1))
    np.testing.assert_array_equal(answers[1]["y"], long.sum(axis=1))


def test_rank_above_six_is_refused_when_padding_is_on():
    """PadTensorOfSpecificType handles ranks 1 to 6 and refuses the rest, padded or not."""
    sched = BatchScheduler(text_format.Parse(PAD, protos.BatchingParameters()))
    try:
        with pytest.raises(ServingError) as err:
            sched.run("s", _Recording(), {"x": np.ones((1,) * 7)}, deadline=time.monotonic() + 10)
        assert err.value.message == "Only tensors with rank from 1 to 6 can be padded."
        np.testing.assert_array_equal(
            sched.run("s", _Recording(), {"x": np.ones((1,) * 6)}, deadline=time.monotonic() + 10)["y"], [1.0])
    finally:
        sched.stop(timeout=10)


def test_split_request_whose_pieces_were_padded_apart_gets_an_error_not_a_hang():
    """pad_variable_length_inputs with enable_large_batch_splitting: a narrow request's first
    row shares a batch with a wide one (padded to its width), its other rows run alone
    (unpadded); the pieces' outputs cannot be concatenated. The batch thread raised in the
    answer path and the request waited until its deadline."""
    class _Rowwise(_Recording):
        def run(self, inputs, output_filter=()):
            self.merged.append(inputs)
            return {"y": 3 * inputs["x"] + 1}
    model = _Rowwise()
    wide, narrow = np.array([[1.0, 2.0, 3.0]]), np.array([[4.0], [5.0], [6.0]])
    sched = BatchScheduler(text_format.Parse(
        "max_batch_size { value: 4 } enable_large_batch_splitting { value: true } "
        "max_execution_batch_size { value: 2 } num_batch_threads { value: 1 } "
        "batch_timeout_micros { value: 100000 } pad_variable_length_inputs: true",
        protos.BatchingParameters()))
    try:
        out = dict(zip(("wide", "narrow"), run_staggered(sched, model, [{"x": wide}, {"x": narrow}])))
        np.testing.assert_array_equal(out["wide"]["y"], 3 * wide + 1)
        assert out["narrow"].code.name == "INVALID_ARGUMENT", out["narrow"]
        assert "cannot be concatenated" in out["narrow"].message
        # The batch thread is alive and serves the next request.
        x = np.array([[2.0]])
        np.testing.assert_array_equal(sched.run("s", model, {"x": x}, deadline=time.monotonic() + 10)["y"], [[7.0]])
    finally:
        sched.stop(timeout=10)
