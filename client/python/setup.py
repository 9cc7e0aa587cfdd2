"""Builds the mha-serve-client wheel (metadata in pyproject.toml).

The one thing pyproject.toml cannot say: the gRPC stubs are generated at
build time, by generate_stubs.sh from the protos of this repository, into
the package mha_client_stubs of the wheel. mha_client puts that folder on
sys.path, so the generated modules import each other under their proto
packages (mha.v1, inference) as protoc writes them. It also records the
checkout it was built from (mha_client_stubs/source_checkout.py), where
mha_export --verify finds build/mha_server.
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
        # Where it was installed from: mha_export --verify looks for the
        # checkout's build/mha_server there.
        with open(os.path.join(out, "source_checkout.py"), "w") as f:
            f.write('"""The checkout this package was built from (mha_export --verify)."""\n')
            f.write(f"CHECKOUT = {os.path.normpath(os.path.join(HERE, '..', '..'))!r}\n")


setup(cmdclass={"build_py": BuildPyWithStubs})
