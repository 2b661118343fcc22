"""REST front-end flags as tensorflow_model_server reads them."""
import json
import time
import urllib.request

import pytest
from tensorflow_serving.apis import get_model_status_pb2

from pkm_serve.serving import config
from pkm_serve.serving.rest_frontend import RestFrontend

BASE = ["--model_base_path=/m", "--rest_api_port=8501"]


class _SlowStatus:
    """A service whose GetModelStatus takes `seconds`."""

    def __init__(self, seconds):
        self.seconds = seconds

    def get_model_status(self, request):
        time.sleep(self.seconds)
        resp = get_model_status_pb2.GetModelStatusResponse()
        resp.model_version_status.add(version=1, state=get_model_status_pb2.ModelVersionStatus.AVAILABLE)
        return resp


def test_rest_api_timeout_in_ms_0_is_no_deadline():
    """TF Serving hands --rest_api_timeout_in_ms to RunOptions.timeout_in_ms, where 0 is no
    timeout: it was refused ("must be >= 1"), and a frontend built with 0 gave every request
    one second."""
    assert config.parse_args(BASE + ["--rest_api_timeout_in_ms=0"]).rest_api_timeout_in_ms == 0
    with pytest.raises(SystemExit):
        config.parse_args(BASE + ["--rest_api_timeout_in_ms=-5"])
    frontend = RestFrontend(_SlowStatus(1.5), None, None, address="127.0.0.1", port=0, num_threads=2,
                            timeout_ms=0, max_body_bytes=1 << 20, drain_seconds=1)
    frontend.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{frontend.port}/v1/models/m", timeout=30) as r:
            assert r.status == 200
            assert json.loads(r.read())["model_version_status"][0]["state"] == "AVAILABLE"
    finally:
        frontend.stop()
