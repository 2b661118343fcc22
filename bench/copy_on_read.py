"""Benchmark: model.predict after training a sparse-gradient table with stock Keras optimizers.

    .venv/bin/python bench/copy_on_read.py [--rows 262144 --dim 128 --bag 8 --batch 256]

A layer with sparse_gradient=True gets a row-sparse gradient, which stock Keras
optimizers ("sgd", "adagrad") apply with scatter updates; a scatter leaves a TF
variable in copy-on-read mode, where every dense read (the inference graph's
ReadVariableOp) copies the whole table. The layer makes its table's scatter
methods switch it back (pkm_serve/_copy_on_write.py).
Per optimizer, in one process: predict_on_batch before training, after one
epoch of fit (the layer as shipped), and after one more scatter through the
unwrapped ResourceVariable method (the state stock training left the table in
before the change), interleaved; and the fit step time. Then a custom loop on
ragged bags, whose lookup reads the table densely in training too: step and
forward times of a wrapped table against an unwrapped one, interleaved.
Results: bench/results/copy_on_read[_<tag>].{json,md}, the machine named inside.
"""
import argparse
import sys
import time

from harness import ROOT, interleaved, machine_name, utc_date, write_results

sys.path.insert(0, ROOT)
from tests.ops.test_copy_on_read import _reads_copy as reads_copy  # noqa: E402  (the tests' probe)


def run_optimizer(name, args):
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(0)
    layer = EmbeddingBag(args.rows, args.dim, sparse_gradient=True)
    inputs = keras.Input((args.bag,), dtype="int32")
    model = keras.Model(inputs, layer(inputs))
    model.compile(optimizer=name, loss="mse")
    steps = 8
    x = rng.integers(0, args.rows, (args.batch * steps, args.bag)).astype(np.int32)
    y = rng.standard_normal((args.batch * steps, args.dim)).astype(np.float32)
    batch = x[:args.batch]
    predict = lambda: model.predict_on_batch(batch)  # noqa: E731
    before = interleaved({"predict": predict}, args.repeats, warmup=2)["systems"]["predict"]

    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # traces and warms the step
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
    step_ms = (time.perf_counter() - start) * 1e3 / (steps * args.epochs)
    table = layer.embeddings.value
    shipped_copies = reads_copy(table)
    after = interleaved({"predict": predict}, args.repeats, warmup=2)["systems"]["predict"]
    # The unwrapped method: what every stock scatter did to the table before the change.
    resource_variable_ops.ResourceVariable.scatter_add(
        table, tf.IndexedSlices(tf.zeros([1, args.dim]), tf.constant([0])))
    unwrapped_copies = reads_copy(table)
    copied = interleaved({"predict": predict}, args.repeats, warmup=2)["systems"]["predict"]
    return {"optimizer": name, "fit_step_ms": step_ms,
            "predict_before_training_ms": before, "predict_after_training_ms": after,
            "predict_copy_on_read_ms": copied, "reads_copy_after_training": shipped_copies,
            "reads_copy_after_unwrapped_scatter": unwrapped_copies,
            "copy_on_read_over_shipped": copied["median_ms"] / after["median_ms"]}


def ragged_training(args):
    """A custom loop on ragged bags (whose lookup reads the table densely, as on a GPU): the
    SGD step and a forward of a table whose scatters are wrapped, against one left unwrapped."""
    import contextlib

    import keras
    import numpy as np
    import tensorflow as tf

    from pkm_serve import _copy_on_write
    from pkm_serve.layers import EmbeddingBag

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 2 * args.bag, args.batch)
    bags = tf.RaggedTensor.from_row_lengths(
        rng.integers(0, args.rows, int(lengths.sum())).astype(np.int32), lengths)

    @contextlib.contextmanager
    def unwrapped():
        keep = _copy_on_write.stay_copy_on_write_after_scatters
        _copy_on_write.stay_copy_on_write_after_scatters = lambda variable: None
        try:
            yield
        finally:
            _copy_on_write.stay_copy_on_write_after_scatters = keep

    def make(scope):
        layer, optimizer = EmbeddingBag(args.rows, args.dim, sparse_gradient=True), keras.optimizers.SGD(0.1)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(layer(bags)))
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))

        forward = tf.function(lambda: layer(bags))
        with scope:  # traced here: the wrapping happens (or not) at trace time
            step()
            forward()
        return step, lambda: forward().shape, layer

    step_w, forward_w, layer_w = make(contextlib.nullcontext())
    step_u, forward_u, layer_u = make(unwrapped())
    steps = interleaved({"wrapped": step_w, "unwrapped": step_u}, args.repeats, warmup=2)
    forwards = interleaved({"wrapped": forward_w, "unwrapped": forward_u}, args.repeats, warmup=2)
    return {"steps": steps, "forwards": forwards, "reads_copy": {
        "wrapped": reads_copy(layer_w.embeddings.value), "unwrapped": reads_copy(layer_u.embeddings.value)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=262144)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--bag", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", default="sgd,adagrad")
    parser.add_argument("--tag", default="", help="results file suffix, e.g. the host and round")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    rows = [run_optimizer(name, args) for name in args.optimizers.split(",")]
    ragged = ragged_training(args)
    machine = machine_name()
    mb = args.rows * args.dim * 4 / 2**20
    lines = [f"# predict after sparse training with stock Keras optimizers ({machine}, {utc_date()})", "",
             f"Table {args.rows} x {args.dim} float32 ({mb:.0f} MB), {args.batch} bags of {args.bag}, "
             f"{args.threads} threads; `python bench/copy_on_read.py`; predict_on_batch ms, median "
             f"(min) of {args.repeats}.", "",
             "| optimizer | fit step ms | predict before training | after training (shipped) "
             "| after an unwrapped scatter (copy-on-read) | ratio | reads copy: shipped / unwrapped |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cell = lambda s: f"{s['median_ms']:.2f} ({s['min_ms']:.2f})"  # noqa: E731
        lines.append(f"| {r['optimizer']} | {r['fit_step_ms']:.2f} | {cell(r['predict_before_training_ms'])} | "
                     f"{cell(r['predict_after_training_ms'])} | {cell(r['predict_copy_on_read_ms'])} | "
                     f"{r['copy_on_read_over_shipped']:.1f}x | {r['reads_copy_after_training']} / "
                     f"{r['reads_copy_after_unwrapped_scatter']} |")
    cell = lambda s: f"{s['median_ms']:.2f} ({s['min_ms']:.2f})"  # noqa: E731
    lines += ["", "A custom loop on ragged bags of 1..%d (the lookup reads the table densely, as it does on a GPU), "
              "SGD, the table's scatters wrapped (as shipped) against unwrapped, interleaved:" % (2 * args.bag - 1), "",
              "| | wrapped ms | unwrapped ms | unwrapped / wrapped |", "|---|---|---|---|"]
    for what, key in (("training step", "steps"), ("forward after training", "forwards")):
        res = ragged[key]
        lines.append(f"| {what} | {cell(res['systems']['wrapped'])} | {cell(res['systems']['unwrapped'])} | "
                     f"{res['ratios']['unwrapped/wrapped']['median']:.1f}x |")
    lines += ["", f"Reads copy after training: wrapped {ragged['reads_copy']['wrapped']}, "
              f"unwrapped {ragged['reads_copy']['unwrapped']}."]
    markdown = "\n".join(lines)
    print(markdown)
    if not args.no_write:
        report = {"machine": machine, "date": utc_date(), "args": vars(args), "rows": rows,
                  "ragged_training": ragged}
        print(write_results("copy_on_read" + (f"_{args.tag}" if args.tag else ""), report, markdown))


if __name__ == "__main__":
    main()
