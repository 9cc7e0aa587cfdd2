#!/usr/bin/python3
"""Turns a PyTorch attention module into an mha-serve model folder
(config.pbtxt + weights.safetensors) and, with --verify, checks that the
server computes what the module computes.

  mha_export.py --module FILE.pt [--submodule PATH] [--attention self|cross]
      --out DIR [--name NAME] [--compute_dtype fp32|bf16|int8 | --bf16]
      [--rename CANONICAL=NAME ...] [--num_heads H] [--post_norm] [--canonical_names]
      [--verify [--server PATH_TO_mha_server]]

FILE.pt holds torch.save(module) (a whole module, not a state_dict; the
class of a custom module must be importable, e.g. through PYTHONPATH).
--submodule picks a part of it (e.g. encoder.layers.0). DIR becomes the
model folder; NAME (default: DIR's last component) is the model's name in
the file's metadata and when --verify serves it.

What is exported:
  nn.MultiheadAttention       itself: any kdim, vdim, bias, add_bias_kv,
                              add_zero_attn (batch_first or not: the server
                              is always batch_first)
  nn.TransformerEncoderLayer  self_attn; with norm_first=False also norm1 as
                              post_norm (output = norm1(x + attention(x)));
                              with norm_first=True the attention alone (the
                              caller applies norm1 to the query first)
  nn.TransformerDecoderLayer  --attention self: self_attn (+ norm1 if post-LN;
                              call it with is_causal=True as the decoder's
                              tgt_mask would); --attention cross:
                              multihead_attn (+ norm2), key = value = the
                              encoder's memory
  any other module            found by the canonical tensor names of its
                              state_dict (README, "Weight layouts"): q_proj,
                              k_proj, v_proj, out_proj as nn.Linear, or
                              q_proj.{i} ... per head (nn.ModuleList), and
                              optionally bias_k, bias_v; --post_norm adds the
                              LayerNorm `norm`. Other names are mapped with
                              --rename CANONICAL=NAME: a tensor or module name
                              prefix (out_proj=proj, q_proj=attn.query) or a
                              per-head pattern (q_proj.{i}=heads.{i}.q).
                              num_heads comes from the per-head lists, the
                              module's num_heads / n_heads / nhead / n_head
                              attribute, or --num_heads.

Tensors are written as F32 under the module's own names, with the config's
tensor_prefix / tensor_names saying which is which; --canonical_names writes
them under the canonical names instead. Missing biases of a module that has
some are written as zeros. --compute_dtype bf16 (or --bf16) sets
compute_dtype DATA_TYPE_BF16, --compute_dtype int8 DATA_TYPE_INT8 (int8
projections, quantized by the server at load; the weights stay F32).

--verify serves the folder with mha_server (--server, else $MHA_SERVER, else
mha_server on PATH, else build/mha_server of the checkout the package was
installed from) on free loopback ports, feeds the
module (eval mode, torch.inference_mode) and the server the same random
input and compares: max abs error <= 1e-5 (bf16: <= 2e-2 of max |output|;
int8: <= 2e-2 of max(1, max |output|)).
A custom module is called as forward(query, key, value), or forward(query)
if forward takes one input; a tuple result's first element is the output.
Exit code 0 when exported (and verified), 1 when verification fails, 2 on
an error.

From Python:
  from mha_export import export, verify
  exported = export(layer, "models/enc0")          # an Exported
  result = verify(exported, "build/mha_server")    # a Verification
"""

import argparse
import collections
import inspect
import os
import pickle
import re
import shutil
import sys
import tempfile

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mha_model_folder import Enum, write_model_folder  # noqa: E402

FP32_ABS_TOL = 1e-5
BF16_REL_TOL = 2e-2
INT8_REL_TOL = 2e-2
# compute_dtype values by --compute_dtype name.
COMPUTE_DTYPES = {"fp32": "DATA_TYPE_FP32", "bf16": "DATA_TYPE_BF16", "int8": "DATA_TYPE_INT8"}
DEFAULT_SERVER = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "..", "..", "build", "mha_server"))


_HEAD_ATTRIBUTES = ("num_heads", "n_heads", "nhead", "n_head")
_MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")

# (layout as the server names it, the canonical tensor that identifies it),
# in the order the server tries them.
_LAYOUTS = (("in_proj", "in_proj_weight"),
            ("separate_proj_weights", "q_proj_weight"),
            ("separate_linears", "q_proj.weight"),
            ("per_head_linears", "q_proj.0.weight"))


class ExportError(ValueError):
    """The module cannot be expressed as an mha-serve model (the message
    says why and, where it can, what to pass)."""


Exported = collections.namedtuple("Exported", [
    "out_dir", "name", "config", "tensor_names", "layout", "module", "mode", "reference"])
Exported.__doc__ = """What export() wrote. config: the config.pbtxt dict;
tensor_names: {canonical name: name in weights.safetensors}; layout: as
GetModel reports it; mode: "self" or "cross", the attention verify() runs;
reference(query, key, value): the module's output for batch-first torch
inputs (key = value = None for self-attention, value None for value = key)."""

Verification = collections.namedtuple("Verification", ["ok", "error", "tolerance", "mode"])


# ----------------------------------------------------------------- names

class Renames:
    """Canonical tensor name -> name in the module's state_dict: the first
    matching rule (most specific first), else prefix + canonical name.
    A rule maps a canonical name or name prefix ("out_proj", "q_proj.weight")
    or a per-head pattern ("q_proj.{i}") to the module's name ("proj",
    "heads.{i}.q"); the rest of the name (".weight") is kept."""

    def __init__(self, prefix="", rules=()):
        self.prefix = prefix
        self._rules = []
        for canonical, target in sorted(rules, key=lambda r: -len(r[0])):
            if canonical.count("{i}") != target.count("{i}") or canonical.count("{i}") > 1:
                raise ExportError(f"rename {canonical}={target}: use {{i}} once on both sides or not at all")
            pattern = re.escape(canonical).replace(re.escape("{i}"), r"(?P<i>\d+)")
            self._rules.append((re.compile(f"^{pattern}(?P<rest>\\..*)?$"), target))

    def __call__(self, canonical):
        for regex, target in self._rules:
            match = regex.match(canonical)
            if match:
                head = target.replace("{i}", match.group("i")) if "{i}" in target else target
                return head + (match.group("rest") or "")
        return self.prefix + canonical


def parse_rename(text):
    """"canonical=name" -> (canonical, name)."""
    canonical, sep, target = text.partition("=")
    if not sep or not canonical or not target:
        raise ExportError(f"rename '{text}': expected CANONICAL=NAME, e.g. q_proj=query")
    return canonical.strip(), target.strip()


# ----------------------------------------------------------------- finding the attention

_Target = collections.namedtuple("_Target", [
    "state", "names", "norm", "num_heads", "add_zero_attn", "reference", "mode"])


def _mha_reference(mha, norm):
    """The output of mha (and the post-norm) on batch-first inputs."""
    def run(query, key=None, value=None):
        key = query if key is None else key
        value = key if value is None else value
        q, k, v = (query, key, value) if mha.batch_first else (
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
        out = mha(q, k, v, need_weights=False)[0]
        out = out if mha.batch_first else out.transpose(0, 1)
        return norm(query + out) if norm is not None else out
    return run


def _custom_reference(module):
    inputs = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]

    def run(query, key=None, value=None):
        if len(inputs) == 1:
            if key is not None:
                raise ExportError("the module's forward takes one input: self-attention only")
            out = module(query)
        else:
            key = query if key is None else key
            out = module(query, key, key if value is None else value)
        return out[0] if isinstance(out, (tuple, list)) else out
    return run, len(inputs) == 1


def _locate(module, attention, rename, num_heads, post_norm):
    """Where the attention's tensors are in `module` and how to run it."""
    if attention not in (None, "self", "cross"):
        raise ExportError(f"attention must be 'self' or 'cross', got {attention!r}")
    builtin = isinstance(module, (nn.MultiheadAttention, nn.TransformerEncoderLayer,
                                  nn.TransformerDecoderLayer))
    if builtin and (rename or num_heads or post_norm):
        raise ExportError(f"rename, num_heads and post_norm are for custom modules; "
                          f"{type(module).__name__} is exported as it is")
    state = module.state_dict()
    if isinstance(module, nn.MultiheadAttention):
        mha, norm, prefix, norm_name = module, None, "", None
        mode = attention or ("self" if module._qkv_same_embed_dim else "cross")
    elif isinstance(module, nn.TransformerEncoderLayer):
        if attention == "cross":
            raise ExportError("a TransformerEncoderLayer has self-attention only")
        mha, prefix, mode = module.self_attn, "self_attn.", "self"
        norm, norm_name = (None, None) if module.norm_first else (module.norm1, "norm1")
    elif isinstance(module, nn.TransformerDecoderLayer):
        if attention is None:
            raise ExportError("a TransformerDecoderLayer has two attentions: "
                              "choose attention 'self' (self_attn) or 'cross' (multihead_attn)")
        if attention == "self":
            mha, prefix, norm_name = module.self_attn, "self_attn.", "norm1"
        else:
            mha, prefix, norm_name = module.multihead_attn, "multihead_attn.", "norm2"
        norm = None if module.norm_first else getattr(module, norm_name)
        norm_name = None if norm is None else norm_name
        mode = attention
    else:
        names = Renames("", rename)
        norm = None
        if post_norm:
            path = names("norm.weight").rsplit(".", 1)[0]
            try:
                norm = module.get_submodule(path)
            except AttributeError:
                raise ExportError(f"post_norm: the module has no submodule '{path}' "
                                  f"(map it with rename norm=NAME)") from None
            if not isinstance(norm, nn.LayerNorm):
                raise ExportError(f"post_norm: '{path}' is a {type(norm).__name__}, not a LayerNorm")
        reference, self_only = _custom_reference(module)
        mode = attention or ("self" if self_only else None)
        heads = num_heads or next((getattr(module, a) for a in _HEAD_ATTRIBUTES
                                   if isinstance(getattr(module, a, None), int)), None)
        return _Target(state, names, norm, heads,
                       bool(getattr(module, "add_zero_attn", False)), reference, mode)
    rules = [("norm", norm_name)] if norm_name else []
    return _Target(state, Renames(prefix, rules), norm, mha.num_heads, mha.add_zero_attn,
                   _mha_reference(mha, norm), mode)


# ----------------------------------------------------------------- export

def export(module, out_dir, attention=None, name=None, bf16=False, rename=(), num_heads=None,
           post_norm=False, canonical_names=False, compute_dtype=None):
    """Writes out_dir/config.pbtxt and out_dir/weights.safetensors for the
    attention of `module` (see the module docstring for what is supported)
    and returns an Exported. rename: (canonical, name) pairs or
    "canonical=name" strings. compute_dtype: "fp32", "bf16" or "int8"
    (default: "bf16" when bf16, else "fp32"). Raises ExportError if the
    module does not fit. Does not change the module."""
    compute_dtype = compute_dtype or ("bf16" if bf16 else "fp32")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ExportError(f"compute_dtype {compute_dtype!r} is not one of "
                          f"{', '.join(COMPUTE_DTYPES)}")
    rename = [parse_rename(r) if isinstance(r, str) else tuple(r) for r in rename]
    target = _locate(module, attention, rename, num_heads, post_norm)
    names, state = target.names, target.state

    def has(canonical):
        return names(canonical) in state

    def get(canonical):
        return state[names(canonical)].detach().to("cpu", torch.float32).numpy()

    layout = next((layout for layout, c in _LAYOUTS if has(c)), None)
    if layout is None or not has("out_proj.weight"):
        looked_for = ", ".join(names(c) for c in [c for _, c in _LAYOUTS] + ["out_proj.weight"])
        raise ExportError(f"no attention weights found: looked for {looked_for} in the "
                          f"state_dict; map the module's names with rename, e.g. q_proj=query")

    tensors = collections.OrderedDict()  # canonical name -> float32 array
    w_out = get("out_proj.weight")
    embed_dim, v_width = w_out.shape
    heads = target.num_heads
    if layout == "per_head_linears":
        heads = 0
        while has(f"q_proj.{heads}.weight"):
            heads += 1
    if not heads:
        raise ExportError("cannot tell the number of heads: the module has no "
                          f"{'/'.join(_HEAD_ATTRIBUTES)} attribute; pass num_heads")
    if layout == "in_proj":
        tensors["in_proj_weight"] = get("in_proj_weight")
        qk_width = (tensors["in_proj_weight"].shape[0] - v_width) // 2
        kdim = vdim = tensors["in_proj_weight"].shape[1]
        in_biases = {"in_proj_bias": [2 * qk_width + v_width]}
    elif layout in ("separate_proj_weights", "separate_linears"):
        weight = "{}_proj_weight" if layout == "separate_proj_weights" else "{}_proj.weight"
        for x in "qkv":
            tensors[weight.format(x)] = get(weight.format(x))
        qk_width, kdim = tensors[weight.format("k")].shape
        vdim = tensors[weight.format("v")].shape[1]
        if layout == "separate_proj_weights":  # biases as nn.MultiheadAttention keeps them
            in_biases = {"in_proj_bias": [2 * qk_width + v_width]}
        else:
            in_biases = {f"{x}_proj.bias": [tensors[weight.format(x)].shape[0]] for x in "qkv"}
    else:
        in_biases = {}
        for x in "qkv":
            for i in range(heads):
                tensors[f"{x}_proj.{i}.weight"] = get(f"{x}_proj.{i}.weight")
                in_biases[f"{x}_proj.{i}.bias"] = [tensors[f"{x}_proj.{i}.weight"].shape[0]]
        qk_width, kdim = heads * tensors["k_proj.0.weight"].shape[0], tensors["k_proj.0.weight"].shape[1]
        vdim = tensors["v_proj.0.weight"].shape[1]
    tensors["out_proj.weight"] = w_out
    if qk_width % heads or v_width % heads:
        raise ExportError(f"{heads} heads do not divide the projection widths "
                          f"(q/k {qk_width}, v {v_width})")

    # Biases: all or none in the config; a module with some gets zeros for the rest.
    biases = dict(in_biases, **{"out_proj.bias": [embed_dim]})
    bias = any(has(b) for b in biases)
    if bias:
        for b, shape in biases.items():
            tensors[b] = get(b) if has(b) else np.zeros(shape, np.float32)
    if has("bias_k") != has("bias_v"):
        raise ExportError("the module has only one of bias_k, bias_v")
    add_bias_kv = has("bias_k")
    if add_bias_kv:
        tensors["bias_k"], tensors["bias_v"] = get("bias_k"), get("bias_v")
    if target.norm is not None:
        if tuple(target.norm.normalized_shape) != (embed_dim,):
            raise ExportError(f"post_norm: LayerNorm over {tuple(target.norm.normalized_shape)}, "
                              f"expected ({embed_dim},)")
        affine = target.norm.elementwise_affine
        tensors["norm.weight"] = get("norm.weight") if affine else np.ones(embed_dim, np.float32)
        tensors["norm.bias"] = get("norm.bias") if affine else np.zeros(embed_dim, np.float32)

    config = {"embed_dim": embed_dim, "num_heads": heads}
    if kdim != embed_dim:
        config["kdim"] = kdim
    if vdim != embed_dim:
        config["vdim"] = vdim
    if qk_width != embed_dim:
        config["qk_head_dim"] = qk_width // heads
    if v_width != embed_dim:
        config["v_head_dim"] = v_width // heads
    if not bias:
        config["bias"] = False
    if add_bias_kv:
        config["add_bias_kv"] = True
    if target.add_zero_attn:
        config["add_zero_attn"] = True
    config["compute_dtype"] = Enum(COMPUTE_DTYPES[compute_dtype])
    if target.norm is not None:
        config["post_norm"] = {"eps": float(target.norm.eps)}
    if canonical_names:
        file_names = {c: c for c in tensors}
    else:
        file_names = {c: names(c) for c in tensors}
        if names.prefix:
            config["tensor_prefix"] = names.prefix
        mapped = [{"key": c, "value": f} for c, f in file_names.items() if f != names.prefix + c]
        if mapped:
            config["tensor_names"] = mapped

    mode = target.mode or ("self" if kdim == vdim == embed_dim else "cross")
    if mode == "self" and not kdim == vdim == embed_dim:
        raise ExportError(f"self-attention needs kdim == vdim == embed_dim ({embed_dim}); "
                          f"got kdim {kdim}, vdim {vdim}: use attention 'cross'")
    name = name or os.path.basename(os.path.normpath(out_dir))
    metadata = {"format": "pt", "name": name, "exported_from": type(module).__name__,
                "attention": mode}
    write_model_folder(out_dir, config,
                       {file_names[c]: (a, "F32") for c, a in tensors.items()}, metadata)
    return Exported(out_dir, name, config, file_names, layout, module, mode, target.reference)


# ----------------------------------------------------------------- verify

def verify(exported, server_binary=DEFAULT_SERVER, batch=2, query_len=7, key_len=5, seed=0):
    """Serves exported.out_dir with mha_server and compares one random
    request's output with the module's (eval mode, torch.inference_mode);
    returns a Verification(ok, error, tolerance, mode). grpc.RpcError if the
    server rejects the request; RuntimeError if it does not start."""
    from mha_local_server import LocalServer
    from mha_client import MhaClient

    config, module = exported.config, exported.module
    embed_dim = config["embed_dim"]
    kdim, vdim = config.get("kdim", embed_dim), config.get("vdim", embed_dim)
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, query_len, embed_dim, generator=gen)
    key = value = None
    if exported.mode == "cross":
        key = torch.randn(batch, key_len, kdim, generator=gen)
        # Cross-attention of a decoder layer reads one memory as key and value.
        if kdim != vdim or not isinstance(module, nn.TransformerDecoderLayer):
            value = torch.randn(batch, key_len, vdim, generator=gen)

    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    training = module.training
    module.eval()
    try:
        with torch.inference_mode():
            cast = [None if t is None else t.to(dtype) for t in (query, key, value)]
            expected = exported.reference(*cast).float().numpy()
    finally:
        module.train(training)

    name = exported.name if _MODEL_NAME.fullmatch(exported.name) else "model"
    repository = tempfile.mkdtemp(prefix="mha_export_verify_")
    server = LocalServer(server_binary, repository)
    try:
        os.symlink(os.path.abspath(exported.out_dir), os.path.join(repository, name))
        with server, MhaClient(server.target(), timeout=60) as client:
            got, _ = client.attend(name, query.numpy(),
                                   None if key is None else key.numpy(),
                                   None if value is None else value.numpy())
    finally:
        server.remove_log()
        shutil.rmtree(repository, ignore_errors=True)
    error = float(np.abs(got.astype(np.float64) - expected).max())
    compute = str(config.get("compute_dtype"))
    scale = float(np.abs(expected).max())
    tolerance = {"DATA_TYPE_BF16": BF16_REL_TOL * scale,
                 "DATA_TYPE_INT8": INT8_REL_TOL * max(1.0, scale)}.get(compute, FP32_ABS_TOL)
    return Verification(error <= tolerance, error, tolerance, exported.mode)


# ----------------------------------------------------------------- command line

def _describe(exported):
    c = exported.config
    dims = ", ".join(f"{k} {v}" for k, v in c.items()
                     if k not in ("tensor_prefix", "tensor_names", "post_norm"))
    norm = f", post_norm eps {c['post_norm']['eps']}" if "post_norm" in c else ""
    return (f"wrote {exported.out_dir}: {type(exported.module).__name__} -> layout "
            f"{exported.layout}, {dims}{norm}; {len(exported.tensor_names)} tensors")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", required=True, help="torch.save(module) file")
    p.add_argument("--submodule", help="export this part of the module, e.g. encoder.layers.0")
    p.add_argument("--attention", choices=("self", "cross"))
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--name", help="model name (default: the folder's name)")
    p.add_argument("--compute_dtype", choices=tuple(COMPUTE_DTYPES),
                   help="what the server computes in (default fp32; int8: int8 projections)")
    p.add_argument("--bf16", action="store_true", help="the same as --compute_dtype bf16")
    p.add_argument("--rename", nargs="+", action="append", default=[], metavar="CANONICAL=NAME")
    p.add_argument("--num_heads", type=int)
    p.add_argument("--post_norm", action="store_true", help="custom modules: LayerNorm `norm`")
    p.add_argument("--canonical_names", action="store_true",
                   help="write tensors under canonical names (no tensor_prefix/tensor_names)")
    p.add_argument("--verify", action="store_true", help="serve the folder and compare")
    p.add_argument("--server", help="mha_server for --verify (default: $MHA_SERVER, then "
                   "mha_server on PATH, then the build of the checkout this was installed from)")
    args = p.parse_args(argv)
    if args.verify:
        from mha_local_server import find_server
        server, tried = find_server(DEFAULT_SERVER, given=args.server)
        if server is None:
            print("mha_export: --verify needs mha_server, and none of these is an executable "
                  f"file: {', '.join(tried)}; build it (bash deploy/debian/build.sh), put it on "
                  "PATH or pass --server PATH; nothing was written", file=sys.stderr)
            return 2
        args.server = server
    try:
        try:
            module = torch.load(args.module, map_location="cpu")
        except (ImportError, AttributeError) as e:
            raise ExportError(
                f"{args.module}: {e}: the module's class must be importable here, as when it "
                "was saved: put the folder of its .py file on PYTHONPATH (PYTHONPATH=DIR "
                "python3 mha_export.py ...) or run from that folder") from e
        if not isinstance(module, nn.Module):
            raise ExportError(f"{args.module} holds no module (it holds {type(module).__name__}): "
                              "save it with torch.save(module), or call export() from Python")
        if args.submodule:
            module = module.get_submodule(args.submodule)
        exported = export(module, args.out, attention=args.attention, name=args.name,
                          bf16=args.bf16, compute_dtype=args.compute_dtype,
                          rename=[r for group in args.rename for r in group],
                          num_heads=args.num_heads, post_norm=args.post_norm,
                          canonical_names=args.canonical_names)
    except (ExportError, OSError, AttributeError, ImportError, RuntimeError,
            pickle.UnpicklingError) as e:
        print(f"mha_export: {e}", file=sys.stderr)
        return 2
    print(_describe(exported))
    if not args.verify:
        return 0
    try:
        result = verify(exported, args.server)
    except Exception as e:  # the server's status or a failed start, reported as such
        print(f"mha_export: verify: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"verify: {result.mode}-attention on model {exported.name}: max abs error "
          f"{result.error:.3g} (tolerance {result.tolerance:.3g}) "
          f"{'OK' if result.ok else 'FAILED'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
