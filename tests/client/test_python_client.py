#!/usr/bin/python3
"""The Python client (client/python) against a real mha_server:

* example.py as a subprocess (exit code, the lines it prints);
* MhaClient: self- and cross-attention, masks, is_causal, attention weights
  and float16 against torch.nn.MultiheadAttention (<= 1e-5 in fp32), errors,
  TLS with a bearer token;
* mha_export: nn.MultiheadAttention (kdim/vdim, bias_kv, zero_attn), a
  post-LN TransformerEncoderLayer, a TransformerDecoderLayer's
  cross-attention, custom modules with separate q/k/v linears and with
  per-head ModuleLists, each exported, served and matched against the module;
  the command line with --verify.

One server serves every model of the test; each test compares with a
reference it computes from the module itself.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/client/test_python_client.py
"""

import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))  # the shared harness
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_test_server import MHA_SERVER, REPO_ROOT, TestServer  # noqa: E402  (puts client/python on sys.path)
from make_demo_model import demo_module  # noqa: E402
from mha_client import MhaClient  # noqa: E402
from mha_export import ExportError, Renames, export  # noqa: E402
from mha_model_folder import read_safetensors  # noqa: E402

CLIENT_DIR = os.path.join(REPO_ROOT, "client", "python")
FP32_TOL = 1e-5
BF16_REL_TOL = 2e-2


# ----------------------------------------------------------------- modules

def randomize(module, seed):
    """Random biases and LayerNorm affines: PyTorch initialises them to 0 and
    1, which would hide a bias or norm that is dropped or mixed up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") or "norm" in name:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + torch.rand(p.shape, generator=gen) - 0.5)
    return module.eval()


def attend(q, k, v):
    """softmax(q k^T / sqrt(d)) v over the last two dimensions."""
    return (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v


class SeparateLinears(nn.Module):
    """Cross-attention with its own names (query, key, value, proj), q/k
    heads of 12 and v heads of 20, and no output bias."""

    def __init__(self, embed_dim=64, heads=4, kdim=40, vdim=24, qk_width=48, v_width=80):
        super().__init__()
        self.h = heads  # not a name the exporter knows: num_heads is passed
        self.query = nn.Linear(embed_dim, qk_width)
        self.key = nn.Linear(kdim, qk_width)
        self.value = nn.Linear(vdim, v_width)
        self.proj = nn.Linear(v_width, embed_dim, bias=False)

    def forward(self, query, key, value):
        def split(x):
            b, t, w = x.shape
            return x.view(b, t, self.h, w // self.h).transpose(1, 2)
        out = attend(split(self.query(query)), split(self.key(key)), split(self.value(value)))
        b, h, length, d = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, length, h * d))


class PerHeadLists(nn.Module):
    """Self-attention with one nn.Linear per head in ModuleLists under the
    canonical names, and a post-norm."""

    def __init__(self, embed_dim=48, heads=3, head_dim=16):
        super().__init__()
        for x in "qkv":
            setattr(self, f"{x}_proj", nn.ModuleList(
                nn.Linear(embed_dim, head_dim) for _ in range(heads)))
        self.out_proj = nn.Linear(heads * head_dim, embed_dim)
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        heads = [attend(q(x), k(x), v(x)) for q, k, v in zip(self.q_proj, self.k_proj, self.v_proj)]
        return self.norm(x + self.out_proj(torch.cat(heads, -1)))


class Head(nn.Module):
    def __init__(self, embed_dim, head_dim):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(embed_dim, head_dim) for _ in range(3))


class HeadModules(nn.Module):
    """Self-attention as a ModuleList of heads, each with its q, k, v."""

    def __init__(self, embed_dim=32, heads=2, head_dim=8):
        super().__init__()
        self.heads = nn.ModuleList(Head(embed_dim, head_dim) for _ in range(heads))
        self.mix = nn.Linear(heads * head_dim, embed_dim)

    def forward(self, x):
        return self.mix(torch.cat([attend(h.q(x), h.k(x), h.v(x)) for h in self.heads], -1))


HEAD_MODULE_RENAMES = ["q_proj.{i}=heads.{i}.q", "k_proj.{i}=heads.{i}.k",
                       "v_proj.{i}=heads.{i}.v", "out_proj=mix"]


def build_modules():
    torch.manual_seed(0)
    return {
        "demo": demo_module().eval(),
        "mha_kv": randomize(nn.MultiheadAttention(64, 4, kdim=40, vdim=24, add_bias_kv=True,
                                                  add_zero_attn=True, batch_first=True), 1),
        "encoder": randomize(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True,
                                                        layer_norm_eps=1e-6), 2),
        "decoder_cross": randomize(nn.TransformerDecoderLayer(64, 4, 128), 3),  # seq-first
        "linears": randomize(SeparateLinears(), 4),
        "per_head": randomize(PerHeadLists(), 5),
        "head_modules": randomize(HeadModules(), 6),
    }


# ----------------------------------------------------------------- fixture

modules = server = client = repo = None


def setUpModule():
    global modules, server, client, repo
    modules = build_modules()
    repo = tempfile.mkdtemp(prefix="mha_python_client_")
    shutil.copytree(os.path.join(REPO_ROOT, "models", "demo"), os.path.join(repo, "demo"))
    folder = lambda name: os.path.join(repo, name)  # noqa: E731
    export(modules["mha_kv"], folder("mha_kv"))
    export(modules["encoder"], folder("encoder"))
    export(modules["decoder_cross"], folder("decoder_cross"), attention="cross")
    export(modules["linears"], folder("linears"), num_heads=4,
           rename=["q_proj=query", "k_proj=key", "v_proj=value", "out_proj=proj"])
    export(modules["per_head"], folder("per_head"), post_norm=True)
    export(modules["head_modules"], folder("head_modules"), rename=HEAD_MODULE_RENAMES,
           canonical_names=True)
    export(modules["demo"], folder("demo_bf16"), bf16=True)
    export(modules["demo"], folder("demo_int8"), compute_dtype="int8")
    server = TestServer(MHA_SERVER, repo)
    server.start()
    client = MhaClient(server.target(), timeout=60)


def tearDownModule():
    client.close()
    server.stop()
    server.remove_log()
    shutil.rmtree(repo, ignore_errors=True)


def torch_mha(m, q, k=None, v=None, **kwargs):
    """(output, weights) of nn.MultiheadAttention m (batch_first) as numpy."""
    t = [None if a is None else torch.from_numpy(np.asarray(a, np.float32)) for a in (q, k, v)]
    k_, v_ = (t[0], t[0]) if t[1] is None else (t[1], t[2] if t[2] is not None else t[1])
    with torch.inference_mode():
        out, w = m(t[0], k_, v_, **kwargs)
    return out.numpy(), None if w is None else w.numpy()


def run_module(fn, *arrays):
    with torch.inference_mode():
        return fn(*[torch.from_numpy(a) for a in arrays]).numpy()


def max_error(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


# ----------------------------------------------------------------- example.py

class ExampleTest(unittest.TestCase):
    def run_example(self, target):
        return subprocess.run([sys.executable, os.path.join(CLIENT_DIR, "example.py"),
                               "--target", target, "--timeout", "30"],
                              capture_output=True, text=True, timeout=120)

    def test_example_runs_against_the_server(self):
        r = self.run_example(server.target())
        self.assertEqual(r.returncode, 0, r.stderr)
        for line in ["models:",
                     "  demo  STATE_READY  E=256 h=4 kdim=256 vdim=256 layout=in_proj",
                     "  mha_kv  STATE_READY  E=64 h=4 kdim=40 vdim=24 layout=separate_proj_weights",
                     "self-attention on demo: query (2, 16, 256) -> output (2, 16, 256) float32, "
                     "weights (2, 16, 16)",
                     "cross-attention on demo: query (2, 8, 256), key (2, 24, 256), value "
                     "(2, 24, 256) -> output (2, 8, 256) float32, per-head weights (2, 4, 8, 24)",
                     "  weight on padded keys: 0.0"]:
            self.assertIn(line + "\n", r.stdout)
        self.assertIn("float16 cross-attention on demo: output (2, 8, 256) float16", r.stdout)
        self.assertIn("decoder layer on demo, token by token: self session at position 10, "
                      "cross session over 20 memory tokens\n", r.stdout)
        diff = re.search(r"max \|step by step - whole sequence\| = (\S+)", r.stdout)
        self.assertIsNotNone(diff, r.stdout)
        self.assertLess(float(diff.group(1)), 1e-4)

    def test_example_reports_an_unreachable_server(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        r = self.run_example(f"127.0.0.1:{port}")
        self.assertEqual(r.returncode, 1)
        self.assertIn("example: UNAVAILABLE", r.stderr)

    def test_generate_stubs_script_writes_the_three_modules(self):
        out = tempfile.mkdtemp(prefix="mha_gen_")
        try:
            subprocess.run([os.path.join(CLIENT_DIR, "generate_stubs.sh"), out], check=True,
                           timeout=60)
            for f in ("model_config_pb2.py", "attention_pb2.py", "attention_pb2_grpc.py"):
                self.assertTrue(os.path.isfile(os.path.join(out, "mha", "v1", f)), f)
        finally:
            shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------------- MhaClient

class ClientTest(unittest.TestCase):
    def test_list_and_get_model(self):
        names = {m.name for m in client.list_models()}
        self.assertEqual(names, {"demo", "demo_bf16", "demo_int8", "mha_kv", "encoder", "decoder_cross",
                                 "linears", "per_head", "head_modules"})
        info = client.get_model("mha_kv")
        self.assertEqual((info.embed_dim, info.num_heads, info.kdim, info.vdim), (64, 4, 40, 24))
        self.assertTrue(info.config.add_bias_kv and info.config.add_zero_attn)

    def test_self_attention_with_weights(self):
        q = randn(2, 16, 256, seed=1)
        out, w = client.attend("demo", q, need_weights=True)
        ref, ref_w = torch_mha(modules["demo"], q, need_weights=True)
        self.assertEqual((out.dtype, out.shape, w.shape), (np.float32, (2, 16, 256), (2, 16, 16)))
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        self.assertLessEqual(max_error(w, ref_w), FP32_TOL)
        self.assertIsNone(client.attend("demo", q)[1])

    def test_per_head_weights_and_unbatched_query(self):
        q = randn(5, 256, seed=2)
        out, w = client.attend("demo", q, need_weights=True, per_head_weights=True)
        ref, ref_w = torch_mha(modules["demo"], q[None], need_weights=True,
                               average_attn_weights=False)
        self.assertEqual(out.shape, (5, 256))
        self.assertLessEqual(max_error(out, ref[0]), FP32_TOL)
        self.assertLessEqual(max_error(w.reshape(ref_w.shape), ref_w), FP32_TOL)

    def test_cross_attention_with_masks(self):
        q, k, v = randn(2, 5, 64, seed=3), randn(2, 7, 40, seed=4), randn(2, 7, 24, seed=5)
        padding = np.zeros((2, 7), bool)
        padding[1, 4:] = True
        attn_mask = randn(5, 7, seed=6)
        out, w = client.attend("mha_kv", q, k, v, key_padding_mask=padding, attn_mask=attn_mask,
                               need_weights=True, per_head_weights=True)
        ref, ref_w = torch_mha(modules["mha_kv"], q, k, v,
                               key_padding_mask=torch.from_numpy(padding),
                               attn_mask=torch.from_numpy(attn_mask), average_attn_weights=False)
        self.assertEqual(w.shape, (2, 4, 5, 9))  # 7 keys + bias_kv + zero_attn
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        self.assertLessEqual(max_error(w, ref_w), FP32_TOL)

    def test_per_head_bool_attn_mask_and_float_padding_mask(self):
        q, k = randn(2, 4, 256, seed=7), randn(2, 6, 256, seed=8)
        attn_mask = np.random.default_rng(9).random((2 * 4, 4, 6)) < 0.3
        attn_mask[:, :, 0] = False  # no fully masked rows (PyTorch 1.13 gives NaN there)
        out, _ = client.attend("demo", q, k, attn_mask=attn_mask)
        ref, _ = torch_mha(modules["demo"], q, k, attn_mask=torch.from_numpy(attn_mask))
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        padding = np.zeros((2, 6), np.float32)
        padding[0, 3:] = -np.inf
        padding[1, :2] = -1.5
        out, _ = client.attend("demo", q, k, key_padding_mask=padding)
        ref, _ = torch_mha(modules["demo"], q, k, key_padding_mask=torch.from_numpy(padding))
        self.assertLessEqual(max_error(out, ref), FP32_TOL)

    def test_is_causal(self):
        q = randn(1, 6, 256, seed=10)
        out, _ = client.attend("demo", q, is_causal=True)
        causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
        ref, _ = torch_mha(modules["demo"], q, attn_mask=causal)
        self.assertLessEqual(max_error(out, ref), FP32_TOL)

    def test_integer_masks_are_refused_bool_and_float_masks_mean_what_torch_means(self):
        q, k = randn(1, 3, 256, seed=12), randn(1, 5, 256, seed=13)
        pad = np.array([[0, 0, 0, 1, 1]])
        for integer in (pad.astype(np.uint8), pad.astype(np.int64)):
            with self.assertRaises(TypeError) as e:
                client.attend("demo", q, k, key_padding_mask=integer)
            self.assertIn("key_padding_mask: cannot send a", str(e.exception))
            self.assertIn("use bool", str(e.exception))
            with self.assertRaises(TypeError):
                client.attend("demo", q, k, attn_mask=np.zeros((3, 5), np.int32))
        out, _ = client.attend("demo", q, k, key_padding_mask=pad.astype(bool))
        ref, _ = torch_mha(modules["demo"], q, k,
                           key_padding_mask=torch.from_numpy(pad.astype(bool)))
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        additive = np.where(pad, -np.inf, 0.0)  # float64, as numpy makes it
        out64, _ = client.attend("demo", q, k, key_padding_mask=additive)
        self.assertLessEqual(max_error(out64, ref), FP32_TOL)

    def test_float16_in_float16_out_and_float64_in_float64_out(self):
        q = randn(2, 3, 256, seed=11).astype(np.float16)
        out, _ = client.attend("demo", q)
        self.assertEqual((out.dtype, out.shape), (np.float16, (2, 3, 256)))
        ref, _ = torch_mha(modules["demo"], q.astype(np.float32))
        self.assertLessEqual(max_error(out, ref), 1e-3)
        out64, _ = client.attend("demo", q.astype(np.float64))
        self.assertEqual(out64.dtype, np.float64)  # computed in float32
        self.assertLessEqual(max_error(out64, ref), FP32_TOL)

    def test_errors_are_grpc_errors(self):
        with self.assertRaises(grpc.RpcError) as e:
            client.attend("nope", randn(1, 2, 256))
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as e:
            client.attend("demo", randn(1, 2, 255))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("query: expected last dimension 256, got 255", e.exception.details())
        with self.assertRaises(grpc.RpcError) as e:
            client.get_model("nope")
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaisesRegex(TypeError, r"int32 tensor: use float32, float64 or "
                                    r"float16 \(bool only for masks\)"):
            client.attend("demo", np.zeros((1, 2, 256), np.int32))


class SecuredServerTest(unittest.TestCase):
    def test_tls_and_bearer_token(self):
        from test_security import make_certificates
        d = tempfile.mkdtemp(prefix="mha_python_tls_")
        try:
            make_certificates(d)
            path = lambda name: os.path.join(d, name)  # noqa: E731
            with open(path("token"), "w") as f:
                f.write("python-client-token\n")
            flags = [f"--tls_cert={path('server.pem')}", f"--tls_key={path('server.key')}",
                     f"--auth_token_file={path('token')}"]
            with TestServer(MHA_SERVER, repo, flags) as secured:
                q = randn(1, 3, 256, seed=12)
                with MhaClient(secured.target(), timeout=30, ca=path("ca.pem"),
                               token="python-client-token") as c:
                    out, _ = c.attend("demo", q)
                    self.assertLessEqual(max_error(out, torch_mha(modules["demo"], q)[0]), FP32_TOL)
                with MhaClient(secured.target(), timeout=30, ca=path("ca.pem")) as c:
                    with self.assertRaises(grpc.RpcError) as e:
                        c.list_models()
                    self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                with MhaClient(secured.target(), timeout=30, token="python-client-token") as c:
                    with self.assertRaises(grpc.RpcError) as e:  # plaintext to a TLS port
                        c.list_models()
                    self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            secured.remove_log()
        finally:
            shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------- mha_export

class ExportTest(unittest.TestCase):
    def test_multihead_attention_with_kdim_vdim_bias_kv_zero_attn(self):
        m = modules["mha_kv"]
        q, k, v = randn(3, 4, 64, seed=20), randn(3, 9, 40, seed=21), randn(3, 9, 24, seed=22)
        out, w = client.attend("mha_kv", q, k, v, need_weights=True)
        ref, ref_w = torch_mha(m, q, k, v)
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        self.assertLessEqual(max_error(w, ref_w), FP32_TOL)
        self.assertEqual(client.get_model("mha_kv").weight_layout, "separate_proj_weights")

    def test_post_ln_encoder_layer(self):
        layer = modules["encoder"]
        x = randn(2, 9, 64, seed=23)
        out, _ = client.attend("encoder", x)
        ref = run_module(lambda t: layer.norm1(t + layer.self_attn(t, t, t)[0]), x)
        self.assertLessEqual(max_error(out, ref), FP32_TOL)
        config = client.get_model("encoder").config
        self.assertAlmostEqual(config.post_norm.eps, 1e-6)
        self.assertEqual(config.tensor_prefix, "self_attn.")
        self.assertEqual(dict(config.tensor_names),
                         {"norm.weight": "norm1.weight", "norm.bias": "norm1.bias"})
        tensors, _ = read_safetensors(os.path.join(repo, "encoder", "weights.safetensors"))
        self.assertEqual(set(tensors), {"self_attn.in_proj_weight", "self_attn.in_proj_bias",
                                        "self_attn.out_proj.weight", "self_attn.out_proj.bias",
                                        "norm1.weight", "norm1.bias"})

    def test_decoder_layer_cross_attention(self):
        layer = modules["decoder_cross"]  # batch_first=False: the server is batch-first anyway
        x, memory = randn(2, 6, 64, seed=24), randn(2, 11, 64, seed=25)
        out, _ = client.attend("decoder_cross", x, memory)  # value = key = memory

        def block(t, mem):
            t, mem = t.transpose(0, 1), mem.transpose(0, 1)
            return layer.norm2(t + layer.multihead_attn(t, mem, mem)[0]).transpose(0, 1)
        self.assertLessEqual(max_error(out, run_module(block, x, memory)), FP32_TOL)
        self.assertEqual(client.get_model("decoder_cross").config.tensor_prefix, "multihead_attn.")

    def test_separate_linears_renamed(self):
        q, k, v = randn(2, 5, 64, seed=26), randn(2, 8, 40, seed=27), randn(2, 8, 24, seed=28)
        out, _ = client.attend("linears", q, k, v)
        self.assertLessEqual(max_error(out, run_module(modules["linears"], q, k, v)), FP32_TOL)
        info = client.get_model("linears")
        self.assertEqual(info.weight_layout, "separate_linears")
        self.assertEqual((info.config.qk_head_dim, info.config.v_head_dim), (12, 20))
        self.assertEqual(info.config.tensor_names["q_proj.weight"], "query.weight")
        tensors, _ = read_safetensors(os.path.join(repo, "linears", "weights.safetensors"))
        np.testing.assert_array_equal(tensors["proj.bias"], np.zeros(64, np.float32))

    def test_per_head_module_lists(self):
        x = randn(2, 7, 48, seed=29)
        out, _ = client.attend("per_head", x)
        self.assertLessEqual(max_error(out, run_module(modules["per_head"], x)), FP32_TOL)
        info = client.get_model("per_head")
        self.assertEqual((info.weight_layout, info.num_heads), ("per_head_linears", 3))
        self.assertAlmostEqual(info.config.post_norm.eps, 1e-6)

    def test_heads_as_modules_with_index_patterns_written_canonically(self):
        x = randn(3, 5, 32, seed=30)
        out, _ = client.attend("head_modules", x)
        self.assertLessEqual(max_error(out, run_module(modules["head_modules"], x)), FP32_TOL)
        self.assertEqual(len(client.get_model("head_modules").config.tensor_names), 0)
        tensors, _ = read_safetensors(os.path.join(repo, "head_modules", "weights.safetensors"))
        self.assertIn("k_proj.1.weight", tensors)
        self.assertIn("out_proj.bias", tensors)

    def test_bf16_compute(self):
        q = randn(2, 8, 256, seed=31)
        out, _ = client.attend("demo_bf16", q)
        ref, _ = torch_mha(modules["demo"], q)
        self.assertLessEqual(max_error(out, ref), BF16_REL_TOL * np.abs(ref).max())
        self.assertGreater(max_error(out, ref), 0)  # bf16 products round

    def test_int8_compute(self):
        """compute_dtype DATA_TYPE_INT8 as exported: within 2e-2 of the
        module relative to max(1, max |output|), the server quantizing the
        F32 weights it was given."""
        q = randn(2, 8, 256, seed=32)
        out, _ = client.attend("demo_int8", q)
        ref, _ = torch_mha(modules["demo"], q)
        self.assertLessEqual(max_error(out, ref), 2e-2 * max(1.0, np.abs(ref).max()))
        with open(os.path.join(repo, "demo_int8", "config.pbtxt")) as f:
            self.assertIn("compute_dtype: DATA_TYPE_INT8", f.read())
        with self.assertRaisesRegex(ExportError, "compute_dtype 'int4' is not one of"):
            export(modules["demo"], os.path.join(repo, "demo_int4"), compute_dtype="int4")

    def test_renames_and_errors(self):
        names = Renames("attn.", [("q_proj.{i}", "heads.{i}.q"), ("out_proj", "o"),
                                  ("norm", "ln")])
        self.assertEqual(names("q_proj.3.bias"), "heads.3.q.bias")
        self.assertEqual(names("out_proj.weight"), "o.weight")
        self.assertEqual(names("norm.bias"), "ln.bias")
        self.assertEqual(names("q_proj_weight"), "attn.q_proj_weight")
        out_dir = tempfile.mkdtemp(prefix="mha_export_err_")
        try:
            with self.assertRaisesRegex(ExportError, "no attention weights found"):
                export(nn.Linear(4, 4), out_dir)
            with self.assertRaisesRegex(ExportError, "choose attention"):
                export(nn.TransformerDecoderLayer(16, 2, 32), out_dir)
            with self.assertRaisesRegex(ExportError, "pass num_heads"):
                export(modules["linears"], out_dir, rename=["q_proj=query", "k_proj=key",
                                                            "v_proj=value", "out_proj=proj"])
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def test_command_line_export_and_verify(self):
        work = tempfile.mkdtemp(prefix="mha_export_cli_")
        try:
            path = os.path.join(work, "layer.pt")
            torch.save(randomize(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True), 7), path)
            out = os.path.join(work, "enc0")
            r = subprocess.run([sys.executable, os.path.join(CLIENT_DIR, "mha_export.py"),
                                "--module", path, "--out", out, "--verify", "--server", MHA_SERVER],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn(f"wrote {out}: TransformerEncoderLayer -> layout in_proj", r.stdout)
            self.assertRegex(r.stdout, r"verify: self-attention on model enc0: max abs error "
                                       r"\S+ \(tolerance 1e-05\) OK")
            with open(os.path.join(out, "config.pbtxt")) as f:
                self.assertIn("post_norm {\n  eps: 1e-05\n}\n", f.read())
            r = subprocess.run([sys.executable, os.path.join(CLIENT_DIR, "mha_export.py"),
                                "--module", path, "--out", out + "_int8", "--compute_dtype", "int8",
                                "--verify", "--server", MHA_SERVER],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertRegex(r.stdout, r"verify: self-attention on model enc0_int8: max abs "
                                       r"error \S+ \(tolerance \S+\) OK")

            torch.save(nn.TransformerDecoderLayer(32, 2, 64), path)
            r = subprocess.run([sys.executable, os.path.join(CLIENT_DIR, "mha_export.py"),
                                "--module", path, "--out", out], capture_output=True, text=True,
                               timeout=120)
            self.assertEqual(r.returncode, 2)
            self.assertIn("choose attention 'self' (self_attn) or 'cross'", r.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def test_command_line_mistakes_are_caught_before_anything_is_written(self):
        work = tempfile.mkdtemp(prefix="mha_export_cli_")
        self.addCleanup(shutil.rmtree, work, ignore_errors=True)
        export_script = os.path.join(CLIENT_DIR, "mha_export.py")
        self.assertTrue(os.access(export_script, os.X_OK), "mha_export.py has no run bit")
        path = os.path.join(work, "layer.pt")
        torch.save(nn.MultiheadAttention(16, 2, batch_first=True), path)
        out = os.path.join(work, "folder")
        r = subprocess.run([export_script, "--module", path, "--out", out, "--verify",
                            "--server", os.path.join(work, "no_server")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("--verify needs mha_server", r.stderr)
        self.assertFalse(os.path.exists(out))
        # A module whose class this process cannot import: a hint, not a trace.
        code = os.path.join(work, "code")
        os.makedirs(code)
        with open(os.path.join(code, "my_layers.py"), "w") as f:
            f.write("import torch\nclass MyAttention(torch.nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n"
                    "        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)\n")
        subprocess.run([sys.executable, "-c", "import torch, my_layers; "
                        f"torch.save(my_layers.MyAttention(), {path!r})"],
                       cwd=code, check=True, timeout=120)
        r = subprocess.run([sys.executable, export_script, "--module", path, "--out", out],
                           capture_output=True, text=True, timeout=120, cwd=work)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("No module named 'my_layers'", r.stderr)
        self.assertIn("put the folder of its .py file on PYTHONPATH", r.stderr)


if __name__ == "__main__":
    unittest.main()
