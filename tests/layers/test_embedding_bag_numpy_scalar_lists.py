"""EmbeddingBag on Python lists of numpy scalars ([np.int64(1), np.int64(2)], [[np.int32(1)]], as iterating
an id array or a vocabulary of numpy ints gives): a ValueError naming np.asarray, as for lists of Python
ints. Counted as tensors, the flat list got "a list of 2 tensors" and the nested one an AttributeError
"'list' object has no attribute 'shape'". On a Python number: a ValueError naming the bag axis it lacks.
Reference: the float64 lookup of np.asarray of the same ids."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")


def test_lists_of_numpy_scalars_are_python_ids():
    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 4, combiner="sum")
    bag.build()
    table = np.asarray(keras.ops.convert_to_numpy(bag.embeddings), np.float64)
    for listed in ([np.int64(1), np.int64(2)], [[np.int32(1), np.int32(4)], [np.int32(3), np.int32(-1)]],
                   ((np.int64(5),),)):
        with pytest.raises(ValueError, match=r"got a Python (list|tuple) .*np\.asarray"):
            bag(listed)
        ids = np.asarray(listed, "int32")
        want = np.where(ids[..., None] >= 0, table[np.maximum(ids, 0)], 0).sum(axis=-2)
        got = keras.ops.convert_to_numpy(bag(ids))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=repr(listed))


@pytest.mark.parametrize("scalar", [3, 3.0, True])
def test_a_python_number_is_refused_for_its_missing_bag_axis(scalar):
    """bag(3): Keras' error said to pass 3 "as a keyword argument"; now the bag axis it lacks is named
    (as for np.int32(3)), and the one-bag array it names gives the float64 lookup of that id."""
    from pkm_serve.layers import EmbeddingBag

    bag = EmbeddingBag(30, 4)
    bag.build()
    with pytest.raises(ValueError, match=r"at least one dimension \(the bag axis.*got a Python .*np\.asarray"):
        bag(scalar)
    table = keras.ops.convert_to_numpy(bag.embeddings)
    got = keras.ops.convert_to_numpy(bag(np.asarray([[int(scalar)]], "int32")))
    np.testing.assert_allclose(got, table[[int(scalar)]], rtol=1e-6)
