"""--ssl_config_file (TF Serving's SSLConfig): gRPC and REST over TLS; plaintext refused."""
import http.client
import json
import shutil
import ssl
import subprocess
import urllib.request

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from serving_helpers import ServerProcess


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test certificate")
def test_tls_for_grpc_and_rest(tmp_path, saved_models, tf_with_ops):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    # json.dumps gives a quoted string with \n escapes, which text format reads back verbatim.
    (tmp_path / "ssl.config").write_text(f"server_key: {json.dumps(key.read_text())}\n"
                                         f"server_cert: {json.dumps(cert.read_text())}\n")
    base = saved_models[1].rsplit("/", 1)[0]
    srv = ServerProcess(tmp_path, "--model_name=pkm", f"--model_base_path={base}",
                        "--file_system_poll_wait_seconds=0", f"--ssl_config_file={tmp_path / 'ssl.config'}")
    try:
        query = np.ones((1, 32), np.float32)
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "pkm"
        req.inputs["query"].CopyFrom(tf_with_ops.make_tensor_proto(query))
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(srv.target, creds) as ch:
            resp = prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=30)
        want = tf_with_ops.saved_model.load(saved_models[2]).signatures["serving_default"](query=query)
        np.testing.assert_allclose(tf_with_ops.make_ndarray(resp.outputs["output"]), want["output"].numpy(),
                                   rtol=1e-6, atol=1e-7)
        with grpc.insecure_channel(srv.target) as ch:
            with pytest.raises(grpc.RpcError) as err:
                prediction_service_pb2_grpc.PredictionServiceStub(ch).Predict(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        ctx = ssl.create_default_context(cafile=str(cert))
        https = f"https://127.0.0.1:{srv.rest_port}/v1/models/pkm"
        with urllib.request.urlopen(https, context=ctx, timeout=30) as r:
            assert json.loads(r.read())["model_version_status"][0]["state"] == "AVAILABLE"
        # Plaintext HTTP to the TLS port: the handshake fails, no response is served.
        with pytest.raises((OSError, http.client.HTTPException)):   # URLError/reset/bad status line
            urllib.request.urlopen(f"http://127.0.0.1:{srv.rest_port}/v1/models/pkm", timeout=10).close()
    finally:
        assert srv.terminate() == 0
