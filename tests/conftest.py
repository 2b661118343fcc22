"""Shared pytest set-up: quiet TensorFlow, make the repo importable."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CI has no GPU; skip TF's CUDA probing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    """Modules holding a `slow` test run first, then the others, most tests first, so that
    with several workers (`make test` runs pytest-xdist, a module per worker, with
    --no-loadscope-reorder: xdist's own order, by test count alone, put the one-test slow
    modules last) the long ones overlap the many short ones instead of finishing last on
    one worker."""
    def module(item):
        return getattr(getattr(item, "module", None), "__name__", "")

    slow_modules = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    counts = {}
    for item in items:
        counts[module(item)] = counts.get(module(item), 0) + 1
    items.sort(key=lambda item: (module(item) not in slow_modules, -counts[module(item)]))  # stable
