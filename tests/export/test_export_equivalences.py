"""The same bag written many ways is recognised as the same mathematics:
every spelling below is fused, labelled with what it computes, and equal to
tests/reference.py (numpy float64). And the inputs the exporter generates
are ones the model accepts: tf.Examples from the model's own parse op,
ragged splits, hand-named sparse parts in canonical order; a signature that
cannot be fed is refused in one line with nothing written.
"""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.export import main  # noqa: E402

ops.load_library()
N, D, K = 40, 4, 5
TABLE = np.random.default_rng(3).normal(size=(N, D)).astype(np.float32)


def _weighted_forms(table, ids, w):
    """{name: (tensor, label)}: one bag, many spellings. w > 0, ids >= 0 with 0
    as padding for the masked forms."""
    rows = lambda: tf.gather(table, ids)  # noqa: E731 - a fresh gather per form
    mask = tf.not_equal(ids, 0)
    maskf = tf.cast(mask, tf.float32)
    w3 = w[:, :, None]
    s = tf.reduce_sum
    return {
        "slice": (s(rows() * w[..., None], 1), "sum"),
        "expand": (s(rows() * tf.expand_dims(w, -1), 1), "sum"),
        "reshape": (s(rows() * tf.reshape(w, [-1, K, 1]), 1), "sum"),
        "tile": (s(rows() * tf.tile(w3, [1, 1, D]), 1), "sum"),
        "broadcast_to": (s(rows() * tf.broadcast_to(w3, [tf.shape(w)[0], K, D]), 1), "sum"),
        "ones": (s(rows() * tf.ones_like(w)[..., None], 1) / K, "mean"),
        "mean_div": (s(rows() * w3, 1) / s(w3, 1), "weighted mean"),
        "mean_div_no_nan": (tf.math.divide_no_nan(s(rows() * w3, 1), s(w, 1, keepdims=True)),
                            "weighted mean"),
        "mean_reciprocal": (s(rows() * w3, 1) * tf.math.reciprocal(s(w3, 1)), "weighted mean"),
        "mean_one_over": (s(w3 * rows(), 1) * (1.0 / s(w3, 1)), "weighted mean"),
        "sqrtn": (s(rows() * w3, 1) / tf.sqrt(s(w3 * w3, 1)), "sqrtn"),
        "sqrtn_square": (s(rows() * w3, 1) / tf.sqrt(s(tf.square(w3), 1)), "sqrtn"),
        "masked_mean_cast": (s(rows() * maskf[..., None], 1) / s(maskf, 1, keepdims=True),
                             "masked mean"),
        "masked_mean_where": (s(tf.where(mask[..., None], rows(), 0.0), 1) /
                              s(maskf, 1, keepdims=True), "masked mean"),
        # the divisor's unit axis added by a slice (labelled "sum" before round 31)
        "mean_div_slice": (s(rows() * w3, 1) / s(w, 1)[:, None], "weighted mean"),
        "masked_mean_where_slice": (s(tf.where(mask[..., None], rows(), 0.0), 1) /
                                    tf.maximum(s(maskf, 1), 1.0)[..., None], "masked mean"),
    }


def _reference(ids, w):
    keep = (ids != 0).astype(np.float64)
    bag = lambda weights, c="sum": reference.embedding_bag(TABLE, ids, weights, c)  # noqa
    return {"slice": bag(w), "expand": bag(w), "reshape": bag(w), "tile": bag(w),
            "broadcast_to": bag(w), "ones": bag(None, "mean"), "mean_div": bag(w, "mean"),
            "mean_div_no_nan": bag(w, "mean"), "mean_reciprocal": bag(w, "mean"),
            "mean_one_over": bag(w, "mean"), "sqrtn": bag(w, "sqrtn"),
            "sqrtn_square": bag(w, "sqrtn"), "masked_mean_cast": bag(keep, "mean"),
            "masked_mean_where": bag(keep, "mean"), "mean_div_slice": bag(w, "mean"),
            "masked_mean_where_slice": bag(keep, "mean")}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    base = tmp_path_factory.mktemp("equiv")
    module = tf.Module()
    module.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                  tf.TensorSpec([None, K], tf.float32)])
    def serve(ids, w):
        return {k: v for k, (v, _) in _weighted_forms(module.table, ids, w).items()}
    module.serve = serve
    tf.saved_model.save(module, str(base / "m"), signatures={"serving_default": serve})
    report = base / "report.json"
    assert main([str(base / "m"), str(base / "out"), "--quiet", "--report", str(report),
                 "--tflite", str(base / "m.tflite")]) == 0
    return base, json.loads(report.read_text())


def test_every_spelling_fused_with_its_label(forms):
    _, report = forms
    labels = {name: label for name, (_, label) in _weighted_forms(
        tf.zeros([N, D]), tf.zeros([1, K], tf.int32), tf.ones([1, K])).items()}
    assert report["sites_skipped"] == 0, [s["reason"] for s in report["sites"]]
    assert report["sites_fused"] == len(labels)
    # Each output's site, by the label the report gives it.
    got = sorted(s["computes"] for s in report["sites"])
    assert got == sorted(labels.values())
    assert report["tflite"]["custom_ops"] == ["PkmEmbeddingBag"]


def test_every_spelling_equals_numpy(forms):
    base, _ = forms
    rng = np.random.default_rng(5)
    ids = rng.integers(1, N, (6, K)).astype(np.int32)
    ids[0, 2:] = 0
    ids[3, 1:] = 0
    w = rng.uniform(0.2, 2.0, (6, K)).astype(np.float32)
    fused = tf.saved_model.load(str(base / "out" / "1")).signatures["serving_default"]
    got = {k: v.numpy() for k, v in fused(ids=ids, w=w).items()}
    for name, want in _reference(ids, w).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_generated_examples_follow_the_parse_op(tmp_path):
    """A tf.Example signature verifies without --sample-inputs: dense, sparse
    and ragged features written from the parse op's own keys and types."""
    module = tf.Module()
    module.table = tf.Variable(TABLE)
    spec = {"ids": tf.io.VarLenFeature(tf.int64), "w": tf.io.VarLenFeature(tf.float32),
            "dense": tf.io.FixedLenFeature([2], tf.float32),
            "tokens": tf.io.RaggedFeature(tf.int64)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def serve(examples):
        f = tf.io.parse_example(examples, spec)
        bag = tf.nn.embedding_lookup_sparse(module.table, f["ids"], f["w"], combiner="sum")
        rows = tf.gather(module.table, f["tokens"])  # ragged gather
        pooled = tf.reduce_sum(rows, axis=1)
        return {"bag": bag, "pooled": pooled, "dense": f["dense"] * 2.0}
    module.serve = serve
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": serve})
    report = tmp_path / "r.json"
    assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet", "--report",
                 str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["sites_fused"] == 2, [s["reason"] for s in data["sites"]]
    assert {r["output"] for r in data["verification"]} == {"bag", "pooled", "dense"}
    assert all(r["max_abs_err"] < 1e-5 for r in data["verification"])


def _save_ragged_and_sparse(path, body):
    """A module over TABLE whose serving_default takes a ragged id tensor and a
    sparse one as its three parts, returning body(table, ragged, *parts)."""
    module = tf.Module()
    module.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64),
                                  tf.TensorSpec([None, 2], tf.int64),
                                  tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([2], tf.int64)])
    def serve(ragged, sp_indices, sp_values, sp_dense_shape):
        return body(module.table, ragged, sp_indices, sp_values, sp_dense_shape)
    module.serve = serve
    tf.saved_model.save(module, str(path), signatures={"serving_default": serve})


def test_ragged_and_hand_named_sparse_inputs_are_generated_valid(tmp_path):
    def body(table, ragged, sp_indices, sp_values, sp_dense_shape):
        sparse = tf.SparseTensor(sp_indices, sp_values, sp_dense_shape)
        return {"ragged": tf.reduce_sum(tf.gather(table, ragged), axis=1),
                "sparse": tf.nn.embedding_lookup_sparse(table, sparse, None,
                                                        combiner="mean")}
    _save_ragged_and_sparse(tmp_path / "m", body)
    report = tmp_path / "r.json"
    assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet", "--report",
                 str(report), "--tflite", str(tmp_path / "m.tflite")]) == 0
    data = json.loads(report.read_text())
    assert data["sites_fused"] == 2 and data["sites_skipped"] == 0
    assert data["tflite"]["status"] == "verified with the pkm delegate"


def test_string_sample_inputs_bytes_and_str(tmp_path):
    """A raw-text signature: |S and <U arrays are both accepted as strings."""
    module = tf.Module()
    module.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def serve(text):
        ids = tf.strings.to_hash_bucket_fast(tf.strings.split(text), N)
        return {"out": tf.reduce_mean(tf.gather(module.table, ids), axis=1)}
    module.serve = serve
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": serve})
    for i, array in enumerate([np.array([b"a b", b"c"]), np.array(["a b", "\u00e9t\u00e9"])]):
        np.savez(tmp_path / f"in{i}.npz", text=array)
        assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet",
                     "--sample-inputs", str(tmp_path / f"in{i}.npz")]) == 0


def test_unfeedable_signature_is_one_line_and_writes_nothing(tmp_path, capsys):
    module = tf.Module()
    module.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32),
                                  tf.TensorSpec([None], tf.complex64)])
    def serve(ids, z):
        return {"out": tf.reduce_sum(tf.gather(module.table, ids), axis=1),
                "z": tf.math.real(z)}
    module.serve = serve
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": serve})
    assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "complex64" in err[0] and "'z'" in err[0], err
    assert not os.path.exists(tmp_path / "out")


def test_ragged_ids_times_ragged_weights_converts_with_builtins(tmp_path):
    """Two RaggedTensors (ids, weights) multiplied: ragged broadcasting
    re-gathers both by RaggedRange positions, which after fusion are rebuilt
    from builtins, so the .tflite needs our op only; equal to numpy on bags
    with empty first, middle and last rows."""
    from pkm_serve import tflite
    module = tf.Module()
    module.table = tf.Variable(TABLE)

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64),
                                  tf.RaggedTensorSpec([None, None], tf.float32)])
    def serve(ids, w):
        rows = tf.nn.embedding_lookup(module.table, ids)
        w3 = tf.expand_dims(w, axis=2)
        total = tf.reduce_sum(rows * w3, axis=1)
        return {"sum": total, "mean": tf.math.divide_no_nan(total, tf.reduce_sum(w3, axis=1))}
    module.serve = serve
    tf.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": serve})
    report, tfl = tmp_path / "r.json", tmp_path / "m.tflite"
    assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet", "--report",
                 str(report), "--tflite", str(tfl)]) == 0
    data = json.loads(report.read_text())
    assert data["sites_fused"] == 1 and data["sites_skipped"] == 0
    assert data["tflite"]["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    runner = tflite.make_interpreter(str(tfl)).get_signature_runner("serving_default")
    rng = np.random.default_rng(5)
    for splits in ([0, 0, 3, 3, 7, 7], [0, 1], [0, 0], [0, 4, 9, 10]):
        splits = np.array(splits, np.int64)
        values = rng.integers(0, N, splits[-1]).astype(np.int64)
        weights = rng.uniform(0.2, 2.0, splits[-1]).astype(np.float32)
        got = runner(ids=values, ids_1=splits, w=weights, w_1=splits)
        for combiner in ("sum", "mean"):
            want = reference.ragged_embedding_bag(TABLE, values, splits, weights, combiner)
            np.testing.assert_allclose(got[combiner], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{combiner} {splits}")


def test_ragged_and_sparse_max_bags_fused_with_the_max_combiner(tmp_path):
    """reduce_max over a ragged gather (UnsortedSegmentMax: an empty row is
    the dtype's lowest value) and segment_max over sparse ids (sorted; an
    empty bag in between is 0) are fused with combiner 'max', labelled max,
    and equal to numpy in TF and through the delegate."""
    from pkm_serve import tflite
    _save_ragged_and_sparse(tmp_path / "m", lambda table, ragged, sp_indices, sp_values, _: {
        "ragged_max": tf.reduce_max(tf.gather(table, ragged), axis=1),
        "sparse_max": tf.math.segment_max(tf.gather(table, sp_values), sp_indices[:, 0])})
    report, tfl = tmp_path / "r.json", tmp_path / "m.tflite"
    assert main([str(tmp_path / "m"), str(tmp_path / "out"), "--quiet", "--report",
                 str(report), "--tflite", str(tfl)]) == 0
    data = json.loads(report.read_text())
    assert data["sites_fused"] == 2 and data["sites_skipped"] == 0, data["sites"]
    assert [s["computes"] for s in data["sites"]] == ["max", "max"]
    assert data["tflite"]["custom_ops"] == ["PkmRaggedEmbeddingBag"]
    fused = tf.saved_model.load(str(tmp_path / "out" / "1")).signatures["serving_default"]
    runner = tflite.make_interpreter(str(tfl)).get_signature_runner("serving_default")
    table = TABLE.astype(np.float64)
    splits = np.array([0, 0, 3, 3, 7, 7], np.int64)     # empty first, middle, last rows
    values = np.random.default_rng(8).integers(0, N, 7).astype(np.int64)
    rows = np.repeat(np.arange(5), np.diff(splits)).astype(np.int64)
    sp = {"sp_indices": np.stack([rows, np.zeros_like(rows)], 1),
          "sp_values": values, "sp_dense_shape": np.array([5, 4], np.int64)}
    lowest = np.finfo(np.float32).min
    want_ragged = np.array([table[values[a:b]].max(0) if b > a else np.full(D, lowest)
                            for a, b in zip(splits[:-1], splits[1:])])
    # segment_max writes bags 0..last id; an empty one in between is 0.
    want_sparse = np.array([table[values[a:b]].max(0) if b > a else np.zeros(D)
                            for a, b in zip(splits[:-2], splits[1:-1])])
    for got in (fused(ragged=values, ragged_1=splits, **sp),
                runner(ragged=values, ragged_1=splits, **sp)):
        np.testing.assert_allclose(np.asarray(got["ragged_max"], np.float64), want_ragged,
                                   rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got["sparse_max"], np.float64), want_sparse,
                                   rtol=1e-6, atol=1e-7)
