"""The wheels `make wheel-*` left in dist/, for the tests that install them."""
import glob
import importlib
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def built_wheel(pattern, what, make_target):
    """The one dist/ wheel matching `pattern`; fails naming the make target when
    there is none or more than one."""
    wheels = glob.glob(os.path.join(ROOT, "dist", pattern))
    if len(wheels) != 1:
        pytest.fail(f"expected one {what} wheel in dist/, found {wheels}: run `make {make_target}`")
    return wheels[0]


def packaging_module(name):
    """packaging/NAME.py (build_wheels, build_keras_wheel) imported as a module."""
    sys.path.insert(0, os.path.join(ROOT, "packaging"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
