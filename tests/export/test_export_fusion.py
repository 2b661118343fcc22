"""Export fuses each composite pattern into the op, and the fused SavedModel
computes what a numpy reference says (independently of the export's own
verification)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.export import export_saved_model  # noqa: E402
from pkm_serve.export.exporter import read_saved_model  # noqa: E402

ops.load_library()

FUSED_OPS = ("PkmEmbeddingBag", "PkmRaggedEmbeddingBag")
COMPOSITE_OPS = ("ResourceGather", "GatherV2", "Einsum", "SegmentSum", "SparseSegmentSum",
                 "SparseSegmentMean", "SparseSegmentSqrtN")


op_counts = M.op_counts


def table_gathers(saved_model_dir):
    """Gathers of float rows (table lookups) left in the function bodies."""
    left = []
    for mg in read_saved_model(saved_model_dir).meta_graphs:
        for fdef in mg.graph_def.library.function:
            for node in fdef.node_def:
                if node.op == "ResourceGather" or (
                        node.op == "GatherV2" and node.attr["Tparams"].type in (
                            tf.float32.as_datatype_enum, tf.float16.as_datatype_enum)):
                    left.append(node.name)
    return left


def export(src, dst, **kw):
    kw.setdefault("quiet", True)
    return export_saved_model(str(src), str(dst), **kw)


def run(saved_model_dir, signature, inputs):
    loaded = tf.saved_model.load(str(saved_model_dir))
    out = loaded.signatures[signature](**inputs)
    return {k: v.numpy() for k, v in out.items()}


RNG = np.random.default_rng(42)


def dense_inputs(batch=5, index_dtype=np.int32, with_weights=True, table_rows=M.N,
                 weight_dtype=np.float32):
    x = {"idx": RNG.integers(0, table_rows, (batch, M.K)).astype(index_dtype)}
    if with_weights:
        x["w"] = RNG.uniform(-1, 2, (batch, M.K)).astype(weight_dtype)
    return x


@pytest.mark.parametrize("variant", ["slice-int32", "expand_dims-int64", "float16"])
def test_gather_weighted_sum(tmp_path, variant):
    if variant == "slice-int32":
        table, ref = M.gather_weighted_sum(tmp_path / "m", tf.int32, "slice")
        x, tol = dense_inputs(), 1e-5
    elif variant == "expand_dims-int64":
        table, ref = M.gather_weighted_sum(tmp_path / "m", tf.int64, "expand")
        x, tol = dense_inputs(index_dtype=np.int64), 1e-5
    else:
        table, ref = M.gather_weighted_sum(tmp_path / "m", table_dtype=np.float16)
        x, tol = dense_inputs(weight_dtype=np.float16), 2e-2
    result = export(tmp_path / "m", tmp_path / "out")
    assert [s.status for s in result.sites] == ["fused"]
    assert result.sites[0].weighted and result.sites[0].combiner == "sum"
    counts = op_counts(result.dst)
    assert counts.get("PkmEmbeddingBag") == 1
    assert table_gathers(result.dst) == []
    assert not counts.get("Mul")  # the weight multiply went with the gather
    got = run(result.dst, "serving_default", x)["out"].astype(np.float64)
    want = M.np_bag(table, x["idx"], x["w"])
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_gather_mean_over_leading_dims(tmp_path):
    table, _ = M.gather_mean_3d(tmp_path / "m")
    result = export(tmp_path / "m", tmp_path / "out")
    assert [(s.status, s.combiner, s.weighted) for s in result.sites] == [
        ("fused", "mean", False)]
    assert op_counts(result.dst).get("PkmEmbeddingBag") == 1
    assert table_gathers(result.dst) == []
    idx = RNG.integers(0, M.N, (4, 3, M.K)).astype(np.int64)
    got = run(result.dst, "serving_default", {"idx": idx})["pooled"]
    assert got.shape == (4, 3, M.D)
    np.testing.assert_allclose(got, M.np_bag(table, idx, combiner="mean"), rtol=1e-5,
                               atol=1e-6)


def test_einsum_forms(tmp_path):
    table, _ = M.einsum_forms(tmp_path / "m")
    result = export(tmp_path / "m", tmp_path / "out")
    assert sorted(s.status for s in result.sites) == ["fused"] * 3
    counts = op_counts(result.dst)
    assert counts.get("PkmEmbeddingBag") == 3 and not counts.get("Einsum")
    assert table_gathers(result.dst) == []
    x = dense_inputs()
    for sig in ("ellipsis", "named"):
        got = run(result.dst, sig, x)["out"]
        np.testing.assert_allclose(got, M.np_bag(table, x["idx"], x["w"]), rtol=1e-5,
                                   atol=1e-5)
    got = run(result.dst, "unweighted", {"idx": x["idx"]})["out"]
    np.testing.assert_allclose(got, M.np_bag(table, x["idx"]), rtol=1e-5, atol=1e-5)


def sparse_inputs(weighted, with_padding=False):
    """Bags [[3, 7], [], [0, 49, 12], [5]] (+ a -1 id in bag 3 when padding)."""
    indices = np.array([[0, 0], [0, 1], [2, 0], [2, 1], [2, 2], [3, 0]], np.int64)
    values = np.array([3, 7, 0, 49, 12, 5], np.int64)
    if with_padding:
        indices = np.concatenate([indices, [[3, 1]]]).astype(np.int64)
        values = np.concatenate([values, [-1]]).astype(np.int64)
    shape = np.array([5, 4], np.int64)  # a trailing empty bag too
    x = {"ids": indices, "ids_1": values, "ids_2": shape}
    if weighted:
        x.update(w=indices, w_1=RNG.uniform(0.2, 2, len(values)).astype(np.float32),
                 w_2=shape)
    return x


@pytest.mark.parametrize("weighted,combiner", [
    (True, "sum"), (True, "mean"), (True, "sqrtn"), (False, "sum"), (False, "mean"),
    (False, "sqrtn")])
def test_embedding_lookup_sparse(tmp_path, weighted, combiner):
    table, _ = M.sparse_lookup(tmp_path / "m", weighted, combiner)
    result = export(tmp_path / "m", tmp_path / "out")
    assert [(s.status, s.pattern, s.combiner) for s in result.sites] == [
        ("fused", "embedding_lookup_sparse", combiner)]
    counts = op_counts(result.dst)
    assert counts.get("PkmRaggedEmbeddingBag") == 1
    assert table_gathers(result.dst) == []
    for op in ("SegmentSum", "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
               "Unique"):
        assert not counts.get(op), op
    x = sparse_inputs(weighted)
    got = run(result.dst, "serving_default", x)["out"]
    want = M.np_sparse_bag(table, x["ids"], x["ids_1"], x["ids_2"],
                           x.get("w_1"), combiner)
    assert got.shape == want.shape == (4, M.D)  # rows up to the last non-empty bag
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_safe_embedding_lookup_sparse(tmp_path):
    table, _ = M.sparse_lookup(tmp_path / "m", True, "sqrtn", safe=True)
    result = export(tmp_path / "m", tmp_path / "out")
    assert [s.status for s in result.sites] == ["fused"]
    assert op_counts(result.dst).get("PkmRaggedEmbeddingBag") == 1
    x = sparse_inputs(True, with_padding=True)
    got = run(result.dst, "serving_default", x)["out"]
    keep = x["ids_1"] >= 0  # safe_ prunes invalid ids; empty bags give zeros
    want = M.np_sparse_bag(table, x["ids"][keep], x["ids_1"][keep], x["ids_2"],
                           x["w_1"][keep], "sqrtn")
    want = np.concatenate([want, np.zeros((5 - len(want), M.D))])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_keras_embedding_pooling(tmp_path):
    table, ref = M.keras_embedding_pooling(str(tmp_path / "m"))
    result = export(tmp_path / "m", tmp_path / "out")
    assert [(s.status, s.combiner) for s in result.sites] == [("fused", "mean")]
    assert op_counts(result.dst).get("PkmEmbeddingBag") == 1
    assert table_gathers(result.dst) == []
    ids = RNG.integers(0, M.N, (6, M.K)).astype(np.int32)
    for sig in ("serve", "serving_default"):
        got = run(result.dst, sig, {"ids": ids})["output_0"]
        np.testing.assert_allclose(got, ref({"ids": ids}), rtol=1e-4, atol=1e-5)


def test_two_sites_and_one_that_must_stay(tmp_path):
    _, ref = M.two_sites_one_blocked(tmp_path / "m")
    result = export(tmp_path / "m", tmp_path / "out", batch_size=100)
    fused = [s for s in result.sites if s.status == "fused"]
    skipped = [s for s in result.sites if s.status != "fused"]
    # The shared rows of t3 feed a reduce_sum and a reduce_max: both listed.
    assert len(fused) == 2 and len(skipped) == 2
    assert all("another consumer" in s.reason for s in skipped)
    assert {s.combiner for s in skipped} == {"sum", "max"}
    assert op_counts(result.dst).get("PkmEmbeddingBag") == 2
    assert len(table_gathers(result.dst)) == 1  # the shared gather of t3
    # weighted site: gather + multiply, [100, K, D] float32 each
    sizes = sorted(s.saved_bytes_at_batch for s in fused)
    assert sizes == [100 * 4 * M.D * 4, 2 * 100 * M.K * M.D * 4]
    x = {"a": RNG.integers(0, M.N, (7, M.K)).astype(np.int32),
         "w": RNG.uniform(0, 1, (7, M.K)).astype(np.float32),
         "b": RNG.integers(0, 30, (7, 4)).astype(np.int32)}
    got = run(result.dst, "serving_default", x)
    for key, want in ref(x).items():
        np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=key)


def test_unfusable_reductions_are_reported_not_fused(tmp_path):
    M.unfusable_reductions(tmp_path / "m")
    result = export(tmp_path / "m", tmp_path / "out")
    assert all(s.status == "skipped" for s in result.sites) and len(result.sites) == 5
    by_reason = {s.reason: s for s in result.sites}

    def site(text):
        [match] = [s for r, s in by_reason.items() if text in r]
        return match
    assert site("not the bag axis").combiner == "sum"
    assert site("not over exactly one constant axis")
    # The report's flags describe what the reason talks about.
    assert site("multiplier is not per-index").weighted
    assert site("other than a constant 0").masked
    assert not site("other than a constant 0").weighted
    exp = site("Exp between the gather and the reduction")
    assert not exp.weighted and not exp.masked
    assert "unchanged" in result.message
    assert not op_counts(result.dst).get("PkmEmbeddingBag")


FRESH_PROCESS = r"""
import sys, numpy as np, tensorflow as tf
lib, keras_dir, sparse_dir, io = sys.argv[1:]
try:
    tf.saved_model.load(keras_dir)
    print("LOADED_WITHOUT_OP")
except Exception as e:
    print("NEEDS_OP:", "PkmEmbeddingBag" in str(e))
tf.load_op_library(lib)
x = dict(np.load(io + "/in.npz"))
keras_out = tf.saved_model.load(keras_dir).signatures["serving_default"](ids=x["ids"])
sparse_in = {k[7:]: v for k, v in x.items() if k.startswith("sparse_")}
sparse_out = tf.saved_model.load(sparse_dir).signatures["serving_default"](**sparse_in)
np.savez(io + "/out.npz", keras=keras_out["output_0"].numpy(), sparse=sparse_out["out"].numpy())
print("modules:", sorted(m for m in sys.modules if m.startswith("pkm_serve")))
"""


def test_reloads_in_fresh_process_with_only_the_op_library(tmp_path):
    _, keras_ref = M.keras_embedding_pooling(str(tmp_path / "k"))
    table, _ = M.sparse_lookup(tmp_path / "s", True, "mean")
    keras_dst = export(tmp_path / "k", tmp_path / "k_out").dst
    sparse_dst = export(tmp_path / "s", tmp_path / "s_out").dst
    ids = RNG.integers(0, M.N, (3, M.K)).astype(np.int32)
    sp = sparse_inputs(True)
    np.savez(tmp_path / "in.npz", ids=ids, **{"sparse_" + k: v for k, v in sp.items()})
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, ops.library_path(), keras_dst, sparse_dst,
         str(tmp_path)], capture_output=True, text=True, timeout=300, env=env,
        cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NEEDS_OP: True" in proc.stdout, proc.stdout  # the op really is in the graph
    assert "modules: []" in proc.stdout  # nothing of pkm_serve but the .so
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(out["keras"], keras_ref({"ids": ids}), rtol=1e-4, atol=1e-5)
    want = M.np_sparse_bag(table, sp["ids"], sp["ids_1"], sp["ids_2"], sp["w_1"], "mean")
    np.testing.assert_allclose(out["sparse"], want, rtol=1e-5, atol=1e-5)


def test_project_composite_with_padding(tmp_path):
    table, _ = M.project_composite(tmp_path / "m", "mean")
    result = export(tmp_path / "m", tmp_path / "out")
    assert [s.status for s in result.sites] == ["fused"]
    assert op_counts(result.dst).get("PkmEmbeddingBag") == 1
    assert table_gathers(result.dst) == []
    idx = RNG.integers(0, M.N, (5, M.K)).astype(np.int64)
    idx[1, 2:] = -1  # padding: skipped and not counted by mean
    idx[3, :] = -1   # an all-padding bag: zeros
    w = RNG.uniform(0.5, 1.5, (5, M.K)).astype(np.float32)
    got = run(result.dst, "serving_default", {"idx": idx, "w": w})["out"]
    want = np.zeros((5, M.D))
    for b in range(5):
        keep = idx[b] >= 0
        if keep.any():
            want[b] = M.np_bag(table, idx[b][keep], w[b][keep], "mean")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_unsorted_sparse_ids_fail_like_the_composite(tmp_path):
    """The composite's segment ops reject ids out of row order; so does the
    fused site (an Assert on the row ids), naming the problem."""
    M.sparse_lookup(tmp_path / "m", True, "mean")
    result = export(tmp_path / "m", tmp_path / "out")
    x = sparse_inputs(True)
    order = [2, 3, 4, 0, 1, 5]  # bag 2's entries before bag 0's
    for key in ("ids", "w"):
        x[key] = x[key][order]
    for key in ("ids_1", "w_1"):
        x[key] = x[key][order]
    with pytest.raises(tf.errors.InvalidArgumentError):
        run(tmp_path / "m", "serving_default", x)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be >= 0 and sorted"):
        run(result.dst, "serving_default", x)


def test_negative_sparse_row_ids_fail_like_the_composite(tmp_path):
    """The composite's segment ops refuse a negative row ("segment ids must be >= 0", or
    "Segment id -1 out of range"); the fused site said the row indices must be sorted."""
    M.sparse_lookup(tmp_path / "m", True, "mean")
    result = export(tmp_path / "m", tmp_path / "out")
    x = sparse_inputs(True)
    x["ids"], x["w"] = x["ids"].copy(), x["w"].copy()
    x["ids"][0, 0] = x["w"][0, 0] = -1  # the first entry's row: still non-decreasing
    with pytest.raises(tf.errors.InvalidArgumentError, match=r">= 0|Segment id -1 out of range"):
        run(tmp_path / "m", "serving_default", x)
    with pytest.raises(tf.errors.InvalidArgumentError, match="row indices must be >= 0"):
        run(result.dst, "serving_default", x)


def test_reductions_over_the_feature_axis_are_not_bag_sites(tmp_path):
    """A LayerNorm-style mean over D of embedded tokens is no bag: not reported."""
    table = M._table(20)

    class Mod(tf.Module):
        def __init__(self):
            self.t = tf.Variable(table)

        @tf.function(input_signature=[tf.TensorSpec([None, M.K], tf.int32)])
        def serve(self, idx):
            x = tf.gather(self.t, idx) + 1.0
            return {"centered": x - tf.reduce_mean(x, axis=-1, keepdims=True)}

    m = Mod()
    tf.saved_model.save(m, str(tmp_path / "m"), signatures={"serving_default": m.serve})
    result = export(tmp_path / "m", tmp_path / "out")
    assert result.sites == [] and "no composite gather-sum sites found" in result.message
