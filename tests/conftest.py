"""Shared pytest set-up: quiet TensorFlow, make the repo importable."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CI has no GPU; skip TF's CUDA probing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    """Modules holding a `slow` test run first, so that with several workers
    (`make test` runs pytest-xdist, a module per worker) the long ones overlap the
    many short ones instead of finishing last on one worker."""
    slow_modules = {item.module.__name__ for item in items
                    if item.get_closest_marker("slow") is not None and getattr(item, "module", None)}
    items.sort(key=lambda item: getattr(item, "module", None) is None
               or item.module.__name__ not in slow_modules)  # stable: order within kept
