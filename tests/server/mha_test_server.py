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
