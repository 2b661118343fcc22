"""Platform-tagged wheels: the package ships prebuilt native libraries
(pkm_serve/lib/*.so, built by `make build`), which setuptools cannot see.
Metadata lives in pyproject.toml; `make wheel` builds and checks the wheels."""
from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(distclass=BinaryDistribution)
