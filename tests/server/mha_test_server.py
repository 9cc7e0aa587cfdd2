"""Starts a real mha_server for tests and gives them stubs to call it with.

    with TestServer(mha_server, repo_dir) as s:
        stub = s.stub()                      # mha.v1.AttentionService
        s.metrics()                          # the /metrics text
    s.exit_code                              # after SIGTERM

The process handling (free ports, ready line, SIGTERM and wait) is the
Python client's LocalServer (client/python/mha_local_server.py), and the stubs
are the client's (client/python/mha_client.py: client/python/gen/ when it
is up to date, else generated from proto/ with protoc and Debian's
grpc_python_plugin into a temporary folder).
"""

import importlib
import os
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO_ROOT, "client", "python"))
import mha_client  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402

# The binary under test: ctest passes its build's; by hand, build/'s.
MHA_SERVER = os.environ.get("MHA_SERVER", os.path.join(REPO_ROOT, "build", "mha_server"))


def address_sanitized(binary):
    """Whether `binary` was built with AddressSanitizer: gcc's links libasan,
    clang's carries its runtime inside (its __asan_init symbol)."""
    with open(binary, "rb") as f:
        return b"__asan_init" in f.read()


# The binary under test maps ASan's shadow (no RLIMIT_AS; more memory, slower).
ASAN = address_sanitized(MHA_SERVER)


def load_stubs():
    """(attention_pb2, attention_pb2_grpc, model_config_pb2), loaded once."""
    return mha_client.load_stubs()


class TestServer(LocalServer):
    """One mha_server process on free loopback ports (see LocalServer), with
    a channel, stubs and the metrics page for tests."""

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


class OneServerPerClass(unittest.TestCase):
    """The tests of a class share one mha_server: setUpClass writes a model
    repository into a temporary folder (the class's make_repository, which
    returns what the tests keep as `models`), starts the server on it with
    `server_flags` and opens `channel`; tearDownClass closes and stops them
    and fails the class when the server exited non-zero (with its stderr).
    Subclasses add their stubs in setUpClass after calling this one."""

    server_flags = ()

    @classmethod
    def make_repository(cls, folder):
        raise NotImplementedError("a OneServerPerClass names its models")

    @classmethod
    def make_server(cls):
        """The server to start on the repository in cls.repo (not started)."""
        return TestServer(MHA_SERVER, cls.repo, list(cls.server_flags))

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="mha_test_repo_")
        cls.repo = cls.tmp.name
        cls.models = cls.make_repository(cls.repo)
        cls.server = cls.make_server()
        cls.server.start()
        cls.channel = cls.server.channel()

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        code = cls.server.stop()
        cls.tmp.cleanup()
        if code != 0:
            raise AssertionError(f"{cls.__name__}'s server exited with {code}; stderr:\n"
                                 f"{cls.server.stderr()}")
        cls.server.remove_log()


def random_layer(seed, embed_dim, heads):
    """A torch.nn.MultiheadAttention (batch_first, eval) with seeded weights
    and biases drawn from U(-0.5, 0.5), so that a wrong bias shows."""
    import torch
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True).eval()
    with torch.no_grad():
        m.in_proj_bias.uniform_(-0.5, 0.5)
        m.out_proj.bias.uniform_(-0.5, 0.5)
    return m


def proc_status(pid, field):
    """A VmXXX field (VmRSS, VmHWM, ...) of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss_bytes(pid):
    """The resident set of process `pid`, in bytes (0 when it is gone)."""
    try:
        return proc_status(pid, "VmRSS")
    except (FileNotFoundError, KeyError):  # gone, or a zombie without memory
        return 0


def wait_for(predicate, timeout=30.0, what="condition"):
    """Polls `predicate` until it holds; AssertionError after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def metric_value(text, name, **labels):
    """The sum of the samples of the Prometheus text `text` named `name` with
    these labels (over the labels not given, e.g. every version of a
    model, as PromQL's sum would), or 0.0."""
    return metric_sample(text, name, **labels) or 0.0


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
    total = None
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


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


def load_reflection_v1_stubs():
    """(reflection_v1_pb2, reflection_v1_pb2_grpc): grpc.reflection.v1, the
    same messages as v1alpha in another package, generated once."""
    load_grpc_stubs()
    folder = os.path.join(_GRPC_STUB_DIR, "mha_test_grpc")
    path = os.path.join(folder, "reflection_v1.proto")
    if not os.path.exists(path):
        text = _REFLECTION_PROTO.replace("package grpc.reflection.v1alpha;",
                                         "package grpc.reflection.v1;")
        with open(path, "w") as f:
            f.write(text)
        subprocess.run(
            ["protoc", f"-I{_GRPC_STUB_DIR}", f"--python_out={_GRPC_STUB_DIR}",
             f"--grpc_out={_GRPC_STUB_DIR}",
             "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", path], check=True)
    return tuple(importlib.import_module(f"mha_test_grpc.{m}") for m in
                 ("reflection_v1_pb2", "reflection_v1_pb2_grpc"))


def _remove_stub_dirs():
    import shutil
    if _GRPC_STUB_DIR is not None:
        shutil.rmtree(_GRPC_STUB_DIR, ignore_errors=True)


import atexit  # noqa: E402
atexit.register(_remove_stub_dirs)
