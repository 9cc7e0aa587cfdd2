"""Starts a real mha_server for tests and gives them stubs to call it with.

    with TestServer(mha_server, repo_dir) as s:
        stub = s.stub()                      # mha.v1.AttentionService
        s.metrics()                          # the /metrics text
    s.exit_code                              # after SIGTERM

Stubs are generated from proto/ at test time with protoc and Debian's
grpc_python_plugin (package protobuf-compiler-grpc), into a temporary folder.
"""

import importlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_STUB_DIR = None


def load_stubs():
    """(attention_pb2, attention_pb2_grpc, model_config_pb2), generated once."""
    global _STUB_DIR
    if _STUB_DIR is None:
        _STUB_DIR = tempfile.mkdtemp(prefix="mha_stubs_")
        proto = os.path.join(REPO_ROOT, "proto")
        subprocess.run(
            ["protoc", f"-I{proto}", f"--python_out={_STUB_DIR}", f"--grpc_out={_STUB_DIR}",
             "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
             os.path.join(proto, "mha/v1/model_config.proto"),
             os.path.join(proto, "mha/v1/attention.proto")], check=True)
        sys.path.insert(0, _STUB_DIR)
    return (importlib.import_module("mha.v1.attention_pb2"),
            importlib.import_module("mha.v1.attention_pb2_grpc"),
            importlib.import_module("mha.v1.model_config_pb2"))


class TestServer:
    """One mha_server process on free loopback ports."""

    def __init__(self, binary, repository, extra_flags=(), ready_timeout=60):
        self.binary, self.repository = binary, repository
        self.extra_flags, self.ready_timeout = list(extra_flags), ready_timeout
        self.process = None
        self.grpc_port = self.metrics_port = None
        self.exit_code = None
        self.stderr_path = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        err = tempfile.NamedTemporaryFile(prefix="mha_server_", suffix=".log", delete=False)
        self.stderr_path = err.name
        self.process = subprocess.Popen(
            [self.binary, f"--model_repository={self.repository}", "--host=127.0.0.1",
             "--port=0", "--metrics_port=0"] + self.extra_flags,
            stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + self.ready_timeout
        line = self.process.stdout.readline()
        match = re.search(r"grpc_port=(\d+) metrics_port=(\d+)", line)
        if not match or time.monotonic() > deadline:
            self.process.kill()
            raise RuntimeError(f"mha_server did not get ready: {line!r}; stderr: {self.stderr()}")
        self.grpc_port, self.metrics_port = int(match.group(1)), int(match.group(2))
        self.ready_line = line.strip()

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def stop(self, timeout=60):
        """SIGTERM, then wait; returns the exit code."""
        if self.process is None or self.exit_code is not None:
            return self.exit_code
        self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_code = self.process.wait()
        self.process.stdout.close()
        return self.exit_code

    def target(self):
        return f"127.0.0.1:{self.grpc_port}"

    def channel(self):
        import grpc
        return grpc.insecure_channel(self.target(), options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20)])

    def stub(self, channel=None):
        _, rpc, _ = load_stubs()
        return rpc.AttentionServiceStub(channel or self.channel())

    def metrics(self):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()


def metric_value(text, name, **labels):
    """The value of one sample of the Prometheus text `text`, or 0.0."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tensor(pb, config_pb, array, dtype=None):
    """A numpy array as an mha.v1.Tensor (FP32 by default, BOOL for bools)."""
    import numpy as np
    array = np.asarray(array)
    if array.dtype == np.bool_:
        return pb.Tensor(dtype=config_pb.DATA_TYPE_BOOL, shape=array.shape,
                         data=array.astype(np.uint8).tobytes())
    return pb.Tensor(dtype=dtype or config_pb.DATA_TYPE_FP32, shape=array.shape,
                     data=np.ascontiguousarray(array, dtype=np.float32).tobytes())


def to_numpy(t):
    import numpy as np
    return np.frombuffer(t.data, dtype=np.float32).reshape(tuple(t.shape))


# ----------------------------------------------------------------- additions

def metric_sample(text, name, **labels):
    """Like metric_value, but None when no sample matches (so a test can
    tell a 0 from a missing series)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def half_tensor(pb, config_pb, array, dtype):
    """A float array as an FP16 or BF16 mha.v1.Tensor (round to nearest even)."""
    import numpy as np
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == config_pb.DATA_TYPE_FP16:
        data = array.astype("<f2").tobytes()
    elif dtype == config_pb.DATA_TYPE_BF16:
        import torch
        data = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    else:
        raise ValueError(f"half_tensor: dtype {dtype} is not FP16 or BF16")
    return pb.Tensor(dtype=dtype, shape=array.shape, data=data)


def from_wire(config_pb, t):
    """An FP32, FP16 or BF16 mha.v1.Tensor as a float32 numpy array."""
    import numpy as np
    shape = tuple(t.shape)
    if t.dtype == config_pb.DATA_TYPE_FP32:
        return np.frombuffer(t.data, dtype="<f4").reshape(shape)
    if t.dtype == config_pb.DATA_TYPE_FP16:
        return np.frombuffer(t.data, dtype="<f2").astype(np.float32).reshape(shape)
    if t.dtype == config_pb.DATA_TYPE_BF16:
        bits = np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    raise ValueError(f"from_wire: dtype {t.dtype} is not a float type")


# The parts of grpc.health.v1 and grpc.reflection.v1alpha the tests call
# (field numbers as upstream). The files live under a folder that is not
# named "grpc", so their Python modules do not shadow the grpc package.
_HEALTH_PROTO = """
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""

_REFLECTION_PROTO = """
syntax = "proto3";
package grpc.reflection.v1alpha;
service ServerReflection {
  rpc ServerReflectionInfo(stream ServerReflectionRequest)
      returns (stream ServerReflectionResponse);
}
message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    string all_extension_numbers_of_type = 6;
    string list_services = 7;
  }
}
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    FileDescriptorResponse file_descriptor_response = 4;
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
message FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ServiceResponse { string name = 1; }
message ErrorResponse { int32 error_code = 1; string error_message = 2; }
"""

_GRPC_STUB_DIR = None


def load_grpc_stubs():
    """(health_pb2, health_pb2_grpc, reflection_pb2, reflection_pb2_grpc)
    for grpc.health.v1 and grpc.reflection.v1alpha, generated once."""
    global _GRPC_STUB_DIR
    if _GRPC_STUB_DIR is None:
        _GRPC_STUB_DIR = tempfile.mkdtemp(prefix="mha_grpc_stubs_")
        folder = os.path.join(_GRPC_STUB_DIR, "mha_test_grpc")
        os.makedirs(folder)
        for name, text in (("health.proto", _HEALTH_PROTO),
                           ("reflection.proto", _REFLECTION_PROTO)):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
        subprocess.run(
            ["protoc", f"-I{_GRPC_STUB_DIR}", f"--python_out={_GRPC_STUB_DIR}",
             f"--grpc_out={_GRPC_STUB_DIR}",
             "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
             os.path.join(folder, "health.proto"),
             os.path.join(folder, "reflection.proto")], check=True)
        sys.path.insert(0, _GRPC_STUB_DIR)
    return tuple(importlib.import_module(f"mha_test_grpc.{m}") for m in
                 ("health_pb2", "health_pb2_grpc", "reflection_pb2", "reflection_pb2_grpc"))


def _remove_stub_dirs():
    import shutil
    for folder in (_STUB_DIR, _GRPC_STUB_DIR):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


import atexit  # noqa: E402
atexit.register(_remove_stub_dirs)
