"""ParameterServerStrategy on an in-process loopback cluster (2 workers, 2 PS):
a table row-partitioned over the PS tasks gives the unsharded forward for
every combiner, training through ClusterCoordinator lowers the loss, every
connection stays on 127.0.0.1, and the cluster is gone when the test ends."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 60


def run_cluster(tmp_path, *flags):
    out = tmp_path / "ps.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "ps_train.py"), str(out), *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def host_of(endpoint):
    host = endpoint.rsplit(":", 1)[0]
    return host[len("::ffff:"):] if host.startswith("::ffff:") else host


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """run(sparse) -> (ps_train.py's results, its folder), one cluster process per value: the sparse
    one also saves a SavedModel of a lookup of its trained table there."""
    runs = {}

    def run(sparse):
        if sparse not in runs:
            folder = tmp_path_factory.mktemp(f"ps_sparse{sparse}")
            save = ["--save-dir", str(folder)] if sparse else []
            runs[sparse] = run_cluster(folder, "--shards", "2", "--rows", "1024", "--steps", str(STEPS), "--sparse",
                                       str(sparse), *save), folder
        return runs[sparse]
    return run


@pytest.mark.parametrize("sparse", [1, 0])
def test_sharded_table_on_ps_cluster(cluster_run, sparse):
    r, _ = cluster_run(sparse)
    # One shard per PS task, the rows split in two blocks.
    assert r["shards"] == 2 and sum(r["shard_rows"]) == 1024
    assert [d.split("/device")[0] for d in r["shard_devices"]] == ["/job:ps/replica:0/task:0",
                                                                   "/job:ps/replica:0/task:1"]
    # sum, mean, sqrtn (weighted) and ragged mean equal the unsharded op.
    assert len(r["forward_max_abs_err"]) == 4 and max(r["forward_max_abs_err"]) < 1e-5
    assert r["loss_after"] < 0.9 * r["loss_before"], (r["loss_before"], r["loss_after"])
    # Every cluster address is loopback, and so is every connection made.
    endpoints = [a for job in r["cluster"].values() for a in job]
    assert all(a.startswith("127.0.0.1:") for a in endpoints)
    connected = [(l, rem) for l, rem, state in r["tcp"] if state == "01"]  # ESTABLISHED
    assert connected, "no cluster connection seen"
    assert all(host_of(l) == "127.0.0.1" and host_of(rem) == "127.0.0.1" for l, rem in connected)
    # The process has exited: nothing listens on the cluster's ports any more.
    for a in endpoints:
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.settimeout(2)
            s.connect(("127.0.0.1", int(a.rsplit(":", 1)[1])))


def test_saved_model_of_a_ps_sharded_table_runs_without_the_cluster(cluster_run):
    """The bag ops were saved with the PS tasks' devices (tf.device of each shard):
    outside the cluster (this process) the SavedModel failed ("Cannot assign a device")."""
    import numpy as np
    import tensorflow as tf

    from pkm_serve import ops  # noqa: F401  (registers the op library)

    _, folder = cluster_run(1)
    model = tf.saved_model.load(str(folder / "model"))
    table = np.load(folder / "table.npy")
    ids = np.array([[0, 5, -1], [table.shape[0] - 1, 2, 2]])
    w = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]], np.float32)
    got = model.signatures["serving_default"](ids=tf.constant(ids), w=tf.constant(w))["out"].numpy()
    valid = (ids >= 0)[..., None]
    rows = table.astype(np.float64)[np.maximum(ids, 0)] * valid
    want = (rows * w[..., None]).sum(1) / np.sqrt((w.astype(np.float64) ** 2 * valid[..., 0]).sum(1, keepdims=True))
    assert np.abs(got - want).max() < 1e-5, (got, want)
