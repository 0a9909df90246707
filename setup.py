# The C engine is compiled by cffi (bindings/build_engine.py); everything
# else about the package is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["bindings/build_engine.py:ffibuilder"])
