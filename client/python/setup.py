"""Builds the mha-serve-client wheel (metadata in pyproject.toml).

The one thing pyproject.toml cannot say: the gRPC stubs are generated at
build time, by generate_stubs.sh from the protos of this repository, into
the package mha_client_stubs of the wheel. mha_client puts that folder on
sys.path, so the generated modules import each other under their proto
packages (mha.v1, inference) as protoc writes them.
"""

import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STUB_PACKAGE = "mha_client_stubs"


class BuildPyWithStubs(build_py):
    """build_py that also writes the generated stubs into the build folder."""

    def run(self):
        super().run()
        out = os.path.join(self.build_lib, STUB_PACKAGE)
        os.makedirs(out, exist_ok=True)
        subprocess.run(["sh", os.path.join(HERE, "generate_stubs.sh"), out], check=True)
        with open(os.path.join(out, "__init__.py"), "w") as f:
            f.write('"""gRPC stubs of mha.v1 and KServe v2, generated at build time."""\n')


setup(cmdclass={"build_py": BuildPyWithStubs})
