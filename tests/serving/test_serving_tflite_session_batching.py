"""`--num_tflite_interpreters_per_pool` above 1: a TFLite version batches its own requests as
TF Serving's TfLiteSession::Create sets up its BasicBatchScheduler (tflite_session.cc): one
batch thread per interpreter, large requests split into runs of
ceil(kInitialBatchSize=500 / interpreters_per_pool) rows, a request past 500 rows refused.
References: the .tflite run alone in the interpreter, and numpy float64."""
import threading

import grpc
import numpy as np
import pytest

import reference
from pkm_serve import tflite

N, D, K = 64, 8, 4
TABLE = np.random.default_rng(21).standard_normal((N, D)).astype(np.float32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tflite_session_batching") / "1"
    path.mkdir()
    (path / "model.tflite").write_bytes(tflite.build_embedding_bag_model(TABLE, K))
    return str(path)


def _bags(rng, rows):
    return {"indices": rng.integers(-1, N, size=(rows, K)).astype(np.int32),
            "weights": rng.random((rows, K)).astype(np.float32)}


def _alone(bags):
    return tflite.run_tflite(tflite.build_embedding_bag_model(TABLE, K), bags)[0]


@pytest.mark.parametrize("per_pool, runs", [(1, [300]), (4, [125, 125, 50]), (3, [167, 133])])
def test_large_request_runs_in_pieces_of_tflite_sessions_size(model_dir, invoked_rows, per_pool, runs):
    """The flag was refused as a usage error; TF Serving splits as here."""
    from pkm_serve.serving.tflite_servable import TfLiteServable
    servable = TfLiteServable("m", 1, model_dir, warmup=False, num_interpreters=2,
                              interpreters_per_pool=per_pool)
    try:
        bags = _bags(np.random.default_rng(per_pool), 300)
        got = servable.signature("").run(bags)["output"]
        assert invoked_rows == runs
        np.testing.assert_array_equal(got, _alone(bags))
        np.testing.assert_allclose(got, reference.embedding_bag(TABLE.astype(np.float64), bags["indices"],
                                                                bags["weights"]), rtol=1e-5, atol=1e-5)
    finally:
        servable.release()


def test_request_past_500_rows_is_refused_and_concurrent_ones_each_get_their_rows(model_dir):
    from pkm_serve.serving.errors import ServingError
    from pkm_serve.serving.tflite_servable import TfLiteServable
    servable = TfLiteServable("m", 1, model_dir, warmup=False, num_interpreters=2, interpreters_per_pool=2)
    try:
        sig = servable.signature("")
        with pytest.raises(ServingError) as err:
            sig.run(_bags(np.random.default_rng(0), 501))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Task size 501 is larger than maximum input batch size 500" in err.value.message
        rng = np.random.default_rng(5)
        cases = [_bags(rng, int(rng.integers(1, 40))) for _ in range(32)]
        results = [None] * len(cases)

        def client(i):
            results[i] = sig.run(cases[i])["output"]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for bags, got in zip(cases, results):
            np.testing.assert_array_equal(got, _alone(bags))
    finally:
        servable.release()


def test_flag_is_parsed_and_passed_to_tflite_versions(model_dir, invoked_rows):
    from pkm_serve.serving import config
    from pkm_serve.serving.loader import make_loader_factory
    args = config.parse_args(["--model_base_path=/m", "--num_tflite_interpreters_per_pool=4"])
    assert args.num_tflite_interpreters_per_pool == 4
    assert config.parse_args(["--model_base_path=/m"]).num_tflite_interpreters_per_pool == 1
    with pytest.raises(SystemExit):
        config.parse_args(["--model_base_path=/m", "--num_tflite_interpreters_per_pool=-1"])
    loader = make_loader_factory(warmup=False, prefer_tflite_model=True, num_tflite_interpreters=1,
                                 tflite_interpreters_per_pool=args.num_tflite_interpreters_per_pool)(
        "m", 1, model_dir)
    loader.load()
    try:
        loader.servable().signature("").run(_bags(np.random.default_rng(2), 200))
        assert invoked_rows == [125, 75]
    finally:
        loader.unload()


@pytest.mark.parametrize("threads, ok", [(1, True), (256, True), (0, False), (257, False)])
def test_tflite_num_threads_past_the_delegates_limit_is_a_usage_error(threads, ok, capsys):
    """--tflite_num_threads=300 started the server, then every .tflite version failed its
    load (the pkm_serve delegate takes 1 to 256 threads)."""
    from pkm_serve.serving import config
    argv = ["--model_base_path=/m", f"--tflite_num_threads={threads}"]
    if ok:
        assert config.parse_args(argv).tflite_num_threads == threads
        return
    with pytest.raises(SystemExit):
        config.parse_args(argv)
    assert f"--tflite_num_threads must be 1 to 256, got {threads}" in capsys.readouterr().err


def test_server_serves_the_flag_over_grpc(model_dir, tmp_path):
    """`pkm-serve serve --num_tflite_interpreters_per_pool=4` (refused before): a 300-row
    Predict is answered whole, a 501-row one refused as TfLiteSession's scheduler does."""
    import os
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
    from serving_helpers import ServerProcess
    srv = ServerProcess(tmp_path, f"--model_base_path={os.path.dirname(model_dir)}", "--model_name=m",
                        "--prefer_tflite_model=true", "--num_tflite_pools=2",
                        "--num_tflite_interpreters_per_pool=4", rest=False)
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

            def predict(bags):
                req = predict_pb2.PredictRequest()
                req.model_spec.name = "m"
                for key, value in bags.items():
                    req.inputs[key].CopyFrom(tf.make_tensor_proto(value))
                return tf.make_ndarray(stub.Predict(req, timeout=30).outputs["output"])
            bags = _bags(np.random.default_rng(7), 300)
            np.testing.assert_array_equal(predict(bags), _alone(bags))
            with pytest.raises(grpc.RpcError) as err:
                predict(_bags(np.random.default_rng(8), 501))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Task size 501 is larger than maximum input batch size 500" in err.value.details()
    finally:
        assert srv.terminate() == 0, srv.log()[-3000:]
