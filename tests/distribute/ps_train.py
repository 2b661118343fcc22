"""An in-process ParameterServerStrategy cluster on loopback ports: 2 workers
and 2 parameter servers as tf.distribute.Servers in this process, a table
row-partitioned over the PS tasks (variable_partitioner -> ShardedVariable),
one fused lookup per shard on the shard's device. Run as a script (the cluster
connection changes the process' eager context, and only exiting the process
shuts in-process servers down):

    python ps_train.py OUT.json [--shards 2] [--steps 40] [--rows 4096] [--dim 32]
        [--bag 8] [--batch 64] [--sparse 1]

Writes: forward errors against the unsharded table for every combiner, the
eval loss before and after training, steps/s, and the TCP endpoints the
cluster used (from /proc/self/net/tcp*).
"""

import argparse
import json
import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import ops  # noqa: E402

LOOPBACK = "127.0.0.1"


def free_ports(count):
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind((LOOPBACK, 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def tcp_endpoints(ports):
    """(local, remote, state) of this process' TCP sockets on the cluster's ports."""
    ports, found = set(ports), []
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/self/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            lport, rport = int(local.split(":")[1], 16), int(remote.split(":")[1], 16)
            if lport in ports or rport in ports:
                found.append((_addr(local), _addr(remote), state))
    return found


def _addr(hex_addr):
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # /proc prints IPv6 as four little-endian 32-bit words
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def make_cluster(num_workers=2, num_ps=2):
    ports = free_ports(num_workers + num_ps)
    spec = {"worker": [f"{LOOPBACK}:{p}" for p in ports[:num_workers]],
            "ps": [f"{LOOPBACK}:{p}" for p in ports[num_workers:]]}
    cluster = tf.train.ClusterSpec(spec)
    # Blocking cross-task receives need spare inter-op threads on a 2-core machine.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=num_workers + num_ps + 2)
    servers = [tf.distribute.Server(cluster, job_name=job, task_index=i, protocol="grpc", config=config,
                                    start=True)
               for job in ("worker", "ps") for i in range(len(spec[job]))]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    return resolver, servers, ports, spec


def save_lookup(table, save_dir):
    """A SavedModel of a weighted sqrtn lookup of the (sharded) table, saved from the
    cluster's chief, and the trained rows beside it for the test's reference."""
    module = tf.Module()
    module.table = table

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64), tf.TensorSpec([None, None], tf.float32)])
    def serve(ids, w):
        return {"out": ops.embedding_bag(module.table, ids, w, combiner="sqrtn")}

    tf.saved_model.save(module, os.path.join(save_dir, "model"), signatures={"serving_default": serve})
    shards = list(table.variables) if hasattr(table, "variables") else [table]
    np.save(os.path.join(save_dir, "table.npy"), np.concatenate([s.numpy() for s in shards]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--bag", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sparse", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--save-dir", default=None, help="also save a SavedModel of a lookup of the trained table")
    args = ap.parse_args()
    ops.load_library()  # registers the ops for the in-process workers and PS too

    resolver, servers, ports, spec = make_cluster()
    def partitioner(shape, dtype):  # the table in --shards row blocks, the rest whole
        return [args.shards if shape[0] == args.rows else 1] + [1] * (len(shape) - 1)

    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    rng = np.random.default_rng(0)
    init = (rng.standard_normal((args.rows, args.dim)) * 0.1).astype(np.float32)
    hidden = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    readout = rng.standard_normal((args.dim, 1)).astype(np.float32)
    with strategy.scope():
        table = tf.Variable(init, name="table")
        head = tf.Variable(readout, name="head")  # fixed target read-out, trained too
    shards = list(table.variables) if hasattr(table, "variables") else [table]
    result = {"shards": len(shards), "shard_devices": [s.device for s in shards],
              "shard_rows": [int(s.shape[0]) for s in shards], "cluster": spec}

    # Forward: every combiner, weighted and ragged, against the unsharded op.
    idx_np = rng.integers(-1, args.rows, size=(16, args.bag))
    w_np = rng.uniform(0.1, 1, size=idx_np.shape).astype(np.float32)
    ragged = tf.ragged.constant([[3, args.rows - 1], [], [0, 5, 5, -1]], dtype=tf.int64)

    @tf.function
    def forward():
        outs = [ops.embedding_bag(shards, tf.constant(idx_np), tf.constant(w_np), c) for c in ops.WEIGHTED_COMBINERS]
        return outs + [ops.embedding_bag(shards, ragged, combiner="mean")]

    got = coordinator.fetch(coordinator.schedule(forward))
    want = [ops.embedding_bag(init, idx_np, w_np, c).numpy() for c in ops.WEIGHTED_COMBINERS]
    want.append(ops.embedding_bag(init, ragged, combiner="mean").numpy())
    result["forward_max_abs_err"] = [float(np.max(np.abs(g - w))) for g, w in zip(got, want)]

    def dataset_fn():
        def gen(seed):
            x = tf.random.stateless_uniform([args.batch, args.bag], tf.stack([seed, seed]), 0, args.rows,
                                            dtype=tf.int64)
            return x, tf.gather(hidden, x)
        ds = tf.data.Dataset.range(1, 1 << 30).map(gen)
        return ds.map(lambda x, rows: (x, tf.matmul(tf.reduce_mean(rows, 1), readout))).prefetch(2)

    per_worker = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def loss_fn(x, y):
        pred = tf.matmul(ops.embedding_bag(shards, x, combiner="mean", sparse_gradient=bool(args.sparse)), head)
        return tf.reduce_mean(tf.square(pred - y))

    @tf.function
    def train_step(iterator):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(x, y)
            grads = tape.gradient(loss, shards + [head])
            for var, g in zip(shards + [head], grads):
                if isinstance(g, tf.IndexedSlices):  # touched rows only, on the PS
                    var.scatter_sub(tf.IndexedSlices(args.lr * g.values, g.indices))
                elif g is not None:
                    var.assign_sub(args.lr * g)
            return loss
        x, y = next(iterator)
        return strategy.run(replica, args=(x, y))

    eval_x = rng.integers(0, args.rows, size=(512, args.bag))
    eval_y = hidden[eval_x].mean(1) @ readout

    @tf.function
    def evaluate():
        return loss_fn(tf.constant(eval_x), tf.constant(eval_y))

    result["loss_before"] = float(coordinator.fetch(coordinator.schedule(evaluate)))
    for _ in range(4):  # warm-up: trace and place on both workers
        coordinator.schedule(train_step, args=(per_worker,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(args.steps):
        coordinator.schedule(train_step, args=(per_worker,))
    coordinator.join()
    elapsed = time.perf_counter() - start
    result["steps_per_s"] = args.steps / elapsed
    result["loss_after"] = float(coordinator.fetch(coordinator.schedule(evaluate)))
    if args.save_dir:
        save_lookup(table, args.save_dir)
    result["tcp"] = tcp_endpoints(ports)
    result["args"] = vars(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.flush()
    # In-process servers have no shutdown call: leaving the process ends them.
    os._exit(0)


if __name__ == "__main__":
    main()
