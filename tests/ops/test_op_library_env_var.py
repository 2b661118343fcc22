"""$PKM_SERVE_OPS_LIB set to a library that is not the TF op library (one of the others that
`make build` writes beside it, e.g. the C ABI or TFLite library): it loads into TensorFlow and
registers no op, and every use failed with "module '...' has no attribute 'pkm_embedding_bag'"
(the exporter with "'NoneType' object has no attribute 'input_arg'"). Now load_library refuses it,
naming the path and where it came from."""
import os

import pytest

from pkm_serve import ops  # noqa: I001 - first: a first import of _library warns (registration circle)
from pkm_serve import _library


def _another_library_of_the_build():
    other = os.path.join(os.path.dirname(_library.__file__), "lib", "libpkm_capi_cpu.so")
    if not os.path.exists(other):
        pytest.skip("no libpkm_capi_cpu.so built beside the op library")
    return other


def test_a_library_that_registers_no_op_is_refused_by_name(monkeypatch):
    other = _another_library_of_the_build()
    monkeypatch.setattr(_library, "_lib", None)
    monkeypatch.setenv("PKM_SERVE_OPS_LIB", other)
    with pytest.raises(ops.OpLibraryNotFoundError) as err:
        ops.load_library()
    assert f"{other} (from $PKM_SERVE_OPS_LIB) is not the pkm_serve op library" in str(err.value)
    assert "_pkm_ops.so" in str(err.value)
    assert not ops.is_available()
    with pytest.raises(ops.OpLibraryNotFoundError, match="registers no PkmEmbeddingBag op"):
        ops.embedding_bag([[1.0, 2.0]], [[0]])


def test_a_missing_library_named_by_the_variable_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(_library, "_lib", None)
    monkeypatch.setenv("PKM_SERVE_OPS_LIB", str(tmp_path / "absent.so"))
    with pytest.raises(ops.OpLibraryNotFoundError, match=r"absent\.so \(from \$PKM_SERVE_OPS_LIB\)\. In a source"):
        ops.load_library()


def test_the_op_library_still_loads(monkeypatch):
    monkeypatch.setattr(_library, "_lib", None)
    monkeypatch.delenv("PKM_SERVE_OPS_LIB", raising=False)
    assert hasattr(ops.load_library(), "pkm_embedding_bag")
