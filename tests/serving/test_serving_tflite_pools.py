"""`pkm-serve serve --prefer_tflite_model` sizes each TFLite version's interpreter pool from
--num_tflite_pools as TF Serving: absent, one per CPU the process may run on (main.cc's
default, NumSchedulableCPUs: the affinity mask, not every CPU of the machine); 0 is one."""
import logging
import os

import numpy as np
import pytest

from pkm_serve import tflite

TABLE = np.random.default_rng(4).standard_normal((16, 4)).astype(np.float32)


@pytest.mark.parametrize("flag, interpreters", [(None, 3), ("--num_tflite_pools=0", 1),
                                                ("--num_tflite_pools=2", 2)])
def test_server_sizes_tflite_pools_as_tf_serving(tmp_path, monkeypatch, caplog, flag, interpreters):
    from serving_helpers import free_port
    from pkm_serve.serving import config
    from pkm_serve.serving.server import Server
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.tflite").write_bytes(tflite.build_embedding_bag_model(TABLE, 2))
    # A process allowed on 3 of the machine's 5 CPUs (as under taskset or a container's cpuset).
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    argv = [f"--model_base_path={tmp_path / 'm'}", "--model_name=m", f"--port={free_port()}", "--load_pkm_ops=false",
            "--prefer_tflite_model=true", "--file_system_poll_wait_seconds=0"] + ([flag] if flag else [])
    server = Server(config.parse_args(argv))
    with caplog.at_level(logging.INFO, logger="pkm_serve.serving"):
        server.start()
    try:
        said = [r.getMessage() for r in caplog.records if "TFLite interpreter(s)" in r.getMessage()]
        assert len(said) == 1 and said[0].endswith(f"with {interpreters} TFLite interpreter(s)"), said
    finally:
        server.stop()
