"""Python client of mha-serve (mha.v1.AttentionService over gRPC).

    from mha_client import MhaClient

    with MhaClient("127.0.0.1:50051", timeout=10) as client:
        output, _ = client.attend("demo", query)                   # self-attention
        output, weights = client.attend("cross", query, key, value,
                                        key_padding_mask=pad, need_weights=True)
        client.list_models()                                       # [mha.v1.ModelInfo]
        client.get_model("demo").embed_dim

    MhaClient(target, tls=True, ca="ca.pem", token="...")          # a secured server
    MhaClient(target, wait_for_ready=True, retries=3)              # ride out restarts

Arrays are numpy arrays (or anything np.asarray accepts, e.g. CPU torch
tensors). On the wire: float32 -> DATA_TYPE_FP32, float16 -> DATA_TYPE_FP16,
bool -> DATA_TYPE_BOOL; float64 is sent (and computed) as FP32. The output
comes back in the query's dtype and shape (float16 in, float16 out; float64
in, float64 out); attention weights are float32. Masks are bool (True =
masked out, sent as BOOL) or floating (added to the scores, -inf = masked
out, sent as FP32); an integer mask is a TypeError, as in PyTorch.

Errors are the server's gRPC status, raised as grpc.RpcError as every gRPC
Python call does: `e.code()` is a grpc.StatusCode (INVALID_ARGUMENT for a
bad request, NOT_FOUND for an unknown model, UNAVAILABLE when the server is
down or draining, UNAUTHENTICATED without the server's token,
DEADLINE_EXCEEDED after `timeout` seconds, ...) and `e.details()` the
message, e.g. "query: expected last dimension 256, got 255". Arrays of an
unsupported dtype raise TypeError before any call.

Installed (`pip install --no-deps --no-build-isolation ./client/python`),
the module uses the stubs generated into its wheel (mha_client_stubs). In
the source tree it imports mha.v1.attention_pb2(_grpc) from
client/python/gen/, written by one command,

    client/python/generate_stubs.sh

If gen/ is missing or older than proto/, it runs that script into a
temporary folder instead (removed at exit), which needs protoc and
grpc_python_plugin (Debian: protobuf-compiler, protobuf-compiler-grpc).
Either stub folder goes on sys.path (the generated modules import each
other as mha.v1.* and inference.*).
"""

import json
import uuid

import grpc
import numpy as np

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the server's default limit

try:
    from mha_stubs import generate_stubs, load_kserve_stubs, load_stubs  # noqa: F401 (API)
    import mha_wire
except ModuleNotFoundError as missing:
    raise ImportError(
        "mha_client: mha_stubs.py or mha_wire.py is not next to it: install the client (pip install --no-deps "
        "--no-build-isolation ./client/python) or copy client/python/ whole") from missing


# ----------------------------------------------------------------- tensors

# mha.v1 DataType names of the wire dtypes, for mha_wire.array_of.
_DATATYPE_NAMES = {"DATA_TYPE_FP32": "FP32", "DATA_TYPE_FP16": "FP16", "DATA_TYPE_BF16": "BF16",
                   "DATA_TYPE_BOOL": "BOOL"}


def _wire_array(array):
    """(mha.v1 dtype, C-contiguous little-endian array) of an array:
    float32/float64 -> FP32, float16 -> FP16, bool -> BOOL (one byte per
    element), the array itself when it already is one. TypeError for any
    other dtype."""
    _, _, config_pb = load_stubs()
    a = np.asarray(array)
    if a.dtype == np.bool_:
        return config_pb.DATA_TYPE_BOOL, np.ascontiguousarray(a).view(np.uint8)
    if a.dtype.kind == "f" and a.dtype.itemsize == 2:  # float16, either byte order
        return config_pb.DATA_TYPE_FP16, mha_wire.little_endian(a, "<f2")
    if a.dtype.kind == "f" and a.dtype.itemsize in (4, 8):
        return config_pb.DATA_TYPE_FP32, mha_wire.little_endian(a, "<f4")
    raise TypeError(f"cannot send a {a.dtype} tensor: use float32, float64 or float16 "
                    "(bool only for masks)")


def to_tensor(array):
    """An mha.v1.Tensor of a numpy array: float32/float64 -> FP32,
    float16 -> FP16, bool -> BOOL (one byte per element). TypeError for
    any other dtype."""
    pb, _, _ = load_stubs()
    dtype, a = _wire_array(array)
    return pb.Tensor(dtype=dtype, shape=a.shape, data=a.tobytes())


def _array_of(tensor, buf=None, where=None):
    """A numpy array of an mha.v1.Tensor whose data is buf[offset:offset +
    length] for where = (offset, length), or in the tensor itself: FP32 ->
    float32, FP16 -> float16 (read-only views of the received bytes), BOOL
    -> bool, BF16 -> float32 (numpy has no bfloat16)."""
    _, _, config_pb = load_stubs()
    name = config_pb.DataType.Name(tensor.dtype) if tensor.dtype in (
        config_pb.DataType.values()) else str(tensor.dtype)
    if name not in _DATATYPE_NAMES:
        raise ValueError(f"tensor has unknown dtype {tensor.dtype}")
    if where is None:
        buf, where = tensor.data, (0, len(tensor.data))
    datatype = _DATATYPE_NAMES[name]
    if datatype == "BOOL":
        return np.frombuffer(buf, np.uint8, where[1], where[0]).reshape(tuple(tensor.shape)) != 0
    return mha_wire.array_of(datatype, buf, where[0], where[1], tuple(tensor.shape))


def from_tensor(tensor):
    """A numpy array of an mha.v1.Tensor: FP32 -> float32, FP16 -> float16
    (read-only views of its bytes), BOOL -> bool, BF16 -> float32 (numpy has
    no bfloat16)."""
    return _array_of(tensor)


def _set_optional(request, tensors, masks):
    """Sets each field of `request` named in `tensors` or `masks` whose
    array is not None: tensors as they are, masks checked as masks."""
    for field, array in tensors.items():
        if array is not None:
            getattr(request, field).CopyFrom(to_tensor(array))
    for field, mask in masks.items():
        if mask is not None:
            getattr(request, field).CopyFrom(to_tensor(_mask_array(mask, field)))


def _mask_array(mask, name):
    """Masks go as BOOL (bool arrays) or FP32 (floating arrays, added to the
    scores). Anything else is a TypeError: an integer 0/1 mask sent as a
    float would add 1 to the scores instead of masking (PyTorch refuses
    integer masks too)."""
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return m
    if np.issubdtype(m.dtype, np.floating):
        return mha_wire.little_endian(m, "<f4")
    raise TypeError(f"{name}: cannot send a {m.dtype} mask: use bool (True = masked out) "
                    "or a floating type (added to the scores, -inf = masked out)")


def attend_request_bytes(model, query, key=None, value=None, key_padding_mask=None,
                         attn_mask=None, is_causal=False, need_weights=False,
                         per_head_weights=False, model_version=0):
    """An AttendRequest as the bytes protobuf would write for it, each
    tensor's bytes copied once, into them (a C-contiguous array already in
    its wire dtype is not copied before)."""
    pb, _, _ = load_stubs()
    arrays = {"query": _wire_array(query)}
    for name, array in (("key", key), ("value", value)):
        if array is not None:
            arrays[name] = _wire_array(array)
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None:
            arrays[name] = _wire_array(_mask_array(mask, name))
    parts = []
    for name, number in _ATTEND_TENSOR_FIELDS:
        if name in arrays:
            dtype, a = arrays[name]
            fields = pb.Tensor(dtype=dtype, shape=a.shape).SerializeToString()
            parts += mha_wire.message_with_bytes(number, fields, 3, mha_wire.bytes_of(a))
    parts.append(pb.AttendRequest(
        model=model, is_causal=is_causal, need_weights=need_weights,
        per_head_weights=per_head_weights, model_version=model_version).SerializeToString())
    return b"".join(parts)


# AttendRequest's tensor fields by number; AttendResponse's tensors' data.
_ATTEND_TENSOR_FIELDS = (("query", 2), ("key", 3), ("value", 4), ("key_padding_mask", 5),
                         ("attn_mask", 6))
_ATTEND_RESPONSE_PAYLOADS = {1: {3: None}, 2: {3: None}}


# ----------------------------------------------------------------- client

MAX_RETRIES = 4  # gRPC caps a call at 5 attempts


def _reconnect_options(first_s, longest_s):
    """Channel arguments of the reconnect backoff, in seconds."""
    if not 0 < first_s <= longest_s:
        raise ValueError(f"reconnect_backoff: need 0 < first <= longest, got ({first_s}, {longest_s})")
    return [("grpc.initial_reconnect_backoff_ms", int(first_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(longest_s * 1000))]


def _retry_options(retries, first_s, longest_s, buffer_bytes):
    """Channel arguments of gRPC's retry policy: UNAVAILABLE is retried
    `retries` times on every method of both services. gRPC gives up
    retrying a call whose messages exceed its per-call buffer (256 KiB by
    default), so the buffer is as large as a message may be."""
    if not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries: 0 to {MAX_RETRIES} (gRPC caps a call at "
                         f"{MAX_RETRIES + 1} attempts), got {retries}")
    if retries == 0:
        return []  # gRPC's transparent retries (calls that never left) stay on
    if not 0 < first_s <= longest_s:
        raise ValueError(f"retry_backoff: need 0 < first <= longest, got ({first_s}, {longest_s})")
    policy = {"maxAttempts": retries + 1, "initialBackoff": f"{first_s}s",
              "maxBackoff": f"{longest_s}s", "backoffMultiplier": 2,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    config = {"methodConfig": [{"name": [{"service": "mha.v1.AttentionService"},
                                         {"service": "inference.GRPCInferenceService"}],
                                "retryPolicy": policy}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config)),
            ("grpc.per_rpc_retry_buffer_size", buffer_bytes)]


def _read(path):
    """The bytes of a PEM file, or None for no path."""
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class MhaClient:
    """One channel to one mha_server. Safe to share between threads (gRPC
    channels and stubs are); close() it, or use it in a `with` block, when
    done. Every call raises grpc.RpcError with the server's status on
    failure."""

    def __init__(self, target, timeout=30.0, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                 tls=False, ca=None, cert=None, key=None, token=None,
                 wait_for_ready=False, retries=0, retry_backoff=(0.1, 2.0),
                 reconnect_backoff=(0.1, 1.0)):
        """target: "host:port". timeout: seconds per call (the gRPC
        deadline); None = no deadline.

        For a server started with --tls_cert/--tls_key: tls=True (implied
        by ca or cert); ca: PEM file of the roots to trust (default: the
        system's); cert, key: PEM files of a client certificate, for a
        server with --tls_client_ca. token: the bearer token of a server
        with --auth_token_file, sent as "authorization: Bearer <token>".

        Connection failures:
        wait_for_ready: a call made while the server cannot be reached
          waits (up to `timeout`) for it instead of failing at once with
          UNAVAILABLE — e.g. through a server restart.
        retries (0-4): a call answered UNAVAILABLE (server unreachable or
          draining) is sent again up to this many times, after random
          waits of at most retry_backoff[0] seconds, doubling up to
          retry_backoff[1] (gRPC's retry policy; every call of this client
          computes without side effects, and a Session's append sends the
          position it expects, so a retry is always safe).
        reconnect_backoff: (first, longest) seconds between the channel's
          attempts to reconnect to a server that went away; gRPC's own
          (1, 120) leave calls failing for seconds after a server is back."""
        self._pb, rpc, _ = load_stubs()
        mha_wire.keep_freed_pages()  # large calls reuse their pages (mha_wire)
        self.target, self.timeout, self.wait_for_ready = target, timeout, wait_for_ready
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        options += _reconnect_options(*reconnect_backoff)
        options += _retry_options(retries, *retry_backoff, buffer_bytes=max_message_bytes)
        if tls or ca or cert:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._metadata = [("authorization", f"Bearer {token}")] if token else None
        self._stub = rpc.AttentionServiceStub(self._channel)
        # Attend as bytes both ways, read and written around its tensors'
        # bytes (mha_wire): the same messages as the stub's.
        self._attend_bytes = self._channel.unary_unary("/mha.v1.AttentionService/Attend")

    def _call(self, method, request):
        """One unary call with this client's deadline, token and
        wait_for_ready."""
        return method(request, timeout=self.timeout, metadata=self._metadata,
                      wait_for_ready=self.wait_for_ready)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._channel.close()

    def attend(self, model, query, key=None, value=None, key_padding_mask=None,
               attn_mask=None, is_causal=False, need_weights=False, per_head_weights=False):
        """Multi-head attention of `model` on `query` as
        nn.MultiheadAttention(batch_first=True) computes it.

        query [B, L, E] or [L, E] (float32, float16 or float64); key [B, S, kdim] and
        value [B, S, vdim] (both None: self-attention; value None: value =
        key); key_padding_mask [B, S] and attn_mask [L, S] or [B*h, L, S],
        bool (True = masked out) or floating (added to the scores), never
        integer (TypeError); is_causal:
        query i may not attend key j > i.

        Returns (output, weights): output has the query's shape and dtype;
        weights is None unless need_weights, then float32 [B, L, S'] (the
        mean over heads) or [B, h, L, S'] with per_head_weights. float32 and
        float16 results are read-only views of the received bytes (no copy):
        .copy() one to write into it."""
        query = np.asarray(query)
        request = attend_request_bytes(model, query, key, value, key_padding_mask, attn_mask,
                                       is_causal, need_weights, per_head_weights)
        received = self._call(self._attend_bytes, request)
        response, payloads = mha_wire.read_message(self._pb.AttendResponse, received,
                                                   _ATTEND_RESPONSE_PAYLOADS)
        weights = (_array_of(response.attn_weights, received, payloads.get((2, 3)))
                   if response.HasField("attn_weights") else None)
        output = _array_of(response.output, received, payloads.get((1, 3)))
        if query.dtype.kind == "f" and query.dtype.itemsize == 8:  # sent, computed as float32
            output = output.astype(np.float64)
        return output, weights

    def list_models(self):
        """[mha.v1.ModelInfo] of every model folder the server found,
        including failed ones (state STATE_FAILED, `error` says why)."""
        response = self._call(self._stub.ListModels, self._pb.ListModelsRequest())
        return list(response.models)

    def get_model(self, name):
        """mha.v1.ModelInfo of one model: config, state, weight_layout,
        parameter_count and the effective embed_dim, num_heads, kdim, vdim.
        NOT_FOUND (grpc.RpcError) for an unknown name."""
        return self._call(self._stub.GetModel, self._pb.GetModelRequest(name=name))

    # ------------------------------------------------------------- sessions

    def open_session(self, model, memory=None, memory_value=None, memory_key_padding_mask=None,
                     session_id="", idle_timeout_s=0, max_tokens=0, model_version=0):
        """Opens a session on the server: its key/value cache stays there
        between calls, so each step sends only its new tokens. Without a
        memory, a self-attention (decoder) session: each appended token
        attends to every token before it and to itself. With a memory
        [1, S, kdim] (an encoder's output; memory_value [1, S, vdim],
        memory_key_padding_mask [1, S]), a cross-attention session: each
        token attends to the memory, projected once, here.

        Returns a Session; use it in a `with` block (or close() it)."""
        # The id is chosen here unless given, and sent as x-session-id with
        # every call of the session, this one included: a balancer hashing
        # on it sends them all to the replica holding the session.
        session_id = session_id or f"py-{uuid.uuid4().hex}"
        request = self._pb.OpenSessionRequest(
            model=model, session_id=session_id, idle_timeout_ms=int(idle_timeout_s * 1000),
            max_tokens=max_tokens, model_version=model_version)
        _set_optional(request, tensors={"memory": memory, "memory_value": memory_value},
                      masks={"memory_key_padding_mask": memory_key_padding_mask})
        return Session(self, self._session_call(self._stub.OpenSession, request, session_id))

    def import_session(self, data, session_id=None):
        """A Session made from `data`, the bytes Session.export() returned (or
        a session file of --session_spill_dir), on this server, which must
        serve the same model version (FAILED_PRECONDITION naming both
        fingerprints otherwise). `session_id` replaces the exported id."""
        chunks = list(_session_chunks(self._pb, data))
        sid = chunks[0].header.session_id if chunks and chunks[0].HasField("header") else ""
        if session_id is not None and chunks:
            # The header stays as written (its checksum covers it).
            chunks[0].import_as = sid = session_id
        metadata = list(self._metadata or []) + [("x-session-id", sid)]
        info = self._stub.ImportSession(iter(chunks), timeout=self.timeout, metadata=metadata,
                                        wait_for_ready=self.wait_for_ready)
        return Session(self, info)

    def list_sessions(self, model=""):
        """[mha.v1.SessionStatus] of the sessions open on the server."""
        request = self._pb.ListSessionsRequest(model=model)
        return list(self._call(self._stub.ListSessions, request).sessions)

    def _session_call(self, method, request, session_id, timeout=None):
        """A session's call, with its id as `x-session-id` metadata (what a
        load balancer hashes on to reach the replica holding it)."""
        metadata = list(self._metadata or []) + [("x-session-id", session_id)]
        return method(request, timeout=timeout or self.timeout, metadata=metadata,
                      wait_for_ready=self.wait_for_ready)


# The session file format (mha_wire.py), under the names tests use.
SESSION_FILE_MAGIC, _session_chunks = mha_wire.SESSION_FILE_MAGIC, mha_wire.session_chunks
_session_file_bytes = mha_wire.session_file_bytes


class Session:
    """A session open on an mha_server (MhaClient.open_session): `id`,
    `position` (tokens cached), `cross`, `model`. Each append sends the
    position it expects, so a step is never applied twice or out of order
    (FAILED_PRECONDITION instead). A step whose answer was lost (its
    deadline passed, the connection broke) is safe to send again: the
    server gives the same answer again without applying it twice
    (append(..., retries=N) does it for you); sync() reads the server's
    position when a step's fate is unknown. Not thread-safe: one caller at
    a time. A context manager that closes the session."""

    RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)  # applied or not

    def __init__(self, client, info):
        self._client, self.info = client, info
        self.id, self.position = info.session_id, info.position
        self.cross, self.model = info.cross, info.model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def append(self, query, need_weights=False, retries=0, timeout=None):
        """The outputs of `query` [1, T, E] or [T, E] (T new tokens), as
        Attend over the whole sequence with is_causal would give them (self
        session) or as Attend with key = the memory (cross session).
        Returns output, or (output, weights [.., T, K']) with need_weights.

        A call that fails with DEADLINE_EXCEEDED or UNAVAILABLE may have
        been applied on the server: send the same query again (or pass
        `retries`, sent again up to that many times) and the server answers
        it again, bit for bit, without applying it twice. `timeout`: this
        call's deadline in seconds (default: the client's)."""
        query = np.asarray(query)
        self._check_open()
        pb = self._client._pb
        request = pb.AppendRequest(session_id=self.id, query=to_tensor(query),
                                   expected_position=self.position, need_weights=need_weights)
        for attempt in range(retries + 1):
            try:
                response = self._client._session_call(self._client._stub.Append, request,
                                                      self.id, timeout)
                break
            except grpc.RpcError as e:
                if attempt == retries or e.code() not in self.RETRYABLE:
                    raise
        self.position = response.position
        output = from_tensor(response.output)
        if query.dtype == np.float64:
            output = output.astype(np.float64)
        if need_weights:
            return output, from_tensor(response.attn_weights)
        return output

    def sync(self):
        """Reads the session's position on the server into `position` and
        returns it: after a step whose fate is unknown and that is not sent
        again, append goes on from where the server is. LookupError when the
        session is gone."""
        self._check_open()
        for status in self._client.list_sessions(self.model):
            if status.session_id == self.id:
                self.position = status.position
                return self.position
        raise LookupError(f"session {self.id} is not open on the server")

    def export(self):
        """The session as bytes (the format of --session_spill_dir files: a
        header naming the model version and its fingerprint, the cache
        blocks, a checksum), for MhaClient.import_session on this server or
        another serving the same version. The session stays open here."""
        self._check_open()
        pb = self._client._pb
        metadata = list(self._client._metadata or []) + [("x-session-id", self.id)]
        chunks = self._client._stub.ExportSession(
            pb.ExportSessionRequest(session_id=self.id), timeout=self._client.timeout,
            metadata=metadata, wait_for_ready=self._client.wait_for_ready)
        return _session_file_bytes(chunks)

    def fork(self, session_id=""):
        """A new Session at this one's position sharing its cache on the
        server copy-on-write (beam search, sampling several continuations):
        no cache bytes until one of them appends past the shared blocks.
        `session_id` "" lets the server choose. Close each branch."""
        self._check_open()
        pb = self._client._pb
        info = self._client._session_call(
            self._client._stub.ForkSession,
            pb.ForkSessionRequest(session_id=self.id, new_session_id=session_id), self.id)
        return Session(self._client, info)

    def _check_open(self):
        if self.id is None:
            raise ValueError(f"session {self._closed_id} is closed (close() was called): "
                             "open a new one")

    def close(self):
        """Frees the session on the server; returns the bytes that freed (0
        when it was already gone; blocks shared with a fork stay until
        their last session closes)."""
        if self.id is None:
            return 0
        pb = self._client._pb
        session_id, self.id = self.id, None
        self._closed_id = session_id
        try:
            response = self._client._session_call(
                self._client._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id),
                session_id)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        return response.freed_bytes
