"""An int64 num_segments fed to a fused segment sum was cast to the int32 the fused op counts bags in,
wrapping: 2**32 + 2 became 2 and the fused model answered with 2 bags where the original refuses (it cannot
allocate 2**32 rows), and -2**32 + 2 (refused by the original: negative) became 2 too. Now one past int32 is
refused naming num_segments, and a negative one stays negative (refused naming num_segments, as the original); in range, the bags are numpy float64's."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.export import ExportError
from pkm_serve.export.saved_model_io import read_saved_model
from round34_forms import D, N, RNG, TABLE, save_and_export

FLAT = tf.TensorSpec([None], tf.int64)
COUNT64 = tf.TensorSpec([], tf.int64)
FORMS = {
    "unsorted_segment_sum": lambda m, ids, seg, n: tf.math.unsorted_segment_sum(tf.gather(m.t, ids), seg, n),
    "sparse_segment_sum": lambda m, ids, seg, n: tf.sparse.segment_sum(m.t, ids, seg, num_segments=n),
}


def _segment_sums(ids, seg, n):
    out = np.zeros((n, D))
    for i, s in zip(ids, seg):
        out[s] += TABLE[i].astype(np.float64)
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
def test_int64_num_segments_past_int32_is_refused_not_wrapped(tmp_path, form):
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=RNG.integers(0, N, 6), args_1=np.array([0, 0, 1, 1, 3, 4]), args_2=np.int64(5))
    result = save_and_export(tmp_path, [FLAT, FLAT, COUNT64], FORMS[form], sample_inputs=sample)
    assert result.sites[0].status == "fused", result.sites[0].reason
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    ids, seg = RNG.integers(0, N, 4), np.array([0, 0, 1, 3])
    np.testing.assert_allclose(fused(args_0=ids, args_1=seg, args_2=np.int64(5))["out"].numpy(),
                               _segment_sums(ids, seg, 5), rtol=1e-5, atol=1e-5)
    # The original is not run on these: where memory allows, it allocates 2**32 rows.
    for too_many in (2**32 + 2, 2**31):
        with pytest.raises(tf.errors.InvalidArgumentError, match="num_segments is past 2\\*\\*31 - 1"):
            fused(args_0=ids, args_1=seg, args_2=np.int64(too_many))
    # A negative one is refused naming num_segments, as the original's segment op names it ("Input
    # num_segments == -1 must not be negative."), not the room-for-bags allocation ("Dimension -1 must be >= 0").
    for negative in (-1, -2**32 + 2):
        with pytest.raises(tf.errors.InvalidArgumentError, match="num_segments == -1 must not be negative"):
            fused(args_0=ids, args_1=seg, args_2=np.int64(negative))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_num_segments_and_sorted_segment_ids_fed_for_verification(tmp_path, form):
    """Without --sample-inputs, num_segments got a random id in [0, rows), below some segment id, and
    tf.sparse.segment_sum's segment ids were unsorted: the original refused the generated inputs and the
    export failed. num_segments now gets the ids' bound, and segment ids a sorted op reads come sorted."""
    result = save_and_export(tmp_path, [FLAT, FLAT, COUNT64], FORMS[form])
    assert result.sites[0].status == "fused", result.sites[0].reason
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    ids, seg = RNG.integers(0, N, 5), np.array([0, 2, 2, 2, 3])
    np.testing.assert_allclose(fused(args_0=ids, args_1=seg, args_2=np.int64(4))["out"].numpy(),
                               _segment_sums(ids, seg, 4), rtol=1e-5, atol=1e-5)


def test_verification_says_why_stock_sparse_segment_sum_answers_a_num_segments_past_int32(tmp_path):
    """Stock tf.sparse.segment_sum wraps num_segments = 2**32 + 2 into 2 bags (TF documents num_segments
    rows); the fused model refuses it. Verification on such a sample said only that the fused model fails
    where the original runs; it now says the original's answer is the wrap, not the documented result."""
    ids, seg, too_many = np.array([1, 2, 3]), np.array([0, 0, 1]), np.int64(2**32 + 2)
    stock = tf.sparse.segment_sum(TABLE, ids, seg, num_segments=too_many).shape
    assert stock[0] != too_many  # the wrap this note is about
    sample = str(tmp_path / "sample.npz")
    np.savez(sample, args_0=ids, args_1=seg, args_2=too_many)
    with pytest.raises(ExportError) as raised:
        save_and_export(tmp_path, [FLAT, FLAT, COUNT64], FORMS["sparse_segment_sum"], sample_inputs=sample)
    message = str(raised.value)
    assert "num_segments is past 2**31 - 1" in message, message
    assert f"The original answered with outputs of shape {list(stock)}" in message, message
    assert "documents the output's first dimension as num_segments" in message, message



def _ancestors(nodes, name):
    """The names of every node `name` depends on, data or control, within one function."""
    seen, todo = set(), [name]
    while todo:
        for text in nodes[todo.pop()].input:
            parent = text.lstrip("^").split(":")[0]
            if parent in nodes and parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_the_counts_wait_for_room_for_the_bags(tmp_path):
    """num_segments whose [n, D] output cannot be allocated (2**31 - 1 bags): the original fails allocating it
    (ResourceExhausted, at once). The fused model first built and touched int32 [n] counts, their running sum
    and row_splits (24 GB: the process was killed) before its op failed. Now every [n] count waits for an
    uninitialised [n, D] allocation of the table's dtype (Empty, untouched), which fails as the original's
    does. (Run for real, each ResourceExhausted takes TF's allocator 10 s of retries: read off the graph.)"""
    result = save_and_export(tmp_path, [FLAT, FLAT, COUNT64], FORMS["unsorted_segment_sum"])
    assert result.sites[0].status == "fused", result.sites[0].reason
    fdef = next(f for f in read_saved_model(result.dst).meta_graphs[0].graph_def.library.function
                if any(n.op == "PkmRaggedEmbeddingBag" for n in f.node_def))
    nodes = {n.name: n for n in fdef.node_def}
    rooms = [n for n in fdef.node_def if n.op == "Empty"]
    assert rooms and all(not n.attr["init"].b and n.attr["dtype"].type == tf.float32.as_datatype_enum
                         for n in rooms), rooms
    width = [nodes[n.input[0].split(":")[0]] for n in rooms]
    assert all(w.op == "Pack" and D in tf.make_ndarray(nodes[w.input[1].split(":")[0]].attr["value"].tensor).ravel()
               for w in width), width
    counts = [n.name for n in fdef.node_def if n.op in ("UnsortedSegmentSum", "Cumsum")]
    assert counts and all({r.name for r in rooms} & _ancestors(nodes, c) for c in counts), counts
    fused = tf.saved_model.load(result.dst).signatures["serving_default"]
    ids, seg = RNG.integers(0, N, 3), np.array([2, 0, 2])
    np.testing.assert_allclose(fused(args_0=ids, args_1=seg, args_2=np.int64(4))["out"].numpy(),
                               _segment_sums(ids, seg, 4), rtol=1e-5, atol=1e-5)


def test_no_wrap_note_where_the_original_answered_num_segments_rows():
    """The note on a fused refusal of num_segments past int32 said stock TF wrapped it, whatever the original
    answered: unsorted_segment_sum allocates the 2**31 rows asked for where memory allows (an int64-indexed
    kernel), and its [2**31, D] answer is no wrap. The note now comes only where no output has such rows."""
    from pkm_serve.export.verify import wrapped_count_note

    refusal = "num_segments is past 2**31 - 1, the most bags the fused op (PkmRaggedEmbeddingBag) counts"
    many_rows = np.zeros((2**31, 0), np.float32)  # the original's [2**31, D] answer's shape, without its bytes
    assert wrapped_count_note(refusal, {"out": many_rows}) == ""
    wrapped = tf.sparse.segment_sum(TABLE, [1, 2], [0, 1], num_segments=np.int64(2**32 + 2)).numpy()
    assert "wrap an int64 num_segments" in wrapped_count_note(refusal, {"out": wrapped})
