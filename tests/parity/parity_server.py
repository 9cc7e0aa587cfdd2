"""The mha_server half of parity.py --server.

Every case's model folder sits in one model repository under the name
model_name(id); one mha_server serves them all. A case becomes one Attend
call carrying what mha_run would get: the same tensors (FP32, masks BOOL or
FP32, unbatched ones 2-D) and the flags is_causal, need_weights and
per_head_weights. The answer comes back as {name: float32 array} and
{name: dtype}, the shape of mha_run's outputs file, so parity.compare
judges both modes the same way.

The server is started by tests/server/mha_test_server.py (TestServer), which
also generates the Python stubs from proto/.
"""

import importlib.util
import os

import grpc

from mha_model_io import decode_tensor

_HELPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "..", "server", "mha_test_server.py")
# mha.v1.DataType names -> the safetensors dtype strings parity.py reports.
_WIRE_DTYPES = {"DATA_TYPE_FP32": "F32", "DATA_TYPE_BF16": "BF16",
                "DATA_TYPE_FP16": "F16", "DATA_TYPE_BOOL": "BOOL"}
_STDERR_TAIL_LINES = 20


def model_name(case_id):
    """The repository folder (and model name) of a case: case000, case001..."""
    return f"case{case_id:03d}"


def _load_test_server_helper():
    """tests/server/mha_test_server.py, imported by path."""
    spec = importlib.util.spec_from_file_location("mha_test_server",
                                                  _HELPER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ParityServer:
    """Owns one mha_server process over `repository` for the duration of a
    `with` block; attend() may be called inside it, from one thread."""

    def __init__(self, binary, repository, timeout_s):
        self._binary, self._repository = binary, repository
        self._timeout_s = timeout_s
        self._helper = _load_test_server_helper()
        self._pb, _, self._config_pb = self._helper.load_stubs()
        self._server = None
        self._stub = None

    def __enter__(self):
        self._server = self._helper.TestServer(self._binary, self._repository)
        self._server.start()
        self._stub = self._server.stub()
        return self

    def __exit__(self, *exc):
        self._server.stop()

    def attend(self, c, name, inputs):
        """Case c through model `name`. Returns (failure or None,
        {output name: float32 array}, {output name: dtype string})."""
        try:
            response = self._stub.Attend(self._request(c, name, inputs),
                                         timeout=self._timeout_s)
        except grpc.RpcError as e:
            failure = f"Attend failed: {e.code().name}: {e.details()}"
            code = self._server.process.poll()
            if code is not None:
                failure += f" (mha_server exited with code {code})"
            return failure, {}, {}
        actual, dtypes = {}, {}
        for field in ("output", "attn_weights"):
            if not response.HasField(field):
                continue  # compare() reports it if it was expected
            wire = getattr(response, field)
            try:
                dtypes[field] = _WIRE_DTYPES[
                    self._config_pb.DataType.Name(wire.dtype)]
                actual[field] = decode_tensor(wire.data, dtypes[field],
                                              tuple(wire.shape))
            except (KeyError, ValueError) as e:
                return f"{field}: cannot decode the response tensor " \
                       f"(dtype {wire.dtype}, shape {list(wire.shape)}, " \
                       f"{len(wire.data)} bytes): {e}", {}, {}
        return None, actual, dtypes

    def _request(self, c, name, inputs):
        """The AttendRequest of case c: its inputs and mha_run's flags."""
        request = self._pb.AttendRequest(
            model=name, is_causal=c.causal, need_weights=c.weights is not None,
            per_head_weights=c.weights == "head")
        for field, value in inputs.items():
            # numpy bool -> DATA_TYPE_BOOL (one byte each), else FP32.
            getattr(request, field).CopyFrom(
                self._helper.tensor(self._pb, self._config_pb, value.numpy()))
        return request

    def problems(self):
        """After the `with` block: what went wrong with the server itself."""
        if self._server.exit_code == 0:
            return []
        tail = self._server.stderr().splitlines()[-_STDERR_TAIL_LINES:]
        return [f"mha_server exited with code {self._server.exit_code} "
                f"(expected 0 after SIGTERM); end of its stderr:"] + \
               [f"    {line}" for line in tail]
