#!/usr/bin/python3
"""Integration tests of the real mha_server binary against PyTorch.

    /usr/bin/python3 tests/server/test_server.py [unittest options]
    MHA_SERVER=path/to/mha_server /usr/bin/python3 tests/server/test_server.py

Attend's semantics and refusals: writes a temporary model repository (demo,
cross, post, broken), starts the server on free loopback ports and calls it
over gRPC. Its helpers (the models, PyTorch's reference, ServerTestCase) are
the other server tests' too. The service around Attend (models, health,
reflection, metrics, concurrency) is test_service.py's; limits, batching off
and shutdown are test_limits.py's.

References are torch.nn.MultiheadAttention (batch_first) run on its slow
path (gradients enabled), which takes masks exactly as documented: boolean
True = masked out, float = added to the scores.
"""

import os
import shutil
import sys
import unittest
import zlib

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_model_io import format_pbtxt, read_safetensors, write_safetensors  # noqa: E402
from mha_test_server import (MHA_SERVER, REPO_ROOT, OneServerPerClass,  # noqa: E402
                             from_wire, half_tensor, load_grpc_stubs, load_stubs, tensor,
                             to_numpy)
DEMO_DIR = os.path.join(REPO_ROOT, "models", "demo")
pb, rpc, cfg = load_stubs()
health_pb2, health_grpc, reflection_pb2, reflection_grpc = load_grpc_stubs()

TOL = 1e-5          # fp32 outputs and weights against torch
RPC_TIMEOUT = 30.0  # seconds per call
DEMO_E, DEMO_H = 256, 4
CROSS_E, CROSS_H, CROSS_KDIM, CROSS_VDIM = 24, 3, 16, 20
POST_E, POST_H = 32, 2

INVALID = grpc.StatusCode.INVALID_ARGUMENT


# ----------------------------------------------------------------- models

def _write_model(folder, config, tensors):
    os.makedirs(folder)
    write_safetensors(os.path.join(folder, "weights.safetensors"),
                      {n: (t.detach().numpy(), "F32") for n, t in tensors.items()})
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write(format_pbtxt(config))


def _randomize_biases(module, seed):
    # nn.MultiheadAttention starts with zero biases, which would hide a
    # server that ignores them.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.in_proj_bias.copy_(torch.rand(module.in_proj_bias.shape, generator=gen) - 0.5)
        module.out_proj.bias.copy_(torch.rand(module.out_proj.bias.shape, generator=gen) - 0.5)


def load_demo_module():
    arrays, _ = read_safetensors(os.path.join(DEMO_DIR, "weights.safetensors"))
    module = torch.nn.MultiheadAttention(DEMO_E, DEMO_H, batch_first=True)
    module.load_state_dict({n: torch.from_numpy(a) for n, a in arrays.items()})
    return module.eval()


def make_repository(root, names=("demo", "cross", "post", "broken")):
    """Writes the model folders; returns {name: (module, post-norm or None)}."""
    models = {}
    if "demo" in names:
        shutil.copytree(DEMO_DIR, os.path.join(root, "demo"))
        models["demo"] = (load_demo_module(), None)
    if "cross" in names:
        torch.manual_seed(1)
        cross = torch.nn.MultiheadAttention(CROSS_E, CROSS_H, kdim=CROSS_KDIM, vdim=CROSS_VDIM,
                                            batch_first=True).eval()
        _randomize_biases(cross, 11)
        state = cross.state_dict()
        assert "q_proj_weight" in state and "in_proj_weight" not in state, list(state)
        _write_model(os.path.join(root, "cross"),
                     {"embed_dim": CROSS_E, "num_heads": CROSS_H, "kdim": CROSS_KDIM,
                      "vdim": CROSS_VDIM}, state)
        models["cross"] = (cross, None)
    if "post" in names:
        torch.manual_seed(2)
        post = torch.nn.MultiheadAttention(POST_E, POST_H, batch_first=True).eval()
        _randomize_biases(post, 12)
        norm_w = 1 + 0.2 * torch.randn(POST_E)
        norm_b = 0.2 * torch.randn(POST_E)
        tensors = dict(post.state_dict())
        tensors.update({"norm.weight": norm_w, "norm.bias": norm_b})
        _write_model(os.path.join(root, "post"),
                     {"embed_dim": POST_E, "num_heads": POST_H, "post_norm": {}}, tensors)
        models["post"] = (post, (norm_w, norm_b))
    if "broken" in names:
        broken = os.path.join(root, "broken")
        shutil.copytree(DEMO_DIR, broken)
        weights = os.path.join(broken, "weights.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
    return models


# ----------------------------------------------------------------- reference

def _additive(mask):
    mask = torch.from_numpy(np.asarray(mask))
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape).masked_fill(mask, float("-inf"))
    return mask.float()


def reference(model, query, key=None, value=None, key_padding_mask=None, attn_mask=None,
              is_causal=False, per_head=False):
    """(output, attn_weights) of torch for the same request, as numpy.

    A single mask goes to torch as given; several masks (or is_causal,
    which torch 1.13 lacks: True above the diagonal) are combined into one
    additive [B * h, L, S] mask first."""
    module, norm = model
    q = torch.from_numpy(np.asarray(query, dtype=np.float32))
    k = q if key is None else torch.from_numpy(np.asarray(key, dtype=np.float32))
    v = k if value is None else torch.from_numpy(np.asarray(value, dtype=np.float32))
    kpm = None if key_padding_mask is None else torch.from_numpy(np.asarray(key_padding_mask))
    am = None if attn_mask is None else torch.from_numpy(np.asarray(attn_mask))
    if is_causal or (kpm is not None and am is not None):
        batch = q.shape[0] if q.dim() == 3 else 1
        h, length, source = module.num_heads, q.shape[-2], k.shape[-2]
        combined = torch.zeros(batch, h, length, source)
        if attn_mask is not None:
            combined = combined + _additive(attn_mask).reshape(-1, length, source).reshape(
                (1 if np.ndim(attn_mask) == 2 else batch), -1, length, source)
        if key_padding_mask is not None:
            combined = combined + _additive(key_padding_mask).reshape(batch, 1, 1, source)
        if is_causal:
            causal = torch.triu(torch.ones(length, source, dtype=torch.bool), 1)
            combined = combined + _additive(causal.numpy())
        kpm, am = None, combined.reshape(batch * h, length, source)
    with torch.enable_grad():  # the slow (reference) path of torch 1.13
        out, weights = module(q, k, v, key_padding_mask=kpm, attn_mask=am, need_weights=True,
                              average_attn_weights=not per_head)
    out = out.detach()
    if norm is not None:
        out = torch.nn.functional.layer_norm(q + out, (q.shape[-1],), norm[0], norm[1], 1e-5)
    return out.numpy(), weights.detach().numpy()


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------- helpers

class ServerTestCase(unittest.TestCase):
    """Shared helpers; subclasses set cls.server, cls.stub, cls.models."""

    def attend(self, model="demo", **fields):
        return self.stub.Attend(pb.AttendRequest(model=model, **fields), timeout=RPC_TIMEOUT)

    def assert_rpc_error(self, code, details_part, request, exact=False):
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.Attend(request, timeout=RPC_TIMEOUT)
        error = caught.exception
        self.assertEqual(error.code(), code, f"details: {error.details()}")
        if exact:
            self.assertEqual(error.details(), details_part)
        else:
            self.assertIn(details_part, error.details())
        return error

    def assert_close(self, actual, expected, tol=TOL, rtol=None, what="output"):
        self.assertEqual(tuple(actual.shape), tuple(expected.shape), what)
        np.testing.assert_allclose(actual, expected, rtol=tol if rtol is None else rtol,
                                   atol=tol, err_msg=what)

    def check_against_torch(self, model, response, query, per_head=False, need_weights=False,
                            **masks):
        """Compares an FP32 response with torch; masks: key, value, key_padding_mask,
        attn_mask, is_causal."""
        ref_out, ref_w = reference(self.models[model], query, per_head=per_head, **masks)
        self.assertEqual(response.model, model)
        self.assertEqual(response.output.dtype, cfg.DATA_TYPE_FP32)
        self.assert_close(to_numpy(response.output), ref_out)
        if need_weights:
            self.assertEqual(response.attn_weights.dtype, cfg.DATA_TYPE_FP32)
            self.assert_close(to_numpy(response.attn_weights), ref_w, what="attn_weights")
        else:
            self.assertFalse(response.HasField("attn_weights"))


def request_fields(query, key=None, value=None, key_padding_mask=None, attn_mask=None,
                   **flags):
    """AttendRequest fields for numpy inputs (FP32 or BOOL tensors)."""
    fields = {"query": tensor(pb, cfg, query)}
    for name, array in (("key", key), ("value", value), ("key_padding_mask", key_padding_mask),
                        ("attn_mask", attn_mask)):
        if array is not None:
            fields[name] = tensor(pb, cfg, array)
    fields.update(flags)
    return fields


# ----------------------------------------------------------------- shared server

class FourModelServerTest(ServerTestCase, OneServerPerClass):
    """A server on the four-model repository (demo, cross, post, broken),
    its mha.v1 stub, and a generator seeded by each test's name."""

    @classmethod
    def make_repository(cls, folder):
        return make_repository(folder)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.stub = cls.server.stub(cls.channel)

    def setUp(self):
        self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))


class SharedServerTest(FourModelServerTest):
    """Attend's semantics and refusals."""

    def test_ready_line_names_every_model(self):
        self.assertIn("models=broken(failed),cross,demo,post", self.server.ready_line)

    # --- 1. self-attention ------------------------------------------------

    def test_self_attention_matches_torch(self):
        query = randn(self.rng, 2, 7, DEMO_E)
        response = self.attend(**request_fields(query))
        self.assertEqual(list(response.output.shape), [2, 7, DEMO_E])
        self.check_against_torch("demo", response, query)

    def test_unbatched_query_gives_unbatched_output(self):
        query = randn(self.rng, 5, DEMO_E)
        response = self.attend(**request_fields(query, need_weights=True))
        self.assertEqual(list(response.output.shape), [5, DEMO_E])
        self.assertEqual(list(response.attn_weights.shape), [5, 5])
        self.check_against_torch("demo", response, query, need_weights=True)

    def test_attention_weights_averaged_and_per_head(self):
        query = randn(self.rng, 2, 6, DEMO_E)
        averaged = self.attend(**request_fields(query, need_weights=True))
        self.assertEqual(list(averaged.attn_weights.shape), [2, 6, 6])
        self.check_against_torch("demo", averaged, query, need_weights=True)
        per_head = self.attend(**request_fields(query, need_weights=True, per_head_weights=True))
        self.assertEqual(list(per_head.attn_weights.shape), [2, DEMO_H, 6, 6])
        self.check_against_torch("demo", per_head, query, need_weights=True, per_head=True)
        # per_head_weights alone asks for nothing.
        plain = self.attend(**request_fields(query, per_head_weights=True))
        self.assertFalse(plain.HasField("attn_weights"))

    def test_fp16_and_bf16_queries_answer_in_their_dtype(self):
        query = randn(self.rng, 2, 5, DEMO_E)
        for dtype, rtol, atol in ((cfg.DATA_TYPE_FP16, 2e-3, 1e-3),
                                  (cfg.DATA_TYPE_BF16, 1.6e-2, 1e-2)):
            with self.subTest(dtype=cfg.DataType.Name(dtype)):
                wire = half_tensor(pb, cfg, query, dtype)
                response = self.attend(query=wire, need_weights=True)
                self.assertEqual(response.output.dtype, dtype)
                self.assertEqual(len(response.output.data), 2 * 5 * DEMO_E * 2)
                self.assertEqual(response.attn_weights.dtype, cfg.DATA_TYPE_FP32)
                # The reference sees the query the server saw (rounded).
                rounded = from_wire(cfg, wire)
                ref_out, ref_w = reference(self.models["demo"], rounded)
                self.assert_close(from_wire(cfg, response.output), ref_out, tol=atol, rtol=rtol)
                self.assert_close(to_numpy(response.attn_weights), ref_w, what="attn_weights")

    def test_large_requests_in_many_slices_match_torch(self):
        # 1 MiB and more arrive in many of gRPC's slices: the server reads
        # Attend around them (proto/wire/) and converts FP16 and BF16 across
        # the slices' edges; the masks and key are gathered the same way.
        query = randn(self.rng, 4, 256, DEMO_E)
        mask = self.rng.random((4, 256)) < 0.2
        mask[:, 0] = False
        response = self.attend(**request_fields(query, key_padding_mask=mask, need_weights=True))
        self.check_against_torch("demo", response, query, need_weights=True,
                                 key_padding_mask=mask)
        for dtype, rtol, atol in ((cfg.DATA_TYPE_FP16, 2e-3, 1e-3),
                                  (cfg.DATA_TYPE_BF16, 1.6e-2, 1e-2)):
            with self.subTest(dtype=cfg.DataType.Name(dtype)):
                wire = half_tensor(pb, cfg, query, dtype)
                response = self.attend(query=wire)
                self.assertEqual(response.output.dtype, dtype)
                ref_out, _ = reference(self.models["demo"], from_wire(cfg, wire))
                self.assert_close(from_wire(cfg, response.output), ref_out, tol=atol, rtol=rtol)

    def test_malformed_messages_are_invalid_argument_then_a_good_request(self):
        # Bytes protobuf refuses (a truncated field, a string that is not
        # UTF-8) are refused with INVALID_ARGUMENT by Attend and ModelInfer
        # alike (before they were read around their tensors, gRPC answered
        # UNIMPLEMENTED with no message).
        channel = grpc.insecure_channel(self.server.target())
        try:
            for method, name in (("/mha.v1.AttentionService/Attend", "AttendRequest"),
                                 ("/inference.GRPCInferenceService/ModelInfer",
                                  "ModelInferRequest")):
                call = channel.unary_unary(method)
                for body in (b"\x0a\xff", b"\x12\x05\x01", b"\x0a\x02\xc3\x28"):
                    with self.subTest(method=method, body=body):
                        with self.assertRaises(grpc.RpcError) as caught:
                            call(body, timeout=RPC_TIMEOUT)
                        self.assertEqual(caught.exception.code(), INVALID)
                        self.assertIn(f"{name}: not a valid protobuf message",
                                      caught.exception.details())
        finally:
            channel.close()
        query = randn(self.rng, 1, 3, DEMO_E)
        self.check_against_torch("demo", self.attend(**request_fields(query)), query)

    def test_stream_answers_malformed_and_large_messages_in_place(self):
        # Stream's messages are read around their tensors too: bytes that do
        # not parse are one answer's INVALID_ARGUMENT (the stream goes on);
        # a large attend in many slices equals the unary call's answer.
        query = randn(self.rng, 4, 256, DEMO_E)
        attend = pb.AttendRequest(model="demo", **request_fields(query, need_weights=True))
        message = pb.StreamRequest(id="large", attend=attend).SerializeToString()
        call = grpc.insecure_channel(self.server.target()).stream_stream(
            "/mha.v1.AttentionService/Stream", request_serializer=lambda b: b,
            response_deserializer=pb.StreamResponse.FromString)
        answers = {a.id: a for a in call(iter([b"\x0a\xff", message]), timeout=RPC_TIMEOUT)}
        self.assertEqual(sorted(answers), ["", "large"])
        self.assertEqual(answers[""].code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertIn("StreamRequest: not a valid protobuf message", answers[""].error_message)
        self.assertEqual(answers["large"].code, 0)
        unary = self.attend(**request_fields(query, need_weights=True))
        self.assertEqual(answers["large"].attend.output.data, unary.output.data)
        self.assertEqual(answers["large"].attend.attn_weights.data, unary.attn_weights.data)

    def test_post_norm_model(self):
        query = randn(self.rng, 3, 4, POST_E)
        response = self.attend("post", **request_fields(query, need_weights=True))
        self.check_against_torch("post", response, query, need_weights=True)

    # --- 2. cross-attention -----------------------------------------------

    def test_cross_attention_with_other_key_length(self):
        query = randn(self.rng, 2, 3, CROSS_E)
        key, value = randn(self.rng, 2, 5, CROSS_KDIM), randn(self.rng, 2, 5, CROSS_VDIM)
        response = self.attend("cross", **request_fields(query, key, value, need_weights=True))
        self.assertEqual(list(response.output.shape), [2, 3, CROSS_E])
        self.assertEqual(list(response.attn_weights.shape), [2, 3, 5])
        self.check_against_torch("cross", response, query, need_weights=True, key=key,
                                 value=value)
        # Unbatched cross-attention too.
        response = self.attend("cross", **request_fields(query[0], key[0], value[0],
                                                         need_weights=True,
                                                         per_head_weights=True))
        self.assertEqual(list(response.attn_weights.shape), [CROSS_H, 3, 5])
        self.check_against_torch("cross", response, query[0], need_weights=True, per_head=True,
                                 key=key[0], value=value[0])

    def test_cross_key_without_value_when_kdim_differs_from_vdim(self):
        query, key = randn(self.rng, 1, 3, CROSS_E), randn(self.rng, 1, 4, CROSS_KDIM)
        self.assert_rpc_error(INVALID, "value: required, this model has kdim 16 != vdim 20",
                              pb.AttendRequest(model="cross", **request_fields(query, key)))

    def test_value_without_key(self):
        query, value = randn(self.rng, 1, 3, CROSS_E), randn(self.rng, 1, 4, CROSS_VDIM)
        error = self.assert_rpc_error(
            INVALID, "value", pb.AttendRequest(model="cross", **request_fields(query, value=value)))
        self.assertTrue(error.details().startswith("value:"), error.details())
        # Also on a self-attention model, where key = value = query would be possible.
        query = randn(self.rng, 1, 3, DEMO_E)
        self.assert_rpc_error(INVALID, "value: given without key",
                              pb.AttendRequest(model="demo", **request_fields(query, value=query)))

    def test_self_attention_on_cross_model_needs_a_key(self):
        query = randn(self.rng, 1, 3, CROSS_E)
        self.assert_rpc_error(INVALID, "key: required",
                              pb.AttendRequest(model="cross", **request_fields(query)))

    def test_key_without_value_means_value_is_key(self):
        query, key = randn(self.rng, 2, 3, DEMO_E), randn(self.rng, 2, 6, DEMO_E)
        response = self.attend(**request_fields(query, key, need_weights=True))
        self.check_against_torch("demo", response, query, need_weights=True, key=key, value=key)

    # --- 3. masks ---------------------------------------------------------

    def test_key_padding_mask_bool(self):
        query = randn(self.rng, 2, 6, DEMO_E)
        kpm = np.zeros((2, 6), dtype=bool)
        kpm[0, 4:] = True
        kpm[1, [0, 2]] = True
        response = self.attend(**request_fields(query, key_padding_mask=kpm, need_weights=True,
                                                per_head_weights=True))
        self.check_against_torch("demo", response, query, need_weights=True, per_head=True,
                                 key_padding_mask=kpm)
        weights = to_numpy(response.attn_weights)
        self.assertTrue(np.all(weights[0, :, :, 4:] == 0))
        self.assertTrue(np.all(weights[1, :, :, [0, 2]] == 0))

    def test_key_padding_mask_float_is_added(self):
        query = randn(self.rng, 2, 3, CROSS_E)
        key, value = randn(self.rng, 2, 5, CROSS_KDIM), randn(self.rng, 2, 5, CROSS_VDIM)
        kpm = (self.rng.uniform(-3, 1, (2, 5))).astype(np.float32)
        kpm[0, 1] = kpm[1, 4] = -np.inf  # allowed in float masks: masked out
        response = self.attend("cross", **request_fields(query, key, value, key_padding_mask=kpm,
                                                         need_weights=True))
        self.check_against_torch("cross", response, query, need_weights=True, key=key,
                                 value=value, key_padding_mask=kpm)
        # Unbatched: key_padding_mask [S].
        response = self.attend("cross", **request_fields(query[1], key[1], value[1],
                                                         key_padding_mask=kpm[1]))
        self.check_against_torch("cross", response, query[1], key=key[1], value=value[1],
                                 key_padding_mask=kpm[1])

    def test_attn_mask_shared_bool(self):
        # L != S so that a transposed mask cannot pass.
        query = randn(self.rng, 2, 4, CROSS_E)
        key, value = randn(self.rng, 2, 6, CROSS_KDIM), randn(self.rng, 2, 6, CROSS_VDIM)
        mask = self.rng.random((4, 6)) < 0.4
        mask[:, 1] = False  # no fully masked row here
        response = self.attend("cross", **request_fields(query, key, value, attn_mask=mask,
                                                         need_weights=True))
        self.check_against_torch("cross", response, query, need_weights=True, key=key,
                                 value=value, attn_mask=mask)

    def test_attn_mask_per_head_float(self):
        query = randn(self.rng, 2, 4, CROSS_E)
        key, value = randn(self.rng, 2, 6, CROSS_KDIM), randn(self.rng, 2, 6, CROSS_VDIM)
        mask = self.rng.uniform(-4, 2, (2 * CROSS_H, 4, 6)).astype(np.float32)
        response = self.attend("cross", **request_fields(query, key, value, attn_mask=mask,
                                                         need_weights=True,
                                                         per_head_weights=True))
        self.check_against_torch("cross", response, query, need_weights=True, per_head=True,
                                 key=key, value=value, attn_mask=mask)
        # And on the self-attention model: [B * h, L, L], bool.
        query = randn(self.rng, 2, 5, DEMO_E)
        mask = self.rng.random((2 * DEMO_H, 5, 5)) < 0.3
        mask[:, :, 0] = False
        response = self.attend(**request_fields(query, attn_mask=mask, need_weights=True,
                                                per_head_weights=True))
        self.check_against_torch("demo", response, query, need_weights=True, per_head=True,
                                 attn_mask=mask)

    def test_is_causal(self):
        query = randn(self.rng, 2, 6, DEMO_E)
        response = self.attend(**request_fields(query, is_causal=True, need_weights=True,
                                                per_head_weights=True))
        self.check_against_torch("demo", response, query, need_weights=True, per_head=True,
                                 is_causal=True)
        weights = to_numpy(response.attn_weights)
        self.assertTrue(np.all(np.triu(np.ones((6, 6)), 1)[None, None] * weights == 0))
        # Top-left aligned when S > L, on top of the other masks.
        query = randn(self.rng, 2, 4, CROSS_E)
        key, value = randn(self.rng, 2, 6, CROSS_KDIM), randn(self.rng, 2, 6, CROSS_VDIM)
        kpm = np.zeros((2, 6), dtype=bool)
        kpm[1, 1] = True
        mask = self.rng.uniform(-1, 1, (4, 6)).astype(np.float32)
        response = self.attend("cross", **request_fields(
            query, key, value, key_padding_mask=kpm, attn_mask=mask, is_causal=True,
            need_weights=True))
        self.check_against_torch("cross", response, query, need_weights=True, key=key,
                                 value=value, key_padding_mask=kpm, attn_mask=mask,
                                 is_causal=True)

    def test_fully_masked_rows_give_zero_weights_and_the_output_bias(self):
        module = self.models["cross"][0]
        bias = module.out_proj.bias.detach().numpy()
        self.assertGreater(np.abs(bias).max(), 0.01)
        query = randn(self.rng, 2, 3, CROSS_E)
        key, value = randn(self.rng, 2, 5, CROSS_KDIM), randn(self.rng, 2, 5, CROSS_VDIM)
        # Every key of batch 1 padded.
        kpm = np.zeros((2, 5), dtype=bool)
        kpm[1, :] = True
        response = self.attend("cross", **request_fields(query, key, value, key_padding_mask=kpm,
                                                         need_weights=True))
        out, weights = to_numpy(response.output), to_numpy(response.attn_weights)
        self.assertTrue(np.all(weights[1] == 0), weights[1])
        self.assert_close(out[1], np.broadcast_to(bias, (3, CROSS_E)), tol=1e-6)
        ref_out, ref_w = reference(self.models["cross"], query[:1], key=key[:1], value=value[:1])
        self.assert_close(out[:1], ref_out)
        self.assert_close(weights[:1], ref_w, what="attn_weights")
        # Query row 1 masked against every key by a [L, S] mask.
        mask = np.zeros((3, 5), dtype=bool)
        mask[1, :] = True
        response = self.attend("cross", **request_fields(query, key, value, attn_mask=mask,
                                                         need_weights=True))
        out, weights = to_numpy(response.output), to_numpy(response.attn_weights)
        self.assertTrue(np.all(weights[:, 1] == 0))
        self.assert_close(out[:, 1], np.broadcast_to(bias, (2, CROSS_E)), tol=1e-6)
        ref_out, ref_w = reference(self.models["cross"], query, key=key, value=value,
                                   attn_mask=mask)
        self.assert_close(out[:, [0, 2]], ref_out[:, [0, 2]])
        self.assert_close(weights[:, [0, 2]], ref_w[:, [0, 2]], what="attn_weights")

    # --- 4. errors --------------------------------------------------------

    def test_every_error_then_a_good_request(self):
        rng = self.rng
        q = randn(rng, 2, 4, DEMO_E)
        good = request_fields(q)
        fp32 = cfg.DATA_TYPE_FP32

        def raw(shape, nbytes, dtype=fp32):
            return pb.Tensor(dtype=dtype, shape=shape, data=b"\0" * nbytes)

        info = self.stub.GetModel(pb.GetModelRequest(name="broken"), timeout=RPC_TIMEOUT)
        nan_query = q.copy()
        nan_query[0, 1, 2] = np.nan
        inf_key = randn(rng, 2, 5, CROSS_KDIM)
        inf_key[1, 0, 0] = np.inf
        cq = randn(rng, 2, 4, CROSS_E)
        ck, cv = randn(rng, 2, 5, CROSS_KDIM), randn(rng, 2, 5, CROSS_VDIM)
        cases = [
            # (name, request, code, expected details part)
            ("unknown model", pb.AttendRequest(model="nosuch", **good), grpc.StatusCode.NOT_FOUND,
             "model 'nosuch' not found"),
            ("empty model name", pb.AttendRequest(**good), grpc.StatusCode.NOT_FOUND,
             "model '' not found"),
            ("broken model", pb.AttendRequest(model="broken", **good),
             grpc.StatusCode.FAILED_PRECONDITION, info.error),
            ("missing query", pb.AttendRequest(model="demo"), INVALID, "query: required"),
            ("rank 4 query", pb.AttendRequest(model="demo", query=tensor(pb, cfg, q[None])),
             INVALID, "query: expected rank 3 [B, L, E] or 2 [L, E], got shape [1, 2, 4, 256]"),
            ("rank 1 query", pb.AttendRequest(model="demo", query=tensor(pb, cfg, q[0, 0])),
             INVALID, "query: expected rank 3 [B, L, E] or 2 [L, E], got shape [256]"),
            ("rank 5 query", pb.AttendRequest(model="demo", query=raw([1, 1, 1, 2, 256], 2048)),
             INVALID, "query: expected 1 to 4 dimensions"),
            ("rank 0 query", pb.AttendRequest(model="demo", query=raw([], 4)),
             INVALID, "query: expected 1 to 4 dimensions"),
            ("last dimension", pb.AttendRequest(model="demo",
                                                query=tensor(pb, cfg, q[:1, :3, :255])),
             INVALID, "query: expected last dimension 256, got 255"),
            ("short data", pb.AttendRequest(model="demo", query=raw([1, 3, 256], 3 * 256 * 4 - 4)),
             INVALID, "query: data has 3068 bytes, expected 1 x 3 x 256 x 4 bytes"),
            ("long data", pb.AttendRequest(model="demo", query=raw([1, 3, 256], 3 * 256 * 4 + 4)),
             INVALID, "query: data has 3076 bytes"),
            ("fp16 data sized as fp32",
             pb.AttendRequest(model="demo", query=raw([1, 3, 256], 3 * 256 * 4,
                                                      cfg.DATA_TYPE_FP16)),
             INVALID, "expected 1 x 3 x 256 x 2 bytes"),
            ("huge shape, no data", pb.AttendRequest(model="demo", query=raw([1 << 40, 256], 0)),
             INVALID, "query: data has 0 bytes"),
            ("negative dimension", pb.AttendRequest(model="demo", query=raw([1, -3, 256], 3072)),
             INVALID, "query: negative dimension in shape [1, -3, 256]"),
            ("overflowing shape", pb.AttendRequest(model="demo",
                                                   query=raw([1 << 62, 4, 256], 4096)),
             INVALID, "overflows int64"),
            ("unknown dtype", pb.AttendRequest(model="demo", query=raw([1, 1, 256], 1024, 99)),
             INVALID, "query: dtype 99 is not one of"),
            ("unspecified dtype", pb.AttendRequest(model="demo",
                                                   query=raw([1, 1, 256], 1024, 0)),
             INVALID, "query: dtype DATA_TYPE_UNSPECIFIED is not one of DATA_TYPE_FP32, "
                      "DATA_TYPE_BF16, DATA_TYPE_FP16"),
            ("bool query", pb.AttendRequest(model="demo",
                                            query=tensor(pb, cfg, np.ones((1, 2, 256), bool))),
             INVALID, "query: dtype DATA_TYPE_BOOL"),
            ("key_padding_mask shape", pb.AttendRequest(
                model="demo", **request_fields(q, key_padding_mask=np.zeros((2, 5), bool))),
             INVALID, "key_padding_mask: expected shape [2, 4], got [2, 5]"),
            ("key_padding_mask rank", pb.AttendRequest(
                model="demo", **request_fields(q, key_padding_mask=np.zeros((4,), bool))),
             INVALID, "key_padding_mask: expected shape [2, 4], got [4]"),
            ("attn_mask shape", pb.AttendRequest(
                model="demo", **request_fields(q, attn_mask=np.zeros((4, 5), bool))),
             INVALID, "attn_mask: expected shape [4, 4] or [8, 4, 4], got [4, 5]"),
            ("attn_mask heads", pb.AttendRequest(
                model="demo", **request_fields(q, attn_mask=np.zeros((4, 4, 4), np.float32))),
             INVALID, "attn_mask: expected shape [4, 4] or [8, 4, 4], got [4, 4, 4]"),
            ("attn_mask fp16", pb.AttendRequest(
                model="demo", query=good["query"],
                attn_mask=half_tensor(pb, cfg, np.zeros((4, 4)), cfg.DATA_TYPE_FP16)),
             INVALID, "expected DATA_TYPE_BOOL or DATA_TYPE_FP32"),
            ("key_padding_mask bf16", pb.AttendRequest(
                model="demo", query=good["query"],
                key_padding_mask=half_tensor(pb, cfg, np.zeros((2, 4)), cfg.DATA_TYPE_BF16)),
             INVALID, "expected DATA_TYPE_BOOL or DATA_TYPE_FP32"),
            ("empty query", pb.AttendRequest(model="demo", query=raw([1, 0, 256], 0)),
             INVALID, "query: shape [1, 0, 256] has no tokens"),
            ("empty unbatched query", pb.AttendRequest(model="demo", query=raw([0, 256], 0)),
             INVALID, "query: shape [0, 256] has no tokens"),
            ("NaN in attn_mask", pb.AttendRequest(model="demo", **request_fields(
                q, attn_mask=np.array([[0, 0, 0, np.nan]] * 4, np.float32))),
             INVALID, "attn_mask: element 3 is nan, expected a finite number or -inf"),
            ("+inf in key_padding_mask", pb.AttendRequest(model="demo", **request_fields(
                q, key_padding_mask=np.array([[0, 0, 0, 0], [0, np.inf, 0, 0]], np.float32))),
             INVALID, "key_padding_mask: element 5 is inf"),
            ("NaN in query", pb.AttendRequest(model="demo", **request_fields(nan_query)),
             INVALID, "query: element 258 is nan, expected a finite number"),
            ("Inf in key", pb.AttendRequest(model="cross", **request_fields(cq, inf_key, cv)),
             INVALID, "key: element 80 is inf"),
            ("key batch", pb.AttendRequest(model="cross", **request_fields(cq, ck[:1], cv[:1])),
             INVALID, "key: expected batch size 2 (the query's), got 1"),
            ("key width", pb.AttendRequest(model="cross", **request_fields(
                cq, randn(rng, 2, 5, CROSS_VDIM), cv)),
             INVALID, "key: expected last dimension 16, got 20"),
            ("value length", pb.AttendRequest(model="cross", **request_fields(cq, ck, cv[:, :4])),
             INVALID, "value: expected shape [2, 5, 20], got [2, 4, 20]"),
            ("bool key", pb.AttendRequest(model="cross", query=tensor(pb, cfg, cq),
                                          key=tensor(pb, cfg, ck > 0), value=tensor(pb, cfg, cv)),
             INVALID, "key: dtype DATA_TYPE_BOOL"),
        ]
        for name, request, code, part in cases:
            with self.subTest(name):
                self.assert_rpc_error(code, part, request)
        self.assertIn("model 'broken' failed to load", info.error)
        self.assertIn("outside the data section", info.error)
        # The server still answers good requests correctly.
        self.check_against_torch("demo", self.attend(**good), q)
        response = self.attend("cross", **request_fields(cq, ck, cv))
        self.check_against_torch("cross", response, cq, key=ck, value=cv)

    def test_last_dimension_message_is_exact(self):
        query = randn(self.rng, 1, 3, 255)
        self.assert_rpc_error(INVALID, "query: expected last dimension 256, got 255",
                              pb.AttendRequest(model="demo", query=tensor(pb, cfg, query)),
                              exact=True)

    # --- 5. model listing -------------------------------------------------


if __name__ == "__main__":
    if not os.access(MHA_SERVER, os.X_OK):
        sys.exit(f"test_server.py: no executable server at {MHA_SERVER} (set MHA_SERVER)")
    unittest.main(verbosity=2)
