"""The fused backward + row-wise optimizer in TF: the op PkmEmbeddingBagFusedUpdate
against the float64 reference (tests/row_optimizer_reference.py), and layers built
with fused_optimizer=True trained by LazyAdam / RowwiseAdagrad against the same
layers on the unfused path (sparse_gradient=True: IndexedSlices, then the
optimizer's sparse update), in eager mode and in tf.function."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve import ops  # noqa: E402
from pkm_serve.layers import EmbeddingBag  # noqa: E402
from pkm_serve.optimizers import LazyAdam, RowwiseAdagrad  # noqa: E402
from tests.row_optimizer_reference import fused_update, initial_state, touched_rows  # noqa: E402

HYPER = {"sgd": dict(lr=0.05), "rowwise_adagrad": dict(lr=0.05, epsilon=1e-7),
         "adam": dict(lr=0.01, epsilon=1e-7, beta_1=0.9, beta_2=0.999, step=2)}


def run_op(kind, table, idx, weights, grad, state, combiner):
    lib = ops.load_library()
    var = tf.Variable(table)
    state_vars = [tf.Variable(s) for s in state]
    h = HYPER[kind]
    attrs = {k: v for k, v in h.items() if k in ("epsilon", "beta_1", "beta_2")}
    d_w = lib.pkm_embedding_bag_fused_update(grad, var.handle, idx, weights, [s.handle for s in state_vars],
                                             h["lr"], h.get("step", 1), combiner=combiner, optimizer=kind,
                                             **attrs)
    return var.numpy(), [s.numpy() for s in state_vars], d_w.numpy()


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_op_matches_float64_reference(kind, combiner):
    rng = np.random.default_rng(len(kind) + len(combiner))
    table = rng.standard_normal((50, 16)).astype(np.float32)
    idx = rng.integers(-1, 50, size=(12, 6)).astype(np.int64)
    weights = rng.uniform(0.3, 1.4, size=idx.shape).astype(np.float32)
    grad = rng.standard_normal((12, 16)).astype(np.float32)
    state = initial_state(kind, 50, 16)
    got_t, got_s, got_dw = run_op(kind, table, idx, weights, grad, state, combiner)
    want_t, want_s, want_dw = fused_update(kind, table, idx, weights, combiner, grad, state, **HYPER[kind])
    np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_s, want_s):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    np.testing.assert_allclose(got_dw[idx >= 0], want_dw[idx >= 0], rtol=1e-5, atol=1e-5)
    untouched = np.setdiff1d(np.arange(50), touched_rows(idx, 50))
    np.testing.assert_array_equal(got_t[untouched], table[untouched])


def test_op_rejects_bad_state_and_index():
    lib = ops.load_library()
    var = tf.Variable(tf.zeros([10, 4]))
    m = tf.Variable(tf.zeros([10, 3]))
    idx = tf.constant([[1, 2]], tf.int64)
    w = tf.ones([1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"optimizer state 0 must be float32 \[10,4\]"):
        lib.pkm_embedding_bag_fused_update(tf.ones([1, 4]), var.handle, idx, w, [m.handle, tf.Variable(m).handle],
                                           0.1, 1, optimizer="adam")
    # One variable in two roles was accepted and updated twice over (Adam m is v: NaN rows).
    other = tf.Variable(tf.zeros([10, 4]))
    for state in ([other, other], [var, other], [other, var]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="are the same variable"):
            lib.pkm_embedding_bag_fused_update(tf.ones([1, 4]), var.handle, idx, w, [s.handle for s in state],
                                               0.1, 1, optimizer="adam")
    with pytest.raises(tf.errors.InvalidArgumentError, match="takes 1 state variables"):
        lib.pkm_embedding_bag_fused_update(tf.ones([1, 4]), var.handle, idx, w, [], 0.1, 1,
                                           optimizer="rowwise_adagrad")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 12"):
        lib.pkm_embedding_bag_fused_update(tf.ones([1, 4]), var.handle, tf.constant([[1, 12]], tf.int64), w, [],
                                           0.1, 1, optimizer="sgd")
    np.testing.assert_array_equal(var.numpy(), 0)


def make_model(fused, seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((8,), dtype="int64")
    w = keras.Input((8,))
    bag = EmbeddingBag(300, 24, combiner="mean", sparse_gradient=not fused, fused_optimizer=fused,
                       embeddings_initializer="glorot_uniform", name="bag")
    out = keras.layers.Dense(3, name="head")(bag(ids, w))
    return keras.Model([ids, w], out)


def train(fused, make_opt, steps, compiled):
    model = make_model(fused)
    opt = make_opt()
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(1)

    def step(ids, w, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([ids, w]) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    run = tf.function(step) if compiled else step
    for _ in range(steps):
        ids = rng.integers(-1, 150, size=(32, 8))  # rows >= 150 are never touched
        run(tf.constant(ids), tf.constant(rng.uniform(0.5, 1.5, (32, 8)), tf.float32),
            tf.constant(rng.standard_normal((32, 3)), tf.float32))
    return model, opt


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("make_opt", [lambda: LazyAdam(0.01), lambda: RowwiseAdagrad(0.05)],
                         ids=["LazyAdam", "RowwiseAdagrad"])
def test_fused_layer_trains_like_the_unfused_sparse_path(make_opt, compiled):
    fused, fused_opt = train(True, make_opt, 4, compiled)
    plain, plain_opt = train(False, make_opt, 4, compiled)
    for a, b in zip(fused.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    for a, b in zip(fused_opt.variables, plain_opt.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=a.path)
    table = fused.get_layer("bag").embeddings.numpy()
    initial = make_model(True).get_layer("bag").embeddings.numpy()
    np.testing.assert_array_equal(table[150:], initial[150:])  # untouched rows never move
    assert not np.array_equal(table[:150], initial[:150])


def test_fused_refuses_gradient_options_and_round_trips_config():
    model = make_model(True)
    with pytest.raises(ValueError, match="does not support clipnorm"):
        LazyAdam(0.01, clipnorm=1.0).build(model.trainable_variables)
    layer = model.get_layer("bag")
    assert EmbeddingBag.from_config(layer.get_config()).fused_optimizer


@pytest.mark.parametrize("initial, epsilon", [(0.0, 1e-7), (0.1, 0.0)])
def test_fused_rowwise_adagrad_with_one_zero_hyperparameter_matches_reference(initial, epsilon):
    """Both 0 is refused at construction (tests/ops/test_sparse_optimizers.py), so no fused table
    gets it; one 0 is allowed: a row looked up with weight 0 (gradient 0) stays as it is and the
    fused update equals the float64 reference."""
    rng = np.random.default_rng(5)
    bag = EmbeddingBag(20, 4, fused_optimizer=True, embeddings_initializer="glorot_uniform")
    ids = np.array([[1, 2, 3], [4, 2, -1]], np.int64)
    w = np.array([[1.0, 0.0, 0.5], [2.0, 0.0, 1.0]], np.float32)
    bag(tf.constant(ids), tf.constant(w))
    opt = RowwiseAdagrad(0.05, initial_accumulator_value=initial, epsilon=epsilon)
    opt.build(bag.trainable_variables)
    table = bag.embeddings.numpy()
    d_out = rng.standard_normal((2, 4)).astype(np.float32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(bag(tf.constant(ids), tf.constant(w)) * d_out)
    grads = tape.gradient(loss, bag.trainable_variables)
    assert grads[0].values.shape[0] == 0  # the backward applied the update
    opt.apply_gradients(zip(grads, bag.trainable_variables))
    want_t, (want_acc,), _ = fused_update("rowwise_adagrad", table, ids, w, "sum", d_out, (np.full(20, initial),),
                                          lr=0.05, epsilon=epsilon)
    np.testing.assert_allclose(bag.embeddings.numpy(), want_t, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(opt._accumulators[0].numpy(), want_acc, rtol=1e-6)
    np.testing.assert_array_equal(bag.embeddings.numpy()[2], table[2])


def test_the_update_happens_in_the_backward_and_no_table_gradient_is_formed():
    model = make_model(True)
    opt = LazyAdam(0.01)
    opt.build(model.trainable_variables)
    table = model.get_layer("bag").embeddings
    before = table.numpy()
    ids = tf.constant([[1, 2, 3, -1, 4, 5, 6, 7]] * 4, tf.int64)
    w = tf.ones([4, 8])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model([ids, w]))
    grads = tape.gradient(loss, model.trainable_variables)
    table_grad = grads[[v.path for v in model.trainable_variables].index(table.path)]
    assert isinstance(table_grad, tf.IndexedSlices) and table_grad.values.shape[0] == 0
    moved = np.flatnonzero(np.any(table.numpy() != before, axis=1))
    np.testing.assert_array_equal(moved, [1, 2, 3, 4, 5, 6, 7])  # updated by tape.gradient itself
    opt.apply_gradients(zip(grads, model.trainable_variables))
    assert int(opt.iterations) == 1


# ---- what the fused update must refuse or leave alone (a helper's bug hunt, round 26) ----

def _fit_data(seed=2, n=64):
    rng = np.random.default_rng(seed)
    return ([rng.integers(0, 150, size=(n, 8)), rng.uniform(0.5, 1.5, (n, 8)).astype(np.float32)],
            rng.standard_normal((n, 3)).astype(np.float32))


def test_fused_refuses_loss_scaling():
    """The update would use the loss-scaled gradient before the wrapper unscales or skips it."""
    x, y = _fit_data()
    model = make_model(True)
    model.compile(keras.optimizers.LossScaleOptimizer(LazyAdam(0.01)), "mse")
    with pytest.raises(ValueError, match="cannot run under loss scaling"):
        model.fit(x, y, epochs=1, verbose=0)
    opt = LazyAdam(0.01)
    opt.build(model.trainable_variables)  # built, then wrapped: refused at the step instead
    model.compile(keras.optimizers.LossScaleOptimizer(opt), "mse")
    with pytest.raises(ValueError, match="cannot run under loss scaling"):
        model.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_fused_refuses_a_table_looked_up_twice_in_one_step(compiled):
    bag = EmbeddingBag(50, 4, fused_optimizer=True)
    bag.build()
    opt = LazyAdam(0.01)
    opt.build([bag.embeddings])
    a, b = tf.constant([[1, 2]], tf.int64), tf.constant([[2, 3]], tf.int64)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(bag(a)) + tf.reduce_sum(bag(b))
        grads = tape.gradient(loss, [bag.embeddings])
        opt.apply_gradients(zip(grads, [bag.embeddings]))

    with pytest.raises(ValueError, match="looked up more than once in one training step"):
        (tf.function(step) if compiled else step)()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("make_opt", [lambda: LazyAdam(0.01), lambda: RowwiseAdagrad(0.05)],
                         ids=["LazyAdam", "RowwiseAdagrad"])
def test_fused_refuses_a_table_also_read_outside_the_lookup(make_opt, compiled):
    """A tf.gather of the table beside the fused lookup: the backward applied the lookup's update and
    the optimizer then applied a second one for the gather's gradient (not the unfused result)."""
    def train(fused, other_read):
        keras.utils.set_random_seed(0)
        bag = EmbeddingBag(50, 4, sparse_gradient=not fused, fused_optimizer=fused)
        bag.build()
        opt = make_opt()
        opt.build([bag.embeddings])

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(bag(tf.constant([[1, 2]], tf.int64)))
                loss += tf.reduce_sum(other_read(bag.embeddings) ** 2)
            grads = tape.gradient(loss, [bag.embeddings])
            opt.apply_gradients(zip(grads, [bag.embeddings]))

        for _ in range(2):
            (tf.function(step) if compiled else step)()
        return bag.embeddings.numpy()

    for other_read in (lambda t: tf.gather(t, [2, 7]), lambda t: t[:3]):  # row-sparse and dense gradients
        with pytest.raises(ValueError, match="also read outside its fused lookup"):
            train(True, other_read)
    no_read = lambda t: tf.zeros([0])  # noqa: E731  (one fused lookup per step still trains as unfused)
    np.testing.assert_allclose(train(True, no_read), train(False, no_read), rtol=1e-6, atol=1e-7)


def test_fused_leaves_a_frozen_table_and_follows_a_recompile():
    x, y = _fit_data()
    model = make_model(True)
    first = LazyAdam(0.01)  # kept: its claim on the table outlives the recompiles below
    model.compile(first, "mse")
    model.fit(x, y, epochs=1, verbose=0)
    table = model.get_layer("bag").embeddings
    trained = table.numpy()
    model.compile(keras.optimizers.SGD(learning_rate=0.0), "mse")  # another optimizer trains from here
    model.fit(x, y, epochs=1, verbose=0)
    np.testing.assert_array_equal(table.numpy(), trained)
    model.get_layer("bag").trainable = False
    model.compile(first, "mse")
    head = model.get_layer("head").kernel.numpy()
    model.fit(x, y, epochs=1, verbose=0)
    np.testing.assert_array_equal(table.numpy(), trained)
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), head)  # the rest still trains


def test_fused_refuses_max_and_exports_after_training(tmp_path):
    with pytest.raises(ValueError, match="fused_optimizer=True takes the combiners sum, mean and sqrtn"):
        EmbeddingBag(10, 4, combiner="max", fused_optimizer=True)
    x, y = _fit_data()
    model = make_model(True)
    model.compile(LazyAdam(0.01), "mse")
    model.fit(x, y, epochs=1, verbose=0)
    model.export(str(tmp_path / "exported"), verbose=False)  # failed: the gradient captured the optimizer
    loaded = tf.saved_model.load(str(tmp_path / "exported"))
    served = loaded.serve([tf.constant(x[0]), tf.constant(x[1])])
    np.testing.assert_allclose(served.numpy(), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


def test_fused_refuses_ragged_and_sparse_ids_saying_how_to_pad_them():
    layer = EmbeddingBag(10, 4, fused_optimizer=True)
    sparse = tf.sparse.from_dense(tf.constant([[1, 2, 0], [3, 0, 0]], tf.int64))
    for ids in (sparse, tf.ragged.constant([[1, 2], [3]], tf.int64)):
        with pytest.raises(ValueError, match=r"not ragged or tf\.SparseTensor ones.*default_value=-1"):
            layer(ids)
    padded = tf.sparse.to_dense(sparse, default_value=-1)  # what the message says works
    want = layer.embeddings.numpy()[[1, 3]] + np.array([[1.0], [0.0]]) * layer.embeddings.numpy()[2]
    np.testing.assert_allclose(layer(padded).numpy(), want, rtol=1e-6)


# ---- custom training loops (a helper's bug hunt, round 30) ----

def _custom_loop(fused, make_opt, steps=3, wrap=False, transform=None):
    """Each step: tape.gradient in one tf.function, apply_gradients in another (as a custom loop
    that edits the gradients in between is written); `transform` edits the gradient list."""
    model = make_model(fused)
    opt = make_opt()
    opt.build(model.trainable_variables)  # built first: its claim on the table is made unwrapped
    if wrap:
        opt = keras.optimizers.LossScaleOptimizer(opt)
    x, y = _fit_data()

    @tf.function
    def gradients(ids, w, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([ids, w]) - target))
            loss = opt.scale_loss(loss) if wrap else loss
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s in range(steps):
        rows = slice(16 * s, 16 * s + 16)
        grads = gradients(tf.constant(x[0][rows]), tf.constant(x[1][rows]), tf.constant(y[rows]))
        apply(transform(grads) if transform else grads)
    return model


@pytest.mark.parametrize("make_opt", [lambda: LazyAdam(0.01), lambda: RowwiseAdagrad(0.05)],
                         ids=["LazyAdam", "RowwiseAdagrad"])
def test_fused_custom_loop_trains_like_unfused_and_refuses_what_it_cannot_follow(make_opt):
    fused, plain = _custom_loop(True, make_opt), _custom_loop(False, make_opt)
    for a, b in zip(fused.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    # A LossScaleOptimizer around an optimizer built before it: the update used the scaled gradient
    # (the table 618x off the unfused loop's with RowwiseAdagrad, 365x with LazyAdam).
    assert _custom_loop(False, make_opt, wrap=True) is not None
    with pytest.raises(ValueError, match="cannot run under loss scaling"):
        _custom_loop(True, make_opt, wrap=True)
    # The table's empty gradient made dense and applied in another graph: a second (dense) update.
    dense = lambda grads: [tf.convert_to_tensor(g) for g in grads]  # noqa: E731
    with pytest.raises(tf.errors.InvalidArgumentError, match="also read outside its fused lookup"):
        _custom_loop(True, make_opt, transform=dense)


def test_fused_refuses_gradients_accumulated_over_several_tape_calls():
    """Gradient accumulation by hand: each tape.gradient applied its own update (1.2x off the
    unfused accumulated step); the second is now refused before it touches the table."""
    model = make_model(True)
    opt = RowwiseAdagrad(0.05)
    opt.build(model.trainable_variables)
    table = model.get_layer("bag").embeddings
    (ids, w), y = _fit_data()

    @tf.function
    def gradients(rows):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([tf.gather(ids, rows), tf.gather(w, rows)]) - y[:8]))
        return tape.gradient(loss, model.trainable_variables)

    gradients(tf.range(8))
    after_one = table.numpy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="second fused update before its optimizer"):
        gradients(tf.range(8, 16))
    np.testing.assert_array_equal(table.numpy(), after_one)


def test_fused_lookup_under_recompute_grad_is_refused_by_name():
    """tf.recompute_grad makes the table's gradient dense (tf.gather's too), so the fused lookup's empty
    gradient arrives as a dense second update: refused, and the message now names recompute_grad."""
    layer = EmbeddingBag(12, 4, fused_optimizer=True)
    layer.build()
    opt = LazyAdam(0.1)
    opt.build(layer.trainable_variables)
    block = tf.recompute_grad(lambda ids: layer(ids))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(block(tf.constant([[1, 2, 3], [4, 5, -1]])) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    with pytest.raises(ValueError, match="tf.recompute_grad around the lookup"):
        opt.apply_gradients(zip(grads, layer.trainable_variables))


def test_fused_fit_under_a_one_replica_mirrored_strategy_trains_like_unfused():
    """Keras' symbolic build calls the layer outside any replica, where a MirroredVariable has no
    handle: fit raised "DistributedVariable.handle is not available outside the replica context"."""
    x, y = _fit_data()

    def fit(fused):
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            model = make_model(fused)
            model.compile(LazyAdam(0.01), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return model

    fused, plain = fit(True), fit(False)
    for a, b in zip(fused.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)
    assert not np.array_equal(fused.get_layer("bag").embeddings.numpy(),
                              make_model(True).get_layer("bag").embeddings.numpy())


def test_fused_eager_loop_goes_on_after_rolling_back_to_a_checkpoint(tmp_path):
    """Restoring a checkpoint one step back repeats an iterations value: the eager step went on to
    raise "looked up more than once in one training step" for a table looked up once."""
    x, y = _fit_data()

    def train(fused):
        model = make_model(fused)
        opt = RowwiseAdagrad(0.05)
        opt.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

        def step(s):
            rows = slice(16 * s, 16 * s + 16)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model([x[0][rows], x[1][rows]]) - y[rows]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        step(0)
        path = checkpoint.save(str(tmp_path / f"ckpt_{fused}"))
        step(1)
        checkpoint.restore(path)
        step(2)
        return model

    for a, b in zip(train(True).trainable_variables, train(False).trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path)


def test_fused_layer_under_xla_serves_and_refuses_training_by_name():
    """Under tf.function(jit_compile=True) the fused lookup raised TF's "Detected unsupported operations
    ... PkmResourceEmbeddingBag", for inference too: inference now takes the plain lookup (as a layer
    without fused_optimizer), and a training step is refused naming fused_optimizer."""
    model = make_model(True)
    (ids, w), y = _fit_data()
    served = tf.function(lambda a, b: model([a, b]), jit_compile=True)(tf.constant(ids), tf.constant(w))
    np.testing.assert_allclose(served.numpy(), model([ids, w]).numpy(), rtol=1e-6, atol=1e-6)
    opt = LazyAdam(0.01)
    opt.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(a, b, target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([a, b]) - target))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    with pytest.raises(ValueError, match="fused_optimizer=True cannot be compiled by XLA"):
        step(tf.constant(ids), tf.constant(w), tf.constant(y))
