"""The TF forward kernels' ParallelFor (TfForwardParallelFor, kernels/tf/embedding_bag_common.h):
blocks claimed by the calling thread and the intra-op pool's threads as they come, the pool's
threads lingering after their blocks to join the next forward (PKM_FORWARD_LINGER_US). Every block
must run exactly once, the results must not depend on which thread ran it (bitwise those of TF's
own ParallelFor, selected by PKM_TF_PARALLEL_FOR=tf, with the gradients that follow, and those
with helpers that park at once, PKM_FORWARD_LINGER_US=0), and forwards running at once from
several threads must not mix up their blocks, lingering helpers joining whichever forward was
published last. Run in a child process with 4 intra-op threads, so that the forward is split into
blocks whatever the machine's core count."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import os, threading
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(4)
    tf.config.threading.set_inter_op_parallelism_threads(4)
    from pkm_serve import ops, quantized
    from tests.reference import bag_forward_backward, dequantize_rows

    rng = np.random.default_rng(7)

    def run(table, idx, w, combiner, grad):
        t, wt = tf.constant(table), tf.constant(w)
        with tf.GradientTape() as tape:
            tape.watch([t, wt])
            out = ops.embedding_bag(t, tf.constant(idx), wt, combiner=combiner)
        d_t, d_w = tape.gradient(out, [t, wt], output_gradients=tf.constant(grad))
        return out.numpy(), tf.convert_to_tensor(d_t).numpy(), d_w.numpy()

    def worst(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.max(np.abs(a - b) / (1.0 + np.abs(b))))

    # Many bags of a small table (several bags per block, many blocks), few bags of a wide one, and
    # a long call (16 blocks a thread).
    for b, k, d, n, combiner in [(300, 16, 64, 500, "sum"), (37, 9, 1024, 200, "mean"), (1000, 8, 32, 50, "sqrtn"),
                                 (3000, 24, 256, 4000, "sum")]:
        table = rng.standard_normal((n, d)).astype(np.float32)
        idx = rng.integers(-1, n, size=(b, k)).astype(np.int32)  # -1: padding
        w = rng.uniform(0.1, 1.0, size=(b, k)).astype(np.float32)
        grad = rng.standard_normal((b, d)).astype(np.float32)
        os.environ.pop("PKM_TF_PARALLEL_FOR", None)
        claimed = run(table, idx, w, combiner, grad)
        os.environ["PKM_TF_PARALLEL_FOR"] = "tf"
        tf_pool = run(table, idx, w, combiner, grad)
        os.environ.pop("PKM_TF_PARALLEL_FOR")
        os.environ["PKM_FORWARD_LINGER_US"] = "0"
        parked = run(table, idx, w, combiner, grad)
        os.environ.pop("PKM_FORWARD_LINGER_US")
        for other, name in ((tf_pool, "TF's ParallelFor"), (parked, "helpers that park at once")):
            for got, want, what in zip(claimed, other, ("out", "d_table", "d_weights")):
                assert np.array_equal(got, want), f"{what} differs from {name} at B={b}"
        out, d_table, d_w = bag_forward_backward(table, idx.tolist(), w.tolist(), combiner, grad)
        assert worst(claimed[0], out) < 1e-5, ("forward", b, worst(claimed[0], out))
        assert worst(claimed[1], d_table) < 1e-4, ("d_table", b, worst(claimed[1], d_table))
        assert worst(claimed[2], np.array(d_w)) < 1e-4, ("d_weights", b)

    # Calls from twelve Python threads at once, eight on int8 rows and four on float32 rows of
    # another shape (each op's blocks are its own, whichever forward a lingering helper joins).
    table = rng.standard_normal((400, 128)).astype(np.float32)
    q, scales, biases = quantized.quantize_rows(table)
    qt = quantized.QuantizedTable(tf.constant(q), tf.constant(scales), tf.constant(biases))
    deq = dequantize_rows(q, scales, biases)
    problems = []
    for _ in range(8):
        idx = rng.integers(0, 400, size=(200, 12)).astype(np.int32)
        w = rng.uniform(0.1, 1.0, size=(200, 12)).astype(np.float32)
        problems.append((idx, w, bag_forward_backward(deq, idx.tolist(), w.tolist(), "sum",
                                                      np.zeros((200, 128)))[0], lambda i, w: quantized.embedding_bag(qt, i, w)))
    ftable = rng.standard_normal((300, 96)).astype(np.float32)
    for _ in range(4):
        idx = rng.integers(0, 300, size=(150, 10)).astype(np.int32)
        w = rng.uniform(0.1, 1.0, size=(150, 10)).astype(np.float32)
        problems.append((idx, w, bag_forward_backward(ftable, idx.tolist(), w.tolist(), "mean",
                                                      np.zeros((150, 96)))[0],
                         lambda i, w: ops.embedding_bag(tf.constant(ftable), i, w, combiner="mean")))
    errors = []

    def worker(p):
        idx, w, want, forward = problems[p]
        first = None
        for _ in range(15):
            got = forward(tf.constant(idx), tf.constant(w)).numpy()
            if first is None:
                first = got
            if not np.array_equal(got, first) or worst(got, want) > 1e-5:
                errors.append((p, worst(got, want)))
                return

    threads = [threading.Thread(target=worker, args=(p,)) for p in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print("ok")
    """
)


def test_claimed_blocks_match_tf_parallel_for_and_reference():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("PKM_TF_PARALLEL_FOR", None)
    env.pop("PKM_FORWARD_LINGER_US", None)
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
