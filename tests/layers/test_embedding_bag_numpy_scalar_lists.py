"""EmbeddingBag on Python lists of numpy scalars ([np.int64(1), np.int64(2)], [[np.int32(1)]], as iterating
an id array or a vocabulary of numpy ints gives): a ValueError naming np.asarray, as for lists of Python
ints. Counted as tensors, the flat list got "a list of 2 tensors" and the nested one an AttributeError
"'list' object has no attribute 'shape'". Reference: the float64 lookup of np.asarray of the same ids."""
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
