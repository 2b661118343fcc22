"""setup.py of the TF-free wheels (device, packaging/device/; Keras,
packaging/keras/), staged next to their pyproject.toml: their libraries are
plain C ABI objects (no Python ABI, no TensorFlow), so each wheel is
py3-none-<platform>, installed as platform (platlib) files."""
from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
