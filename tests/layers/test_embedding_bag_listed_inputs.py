"""EmbeddingBag called on a list of one tensor, layer([ids]) (a functional model's habit): the error
says to pass the tensor itself. It said to stack the ids or to pass weights as the second argument,
neither of which the caller had in mind. Reference: the same ids passed bare."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")


@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_a_list_of_one_tensor_says_to_pass_the_tensor_itself(dtype):
    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 8)
    ids = np.array([[1, 2, 3]])
    for listed in ([ids.astype(dtype)], (keras.ops.convert_to_tensor(ids.astype(dtype)),),
                   [keras.Input((3,), dtype=dtype)]):
        with pytest.raises(ValueError, match=r"got a (list|tuple) of 1 tensor: pass the tensor itself, "
                                             r"layer\(indices\), not in a (list|tuple)") as raised:
            bag(listed)
        assert "stack them" not in str(raised.value) and "weights as the second" not in str(raised.value)
    assert tuple(bag(ids).shape) == (1, 8)
