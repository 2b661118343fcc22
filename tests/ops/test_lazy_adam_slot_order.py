"""LazyAdam creates its slots in Keras' Adam's order (each variable's momentum then velocity,
then the velocity_hats): a .keras file and a tf.train.Checkpoint map optimizer variables by
position, so a file saved by an earlier LazyAdam (built by Keras' Adam.build) loads. Building all
momentums before all velocities (round 36's float32 moments) made such a file fail to load
(`variable.shape=(3,), value.shape=(4, 3)`) or swap same-shaped moments."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pkm_serve.optimizers import LazyAdam  # noqa: E402


def _variables(dtype, overwrite_last=False):
    variables = [keras.Variable(np.zeros((4, 3)), dtype=dtype, name="kernel"),
                 keras.Variable(np.zeros((3,)), dtype=dtype, name="bias"),
                 keras.Variable(np.zeros((2, 2)), dtype=dtype, name="scale")]
    variables[-1].overwrite_with_gradient = overwrite_last
    return variables


def _layout(optimizer):
    return [(v.name, tuple(v.shape)) for v in optimizer.variables]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lazy_adam_slots_follow_keras_adam_order(dtype, amsgrad):
    variables = _variables(dtype)
    keras_adam, lazy_adam = keras.optimizers.Adam(amsgrad=amsgrad), LazyAdam(amsgrad=amsgrad)
    keras_adam.build(variables)
    lazy_adam.build(variables)
    assert _layout(lazy_adam)[:len(_layout(keras_adam))] == _layout(keras_adam)
    half = dtype == "bfloat16"
    assert {v.dtype for v in lazy_adam._momentums + lazy_adam._velocities} == {"float32" if half else dtype}


def test_lazy_adam_leaves_an_overwrite_with_gradient_variable_without_moments():
    variables = _variables("float32", overwrite_last=True)
    keras_adam, lazy_adam = keras.optimizers.Adam(), LazyAdam()
    keras_adam.build(variables)
    lazy_adam.build(variables)
    assert lazy_adam._momentums[-1] is None and keras_adam._momentums[-1] is None
    assert _layout(lazy_adam)[:len(_layout(keras_adam))] == _layout(keras_adam)


def test_a_keras_file_of_adam_ordered_slots_loads_into_lazy_adam(tmp_path):
    def model():
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        built.compile(optimizer=LazyAdam(0.1), loss="mse")
        return built

    x, y = np.random.RandomState(0).rand(8, 4), np.random.RandomState(1).rand(8, 3)
    trained = model()
    trained.fit(x, y, epochs=2, verbose=0, batch_size=8)
    # a file as an earlier LazyAdam wrote it: Keras' Adam's slots, in Keras' order
    reference = keras.optimizers.Adam(0.1)
    reference.build(trained.trainable_variables)
    for saved, slot in zip(reference.variables, trained.optimizer.variables):
        assert saved.name == slot.name
        saved.assign(slot)
    path = str(tmp_path / "m.weights.h5")
    trained.save_weights(path)
    loaded = model()
    loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(path)
    for want, got in zip(reference.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
