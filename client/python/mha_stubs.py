"""The generated gRPC stubs mha_client uses (mha.v1 and KServe v2's
inference), found or made: the installed wheel's package mha_client_stubs,
else client/python/gen/ when it is up to date with proto/, else generated
once per process into a temporary folder (removed at exit) with protoc and
grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc).
The folder goes on sys.path: the generated modules import each other as
mha.v1.* and inference.*.
"""

import atexit
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
GEN_DIR = os.path.join(HERE, "gen")
INSTALLED_STUB_DIR = os.path.join(HERE, "mha_client_stubs")  # written by setup.py
GENERATE_SCRIPT = os.path.join(HERE, "generate_stubs.sh")
_PROTOS = ("mha/v1/model_config.proto", "mha/v1/attention.proto",
           "inference/model_config.proto", "inference/grpc_service.proto")
_STUB_FILES = ("mha/v1/model_config_pb2.py", "mha/v1/attention_pb2.py",
               "mha/v1/attention_pb2_grpc.py", "inference/model_config_pb2.py",
               "inference/grpc_service_pb2.py", "inference/grpc_service_pb2_grpc.py")

_stubs = None
_temp_stub_dir = None


def generate_stubs(out_dir):
    """Runs generate_stubs.sh into out_dir (protoc + grpc_python_plugin)."""
    subprocess.run(["sh", GENERATE_SCRIPT, out_dir], check=True)


def _stubs_are_complete(folder):
    return all(os.path.isfile(os.path.join(folder, f)) for f in _STUB_FILES)


def _stubs_are_fresh(folder):
    """True if folder holds every stub and none is older than its proto
    (without proto/ next to us, e.g. a copied client, any complete gen/ is
    taken)."""
    if not _stubs_are_complete(folder):
        return False
    stubs = [os.path.join(folder, f) for f in _STUB_FILES]
    protos = [os.path.join(PROTO_DIR, p) for p in _PROTOS]
    if not all(os.path.isfile(p) for p in protos):
        return True
    return min(map(os.path.getmtime, stubs)) >= max(map(os.path.getmtime, protos))


def _remove_temp_stubs():
    if _temp_stub_dir is not None:
        shutil.rmtree(_temp_stub_dir, ignore_errors=True)


def _stub_folder():
    """The folder of the stubs, put on sys.path: the installed package's,
    else gen/ when it is fresh, else a temporary folder generated once per
    process from proto/."""
    global _temp_stub_dir
    if _stubs_are_complete(INSTALLED_STUB_DIR):
        folder = INSTALLED_STUB_DIR
    elif _stubs_are_fresh(GEN_DIR):
        folder = GEN_DIR
    else:
        if not os.path.isdir(PROTO_DIR):
            raise ImportError(
                f"mha_client: no gRPC stubs next to {HERE} and no proto/ folder to "
                "generate them from: install the client (pip install --no-deps "
                "--no-build-isolation ./client/python) or run client/python/generate_stubs.sh")
        if _temp_stub_dir is None:
            _temp_stub_dir = tempfile.mkdtemp(prefix="mha_stubs_")
            atexit.register(_remove_temp_stubs)
            generate_stubs(_temp_stub_dir)
        folder = _temp_stub_dir
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return folder


def load_stubs():
    """(attention_pb2, attention_pb2_grpc, model_config_pb2), from gen/ when
    it is fresh, else generated once per process into a temporary folder.
    The folder goes on sys.path, so `import mha.v1.attention_pb2` works
    afterwards too."""
    global _stubs
    if _stubs is None:
        _stub_folder()
        _stubs = tuple(importlib.import_module(f"mha.v1.{m}") for m in
                       ("attention_pb2", "attention_pb2_grpc", "model_config_pb2"))
    return _stubs


def load_kserve_stubs():
    """(grpc_service_pb2, grpc_service_pb2_grpc) of KServe v2
    (package inference), from the same folder as load_stubs()."""
    _stub_folder()
    return tuple(importlib.import_module(f"inference.{m}") for m in
                 ("grpc_service_pb2", "grpc_service_pb2_grpc"))
