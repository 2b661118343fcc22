"""The `lib` fixture of tests/gpu: libpkm_cuda.so through kernels/capi/pkm_capi.py.
Imports nothing that needs torch or a GPU, so collection on CI only skips."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "kernels", "capi"))
import pkm_capi  # noqa: E402


@pytest.fixture(scope="session")
def lib():
    """A machine with CUDA but without the built library fails, not skips."""
    if not os.path.exists(pkm_capi.DEFAULT_CUDA_LIB):
        pytest.fail(f"{pkm_capi.DEFAULT_CUDA_LIB} is missing: run `make gpu-standalone` first")
    loaded = pkm_capi.PkmLib()
    assert loaded.has_cuda, "libpkm_cuda.so was built without the CUDA launchers"
    return loaded
