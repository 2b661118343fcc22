"""Shared by the tests/gpu modules: skip the importing module without torch or
a CUDA device (CI has none: a legitimate skip, not a hidden failure), the C
ABI wrapper, the table dtypes and the (dtype, combiner, ragged) grid.

On a GPU machine: `make gpu-standalone && CUDA_VISIBLE_DEVICES=0 python -m
pytest -q tests/gpu` (tests/conftest.py hides GPUs unless that is set). The
`lib` fixture is in tests/gpu/conftest.py.
"""

import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (GPU tests need torch with CUDA)")
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device visible to torch (CI has none; on a GPU machine set CUDA_VISIBLE_DEVICES, "
        "which tests/conftest.py otherwise blanks)",
        allow_module_level=True,
    )

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (os.path.join(ROOT, "kernels", "capi"), os.path.join(ROOT, "tests"), ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
import pkm_capi  # noqa: E402

DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CONFIGS = [(dtype, combiner, ragged) for dtype in DTYPES for combiner in ("sum", "mean", "sqrtn")
           for ragged in (False, True)]
CONFIG_IDS = [f"{str(d).split('.')[-1]}-{c}-{'ragged' if r else 'dense'}" for d, c, r in CONFIGS]
