"""`pkm-serve export --warmup-requests N` writes TF Serving's warmup file
(assets.extra/tf_serving_warmup_requests: PredictionLog records of
PredictRequests) from the verification inputs; pkm_serve's server replays it on
load. The records round-trip: the server's loader replays every one, and each
request run through the served version equals numpy float64 on its inputs."""
import os
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_models as M  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.export import main  # noqa: E402
from pkm_serve.export.warmup import WARMUP_FILE  # noqa: E402
from pkm_serve.serving.loader import make_loader_factory  # noqa: E402

ops.load_library()
SIGNATURES = ("ellipsis", "named", "unweighted")


@pytest.fixture(scope="module")
def einsum_model(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "einsum"
    table, _ = M.einsum_forms(src)
    return str(src), table


def _records(path):
    from tensorflow_serving.apis import prediction_log_pb2
    return [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(path)]


def test_warmup_requests_replay_in_the_server(einsum_model, tmp_path, caplog):
    src, table = einsum_model
    dst = tmp_path / "models"
    assert main([src, str(dst), "--warmup-requests", "2", "--quiet"]) == 0
    version_dir = str(dst / "1")
    records = _records(os.path.join(version_dir, WARMUP_FILE))
    assert len(records) == 2 * len(SIGNATURES)
    loader = make_loader_factory(warmup=True)("einsum", 1, version_dir)
    with caplog.at_level("INFO", logger="pkm_serve.serving"):
        loader.load()
    try:
        assert f"replayed {len(records)} warmup requests" in caplog.text
        servable = loader.servable()
        for entry in records:
            request = entry.predict_log.request
            name = request.model_spec.signature_name
            inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
            assert name in SIGNATURES and set(inputs) == set(servable.signature(name).input_specs)
            assert inputs["idx"].shape[0] > 0 and inputs["idx"].max() < M.N
            [got] = servable.signature(name).run(inputs).values()
            want = M.np_bag(table, inputs["idx"], inputs.get("w"))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # request 1 and 2 of a signature are different batches
        first = [r for r in records if r.predict_log.request.model_spec.signature_name == "named"]
        assert not np.array_equal(*[tf.make_ndarray(r.predict_log.request.inputs["idx"]) for r in first])
    finally:
        loader.unload()


def test_no_warmup_file_by_default(einsum_model, tmp_path):
    src, _ = einsum_model
    assert main([src, str(tmp_path / "m"), "--quiet"]) == 0
    assert not os.path.exists(tmp_path / "m" / "1" / WARMUP_FILE)


def test_bad_warmup_requests_write_nothing(einsum_model, tmp_path, capsys):
    src, _ = einsum_model
    assert main([src, str(tmp_path / "a"), "--warmup-requests", "0", "--quiet"]) == 1
    assert "--warmup-requests must be >= 1, got 0" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "a")
    # A SRC with a warmup file of its own: replacing it silently would lose it.
    own = tmp_path / "own"
    shutil.copytree(src, own)
    os.makedirs(own / "assets.extra", exist_ok=True)
    (own / WARMUP_FILE).write_bytes(b"")
    assert main([str(own), str(tmp_path / "b"), "--warmup-requests", "1", "--quiet"]) == 1
    assert "has its own assets.extra/tf_serving_warmup_requests" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "b")


def test_example_and_ragged_warmup_requests_replay(tmp_path, caplog):
    """Serialized tf.Examples (strings) and a ragged signature's parts: the
    records the server replays are those inputs, which the original model,
    served the same way, answers alike."""
    table = M._table(31)
    module = tf.Module()
    module.table = tf.Variable(table)
    spec = {"ids": tf.io.VarLenFeature(tf.int64), "w": tf.io.VarLenFeature(tf.float32)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def examples(serialized):
        f = tf.io.parse_example(serialized, spec)
        return {"bag": tf.nn.embedding_lookup_sparse(module.table, f["ids"], f["w"], combiner="mean")}

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
    def ragged(ids):
        return {"bag": tf.reduce_sum(tf.gather(module.table, ids), axis=1)}

    module.examples, module.ragged = examples, ragged
    src = str(tmp_path / "src")
    tf.saved_model.save(module, src, signatures={"examples": examples, "ragged": ragged})
    assert main([src, str(tmp_path / "m"), "--warmup-requests", "3", "--quiet"]) == 0
    records = _records(str(tmp_path / "m" / "1" / WARMUP_FILE))
    assert sorted(r.predict_log.request.model_spec.signature_name for r in records) == \
        ["examples"] * 3 + ["ragged"] * 3
    factory = make_loader_factory(warmup=True)
    fused, original = factory("m", 1, str(tmp_path / "m" / "1")), factory("o", 1, src)
    with caplog.at_level("INFO", logger="pkm_serve.serving"):
        fused.load()
    original.load()
    try:
        assert "replayed 6 warmup requests" in caplog.text
        for entry in records:
            request = entry.predict_log.request
            inputs = {k: tf.make_ndarray(v) for k, v in request.inputs.items()}
            name = request.model_spec.signature_name
            got = fused.servable().signature(name).run(inputs)["bag"]
            want = original.servable().signature(name).run(inputs)["bag"]
            assert got.shape[0] > 0
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        fused.unload()
        original.unload()


def test_a_signature_that_writes_state_gets_no_warmup_requests(tmp_path):
    """A signature that assigns a variable was warmed up too: the server replays
    the file at every load, so each load changed the model (its scale went 1 -> 3)
    before the first request."""
    table = M._table(7)

    class Module(tf.Module):
        def __init__(self):
            self.t, self.scale = tf.Variable(table), tf.Variable(1.0)

        @tf.function(input_signature=[tf.TensorSpec([None, M.K], tf.int32, name="idx")])
        def serve(self, idx):
            return {"o": tf.reduce_sum(tf.gather(self.t, idx), 1) * self.scale}

        @tf.function(input_signature=[tf.TensorSpec([None, M.K], tf.int32, name="idx")])
        def bump(self, idx):
            self.scale.assign_add(1.0)
            return {"o": tf.reduce_sum(tf.gather(self.t, idx), 1) * self.scale}

    module = Module()
    tf.saved_model.save(module, str(tmp_path / "src"), signatures={"serving_default": module.serve,
                                                                    "bump": module.bump})
    dst = tmp_path / "models"
    assert main([str(tmp_path / "src"), str(dst), "--warmup-requests", "2", "--quiet"]) == 0
    records = _records(os.path.join(str(dst / "1"), WARMUP_FILE))
    assert [r.predict_log.request.model_spec.signature_name for r in records] == ["serving_default"] * 2
    loader = make_loader_factory(warmup=True)("m", 1, str(dst / "1"))
    loader.load()
    try:
        idx = np.arange(M.K, dtype=np.int32)[None]
        [got] = loader.servable().signature("serving_default").run({"idx": idx}).values()
        np.testing.assert_allclose(got, M.np_bag(table, idx), rtol=1e-6)  # scale still 1
    finally:
        loader.unload()
