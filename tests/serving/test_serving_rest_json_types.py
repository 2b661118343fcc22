"""REST JSON values of the wrong JSON type for the input's dtype get json_tensor.cc's TypeError
("JSON Value: V Type: T is not of expected type: D"), naming the first such value, also where
numpy keeps the list as Python objects (a bool beside an integer past 64 bits, a null)."""
import numpy as np
import pytest
import tensorflow as tf

from pkm_serve.serving import tensors
from pkm_serve.serving.errors import ServingError


def _spec(dtype):
    return tf.TensorSpec(None, dtype)


@pytest.mark.parametrize("value, dtype, message", [
    ([True, 2 ** 70], tf.float32, "JSON Value: true Type: True is not of expected type: float"),
    ([True, 2 ** 70], tf.int64, "JSON Value: true Type: True is not of expected type: int64"),
    ([[2 ** 70], [False]], tf.float64, "JSON Value: false Type: False is not of expected type: double"),
    ([1.5, None], tf.float32, "JSON Value: null Type: Null is not of expected type: float"),
    ([[1, 2], [3, None]], tf.int32, "JSON Value: null Type: Null is not of expected type: int32"),
    ([True, "a"], tf.float32, "JSON Value: true Type: True is not of expected type: float"),
    ([1.5, "a"], tf.float16, 'JSON Value: "a" Type: String is not of expected type: half'),
    ([True, False], tf.uint8, "JSON Value: true Type: True is not of expected type: uint8"),
    ([[True], [1.5]], tf.bool, "JSON Value: 1.5 Type: Number is not of expected type: bool"),
    ([True, None], tf.bool, "JSON Value: null Type: Null is not of expected type: bool"),
    ([False, "yes"], tf.bool, 'JSON Value: "yes" Type: String is not of expected type: bool'),
])
def test_the_first_value_of_the_wrong_json_type_is_named(value, dtype, message):
    with pytest.raises(ServingError) as err:
        tensors.from_json("x", value, _spec(dtype))
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert err.value.message == f"{message} (input 'x')"


@pytest.mark.parametrize("value, dtype", [([[1, 2], [3]], tf.float32), ([[True], [False, True]], tf.bool),
                                          ([[1], [2 ** 70, 3]], tf.float32)])
def test_rows_of_other_lengths_are_still_called_ragged(value, dtype):
    with pytest.raises(ServingError, match="input 'x' is ragged: all rows must have the same shape"):
        tensors.from_json("x", value, _spec(dtype))


@pytest.mark.parametrize("value, shape", [([], (0,)), ([[], []], (2, 0))])
def test_an_empty_bool_input_is_an_empty_bool_tensor(value, shape):
    """json_tensor.cc makes a [0] tensor of the signature's dtype; a bool input was refused
    ("must hold true/false values": numpy reads [] as float64)."""
    got = tensors.from_json("x", value, _spec(tf.bool))
    assert got.dtype == np.bool_ and got.shape == shape
