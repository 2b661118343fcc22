"""LazyAdam / RowwiseAdagrad with Keras' `gradient_accumulation_steps`: every `steps`-th step
applies the optimizer's row-sparse step to the mean of the window's gradients, on the rows any
step of the window touched. Before, Keras' `g + accumulator` made the table gradient dense, so
LazyAdam took dense Adam steps that moved rows the window never touched."""

import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.layers import EmbeddingBag  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402
from tests.row_optimizer_reference import apply_rows  # noqa: E402

N, D, STEPS = 12, 3, 2
LR, BETA_1, BETA_2, EPS = 0.1, 0.9, 0.999, 1e-7
# Two windows of two micro-steps; window 2 touches none of window 1's rows 0-3; rows 8.. never.
MICRO_ROWS = [[0, 1, 1], [2, 3], [4, 5, 4], [6, 7]]


def _micro_steps():
    rng = np.random.default_rng(11)
    return [(np.array(rows), rng.standard_normal((len(rows), D)), rng.standard_normal(D)) for rows in MICRO_ROWS]


def _windows():
    """(touched rows, their mean gradient rows, mean bias gradient) per window."""
    micro = _micro_steps()
    for start in range(0, len(micro), STEPS):
        dense, bias = np.zeros((N, D)), np.zeros(D)
        for rows, values, bias_grad in micro[start:start + STEPS]:
            np.add.at(dense, rows, values)
            bias += bias_grad
        touched = np.unique(np.concatenate([rows for rows, _, _ in micro[start:start + STEPS]]))
        yield touched, dense[touched] / STEPS, bias / STEPS


def _train(optimizer, compiled, jit_compile=False):
    table = keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")
    bias = keras.Variable(np.ones(D, np.float32), name="bias")
    optimizer.build([table, bias])

    def step(values, rows, bias_grad):
        optimizer.apply_gradients([(tf.IndexedSlices(values, rows, tf.constant([N, D])), table), (bias_grad, bias)])

    step = tf.function(step, jit_compile=jit_compile) if compiled else step
    for rows, values, bias_grad in _micro_steps():
        step(tf.constant(values, tf.float32), tf.constant(rows), tf.constant(bias_grad, tf.float32))
    return table, bias


def _initial_table():
    return np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
def test_lazy_adam_accumulates_row_sparse(compiled):
    optimizer = LazyAdam(LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPS, gradient_accumulation_steps=STEPS)
    table, bias = _train(optimizer, compiled)
    w, m, v = _initial_table(), np.zeros((N, D)), np.zeros((N, D))
    b, bm, bv = np.ones(D), np.zeros(D), np.zeros(D)
    for step, (touched, g, bg) in enumerate(_windows(), start=1):
        hyper = dict(lr=LR, epsilon=EPS, beta_1=BETA_1, beta_2=BETA_2, step=step)
        w, (m, v) = apply_rows("adam", w, g, touched, (m, v), **hyper)
        b, (bm, bv) = apply_rows("adam", b, bg, slice(None), (bm, bv), **hyper)
    np.testing.assert_allclose(table.numpy(), w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(optimizer._momentums[0].numpy(), m, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(bias.numpy(), b, rtol=2e-5, atol=2e-6)
    # The window's sums are gone after its update: the next window starts from zero.
    np.testing.assert_array_equal(optimizer._accumulated_gradients[0].numpy(), 0)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
def test_rowwise_adagrad_accumulates_row_sparse(jit_compile):
    # Under XLA Keras' dense accumulation is kept (a run-time-sized row set read XLA's padding);
    # RowwiseAdagrad's dense and sparse steps agree, so the numbers are the same.
    seen = []
    optimizer = RowwiseAdagrad(LR, initial_accumulator_value=0.1, epsilon=EPS, gradient_accumulation_steps=STEPS)
    update = optimizer._update_step
    optimizer._update_step = lambda g, v, lr: (seen.append(isinstance(g, tf.IndexedSlices)), update(g, v, lr))[1]
    table, _ = _train(optimizer, compiled=jit_compile, jit_compile=jit_compile)
    w, acc = _initial_table(), np.full(N, 0.1)
    for touched, g, _ in _windows():
        acc[touched] += np.mean(g * g, axis=1)
        w[touched] -= LR * g / np.sqrt(acc[touched] + EPS)[:, None]
    np.testing.assert_allclose(table.numpy(), w, rtol=2e-5, atol=2e-6)
    if not jit_compile:
        assert seen == [True, False] * (len(MICRO_ROWS) // STEPS)  # table row-sparse, bias dense


def test_fit_with_accumulation_leaves_rows_the_window_did_not_touch():
    keras.utils.set_random_seed(2)
    ids = keras.Input((2,), dtype="int32")
    bag = EmbeddingBag(N, D, sparse_gradient=True, name="bag")
    model = keras.Model(ids, keras.layers.Dense(1)(bag(ids)))
    model.compile(LazyAdam(0.05, gradient_accumulation_steps=STEPS), "mse")
    # Batches of 2: window 1 (batches 0, 1) looks up rows 0, 1; window 2 rows 2, 3 only.
    x = np.array([[0, 1]] * 4 + [[2, 3]] * 4, np.int32)
    after_window_1 = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch == 1 and after_window_1.append(bag.embeddings.numpy()))
    model.fit(x, np.ones((8, 1), np.float32), batch_size=2, shuffle=False, verbose=0, callbacks=[record])
    (first,) = after_window_1
    table = bag.embeddings.numpy()
    np.testing.assert_array_equal(table[:2], first[:2])  # dense Adam moved them on momentum
    assert not np.allclose(table[2:4], first[2:4])
    np.testing.assert_array_equal(table[4:], first[4:])


def test_a_store_saved_before_the_row_marks_loads_mid_window():
    # Optimizer state saved before round 35 (no row marks): Keras skipped all of it with a warning.
    table = keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")
    saved = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    saved.build([table])
    rows, values, _ = _micro_steps()[0]
    saved.apply_gradients([(tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant(rows)), table)])
    store = {}
    saved.save_own_variables(store)
    marks = [i for i, v in enumerate(saved.variables) if v.path.endswith("_accumulated_rows")]
    old_store = {str(i): store[key] for i, key in enumerate(k for k in store if int(k) not in marks)}
    loaded = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    loaded.build([keras.Variable(np.zeros((N, D), np.float32), name="table")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.load_own_variables(old_store)
    for want, got in zip(saved.variables, loaded.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=want.path)


def test_accumulators_stay_out_of_copy_on_read_mode():
    # A scatter leaves a variable copying itself on every dense read (Keras' `acc + g` of a
    # dense gradient, a checkpoint): the accumulation's scatters switch it back.
    from tests.ops.test_copy_on_read import _reads_copy

    optimizer = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    _train(optimizer, compiled=False)  # ends with a reset
    table = keras.Variable(np.zeros((N, D), np.float32))
    mid_window = LazyAdam(LR, gradient_accumulation_steps=STEPS)
    mid_window.apply_gradients([(tf.IndexedSlices(tf.ones((1, D)), tf.constant([2])), table)])
    for variable in optimizer.variables + mid_window.variables:
        if len(variable.shape) >= 1:
            assert not _reads_copy(variable.value), variable.path


def test_a_window_begun_in_an_xla_step_ends_in_a_plain_one_as_in_plain_steps():
    # An XLA-compiled step accumulates as Keras does; the rows it touched are marked all the same,
    # so a later step outside XLA, ending the window, steps them (it left them out before).
    def train(first_compiled):
        table = keras.Variable(np.linspace(-1, 1, N * D).reshape(N, D).astype(np.float32), name="table")
        optimizer = LazyAdam(LR, gradient_accumulation_steps=STEPS)
        optimizer.build([table])

        def step(values, rows):
            optimizer.apply_gradients([(tf.IndexedSlices(values, rows, tf.constant([N, D])), table)])

        for index, (rows, values, _) in enumerate(_micro_steps()):
            run = tf.function(step, jit_compile=True) if first_compiled and index % STEPS == 0 else step
            run(tf.constant(values, tf.float32), tf.constant(rows))
        return table.numpy()

    np.testing.assert_allclose(train(True), train(False), rtol=1e-6, atol=1e-7)
