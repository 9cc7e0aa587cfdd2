"""Python client of mha-serve over HTTP/REST (KServe v2 with Triton's binary
tensor extension), with only the standard library and numpy: no grpcio, no
protobuf, no generated stubs.

    from mha_http import MhaHttpClient

    with MhaHttpClient("http://127.0.0.1:8000", timeout=10) as client:
        output, _ = client.attend("demo", query)                   # self-attention
        output, weights = client.attend("cross", query, key, value,
                                        key_padding_mask=pad, need_weights=True)
        client.get_model("demo")["inputs"]                         # KServe metadata
        client.ready()                                             # True / False
        with client.open_session("demo") as session:               # a Triton sequence
            out = session.append(token)                            # [1, 1, E]

    MhaHttpClient("https://host:8000", ca="ca.pem", token="...")   # a secured server

attend() takes and returns what MhaClient.attend (gRPC) does, and refuses
the same misread tensors before any call: float32/float64 -> FP32, float16
-> FP16, bool -> BOOL; masks bool (True = masked out) or floating (added
to the scores), an integer mask is a TypeError, as in PyTorch. Tensors go
and come back as raw little-endian bytes (the binary extension), never as
JSON numbers.

Errors are HttpError: `e.status` the HTTP status, `e.code()` the gRPC code
name the server answered (its mha-status-code header, so the same code as
over gRPC: RESOURCE_EXHAUSTED for both a 413 and a full budget's 503), or,
from a server without the header, the code the status stands for
(INVALID_ARGUMENT for 400, RESOURCE_EXHAUSTED for 413, UNAVAILABLE for 503
or an unreachable server, DEADLINE_EXCEEDED for 504, ...); `e.details()`
the server's message, as grpc.RpcError offers them; `e.retryable()`
whether the same call may pass later (503 and 504: docs/KSERVE.md's
table).
"""

import http.client
import json
import ssl
import threading
import urllib.parse
import uuid

import numpy as np

import mha_wire

_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 405: "UNIMPLEMENTED", 413: "RESOURCE_EXHAUSTED",
          501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class HttpError(Exception):
    """The server's refusal (or an unreachable server: status 0)."""

    def __init__(self, status, message, code=None):
        code = code or self.code_of(status)
        super().__init__(f"{code} (HTTP {status}): {message}")
        self.status, self.message, self._code = status, message, code

    @staticmethod
    def code_of(status):
        return "UNAVAILABLE" if status == 0 else _CODES.get(status, "INTERNAL")

    def code(self):
        return self._code

    def retryable(self):
        """Whether the same call may pass later: the server was unreachable,
        busy or full (0, 503) or the deadline passed (504); never a 4xx."""
        return self.status in (0, 503, 504)

    def details(self):
        return self.message


def _wire(array, name, mask=False):
    """(datatype, little-endian bytes) of an array, or TypeError: a view of
    the array's own bytes when it is already C-contiguous in that dtype,
    else of its one converted copy."""
    a = np.asarray(array)
    if mask and not (a.dtype == np.bool_ or np.issubdtype(a.dtype, np.floating)):
        raise TypeError(f"{name}: cannot send a {a.dtype} mask: use bool (True = masked out) "
                        "or a floating type (added to the scores, -inf = masked out)")
    if a.dtype == np.bool_:
        return "BOOL", mha_wire.bytes_of(np.ascontiguousarray(a).view(np.uint8))
    if a.dtype.kind == "f" and a.dtype.itemsize == 2 and not mask:
        return "FP16", mha_wire.bytes_of(mha_wire.little_endian(a, "<f2"))
    if (a.dtype.kind == "f" and a.dtype.itemsize in (4, 8)) or (
            mask and np.issubdtype(a.dtype, np.floating)):
        return "FP32", mha_wire.bytes_of(mha_wire.little_endian(a, "<f4"))
    raise TypeError(f"cannot send a {a.dtype} tensor: use float32, float64 or float16 "
                    "(bool only for masks)")


def _from_wire(datatype, data, offset, size, shape):
    """The output held in data[offset:offset + size]: a read-only view for
    FP32 and FP16 (no copy)."""
    if datatype == "BOOL":
        return np.frombuffer(data, np.uint8, size, offset).reshape(shape) != 0
    return mha_wire.array_of(datatype, data, offset, size, shape)


class MhaHttpClient:
    """Calls one mha_server's HTTP port. Safe to share between threads (each
    thread keeps its own keep-alive connection); close() it, or use it in a
    `with` block, when done."""

    def __init__(self, url="http://127.0.0.1:8000", timeout=30.0, token=None, ca=None,
                 cert=None, key=None):
        """url: "http://host:port" or "https://host:port". timeout: seconds
        per call. token: the bearer token of a server with
        --auth_token_file. ca: PEM file of the roots to trust for https
        (default: the system's); cert, key: a client certificate."""
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"url: expected http:// or https://, got {url!r}")
        self._host, self._port = parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                                 else 80)
        self._tls = None
        if parts.scheme == "https":
            self._tls = ssl.create_default_context(cafile=ca)
            if cert:
                self._tls.load_cert_chain(cert, key)
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._local = threading.local()
        mha_wire.keep_freed_pages()  # large calls reuse their pages (mha_wire)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._tls is not None:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout,
                                                   context=self._tls)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _request(self, method, path, body=None, headers=None):
        """(status, headers, body) of one call; a connection the server
        closed meanwhile is opened again once."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=body, headers={**self._headers, **(headers or {})})
                r = conn.getresponse()
                return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine,
                    BrokenPipeError) as e:
                self.close()
                if attempt == 1:
                    raise HttpError(0, f"cannot reach {self._host}:{self._port}: {e}") from e
            except OSError as e:  # refused, timed out, no route
                self.close()
                raise HttpError(0, f"cannot reach {self._host}:{self._port}: {e}") from e

    def _checked(self, method, path, body=None, headers=None):
        status, head, data = self._request(method, path, body, headers)
        if status != 200:
            try:
                message = json.loads(data)["error"]
            except (ValueError, KeyError, TypeError):
                message = data.decode(errors="replace") or f"HTTP {status}"
            raise HttpError(status, message, head.get("mha-status-code"))
        return head, data

    def ready(self):
        """Whether the server is ready (not draining)."""
        try:
            return self._request("GET", "/v2/health/ready")[0] == 200
        except HttpError:
            return False

    def get_model(self, name, version=""):
        """KServe model metadata: name, versions, platform, inputs, outputs."""
        path = f"/v2/models/{urllib.parse.quote(name, safe='')}"
        if version:
            path += f"/versions/{version}"
        return json.loads(self._checked("GET", path)[1])

    def attend(self, model, query, key=None, value=None, key_padding_mask=None,
               attn_mask=None, is_causal=False, need_weights=False, per_head_weights=False):
        """As MhaClient.attend: returns (output, weights); output has the
        query's shape and dtype, weights is None unless need_weights."""
        query = np.asarray(query)
        inputs = _inputs(query, {"key": key, "value": value},
                         {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask})
        arrays = self._infer(model, 0, inputs, need_weights, {
            "is_causal": bool(is_causal), "need_weights": bool(need_weights),
            "per_head_weights": bool(per_head_weights)})
        return _as_query(arrays["output"], query), arrays.get("attn_weights")

    # ------------------------------------------------------------- sessions

    def open_session(self, model, memory=None, memory_value=None, memory_key_padding_mask=None,
                     session_id="", model_version=0):
        """As MhaClient.open_session, over KServe v2's sequences (Triton's
        sequence_id, sequence_start and sequence_end): a Session whose
        cache stays on the server between appends. Nothing is sent here:
        the first append starts the sequence (with the memory, for a
        cross-attention session) and close() ends it. The server's
        --session_idle_timeout_s and --session_max_tokens apply (KServe's
        protocol has no per-sequence limits)."""
        session_id = session_id or f"py-{uuid.uuid4().hex}"
        memory_inputs = [] if memory is None else _inputs(
            np.asarray(memory), {"value": memory_value},
            {"key_padding_mask": memory_key_padding_mask}, first="key")
        return HttpSession(self, model, session_id, memory_inputs, model_version)

    def _infer(self, model, version, inputs, need_weights, parameters):
        """{output name: array} of one infer call with binary tensors."""
        outputs = ["output"] + (["attn_weights"] if need_weights else [])
        header = {
            "inputs": [{"name": n, "datatype": t, "shape": list(s),
                        "parameters": {"binary_data_size": len(b)}} for n, t, b, s in inputs],
            "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs],
            "parameters": parameters,
        }
        text = json.dumps(header).encode()
        # Sent piece by piece (no joined copy of the tensors' bytes).
        body = [text] + [b for _, _, b, _ in inputs]
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}"
        if version:
            path += f"/versions/{int(version)}"
        head, data = self._checked(
            "POST", path + "/infer", body,
            {"Inference-Header-Content-Length": str(len(text)),
             "Content-Type": "application/octet-stream",
             "Content-Length": str(sum(len(part) for part in body))})
        length = int(head.get("inference-header-content-length", len(data)))
        answer = json.loads(data[:length])
        arrays, offset = {}, length
        for out in answer["outputs"]:
            size = out["parameters"]["binary_data_size"]
            arrays[out["name"]] = _from_wire(out["datatype"], data, offset, size, out["shape"])
            offset += size
        return arrays


def _inputs(first_array, tensors, masks, first="query"):
    """[(name, datatype, bytes, shape)] of the given arrays (None skipped)."""
    inputs = [(first, *_wire(first_array, first), first_array.shape)]
    for group, mask in ((tensors, False), (masks, True)):
        for name, array in group.items():
            if array is not None:
                a = np.asarray(array)
                inputs.append((name, *_wire(a, name, mask), a.shape))
    return inputs


def _as_query(output, query):
    """The output in the query's dtype (float64 is sent and computed as
    float32)."""
    wide = query.dtype.kind == "f" and query.dtype.itemsize == 8
    return output.astype(np.float64) if wide else output


class HttpSession:
    """A session over HTTP (MhaHttpClient.open_session): a Triton sequence
    of the server, with Session's `id`, `position`, `cross`, `model`,
    append() and close(). export() and fork() are not in KServe's protocol:
    use MhaClient (gRPC) for them. Not thread-safe: one caller at a time. A
    context manager that closes the session."""

    def __init__(self, client, model, session_id, memory_inputs, model_version):
        self._client, self.model, self.id = client, model, session_id
        self._memory, self._version = memory_inputs, model_version
        self.cross, self.position = bool(memory_inputs), 0
        self._started, self._empty = False, None  # the end's query, once known

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def append(self, query, need_weights=False):
        """As Session.append: the outputs of `query` [1, T, E] or [T, E];
        output, or (output, weights) with need_weights."""
        query = np.asarray(query)
        if self.id is None:
            raise ValueError(f"session {self._closed_id} is closed (close() was called): "
                             "open a new one")
        inputs = _inputs(query, {}, {}) + (self._memory if not self._started else [])
        parameters = {"sequence_id": self.id, "sequence_start": not self._started,
                      "need_weights": bool(need_weights)}
        arrays = self._client._infer(self.model, self._version, inputs, need_weights,
                                     parameters)
        self._started, self._memory = True, []
        self._empty = np.zeros(query.shape[:-2] + (0, query.shape[-1]), dtype=np.float32)
        self.position += query.shape[-2]
        output = _as_query(arrays["output"], query)
        return (output, arrays["attn_weights"]) if need_weights else output

    def close(self):
        """Ends the sequence on the server (a sequence_end request without
        tokens), freeing its cache. Nothing to send when it never started;
        a sequence the server already ended (expired, evicted) is no error."""
        if self.id is None:
            return
        session_id, self.id = self.id, None
        self._closed_id = session_id
        if not self._started:
            return
        try:
            self._client._infer(self.model, self._version, _inputs(self._empty, {}, {}), False,
                                {"sequence_id": session_id, "sequence_end": True})
        except HttpError as e:
            if e.status != 400 or "is not open" not in e.message:
                raise
