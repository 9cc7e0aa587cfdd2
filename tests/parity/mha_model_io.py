"""File formats and weight layouts shared by the parity test, the server
tests and the demo-model writer.

* safetensors reading/writing without the `safetensors` package, rounding
  of float32 values to a storage dtype, config.pbtxt formatting: moved to
  client/python/mha_model_folder.py and re-exported from here;
* the weight layouts mha_run understands, as conversions between a
  "canonical" parameter dict and named tensors.

Canonical parameters (numpy float32, nn.Linear convention y = x W^T + b):
  wq [h*dk, E], wk [h*dk, kdim], wv [h*dv, vdim], wo [E, h*dv],
  bq, bk, bv, bo (None when bias=False), bias_k [1,1,h*dk] and
  bias_v [1,1,h*dv] (None unless add_bias_kv), norm_w, norm_b [E]
  (None unless post-norm).
"""

import os
import sys

import numpy as np

# The file formats live with the Python client (client/python/mha_model_folder.py),
# which mha_export.py uses too; they are re-exported here for the tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "client", "python"))
from mha_model_folder import (Enum, decode_tensor, encode_tensor,  # noqa: E402,F401
                          format_pbtxt, read_safetensors, round_to_dtype,
                          write_safetensors)


# ----------------------------------------------------------------- layouts
#
# "in_proj":  nn.MultiheadAttention state_dict with a packed in_proj_weight.
# "qkv_proj": nn.MultiheadAttention state_dict when kdim/vdim != embed_dim
#             (q_proj_weight, k_proj_weight, v_proj_weight + in_proj_bias).
# "linear":   separate nn.Linear modules q_proj, k_proj, v_proj, out_proj.
# "per_head": one nn.Linear per head: q_proj.{i}, k_proj.{i}, v_proj.{i}.

LAYOUTS = ("in_proj", "qkv_proj", "linear", "per_head")


def params_to_tensors(p, layout, num_heads):
    """{canonical tensor name: float32 array} for the given layout."""
    t = {}
    has_bias = p["bq"] is not None
    if layout == "in_proj":
        t["in_proj_weight"] = np.concatenate([p["wq"], p["wk"], p["wv"]])
    elif layout == "qkv_proj":
        t["q_proj_weight"], t["k_proj_weight"] = p["wq"], p["wk"]
        t["v_proj_weight"] = p["wv"]
    if layout in ("in_proj", "qkv_proj") and has_bias:
        t["in_proj_bias"] = np.concatenate([p["bq"], p["bk"], p["bv"]])
    if layout == "linear":
        for x in "qkv":
            t[f"{x}_proj.weight"] = p[f"w{x}"]
            if has_bias:
                t[f"{x}_proj.bias"] = p[f"b{x}"]
    if layout == "per_head":
        t.update(_split_heads(p, num_heads, has_bias))
    t["out_proj.weight"] = p["wo"]
    if has_bias:
        t["out_proj.bias"] = p["bo"]
    _copy_optional(p, t, [("bias_k", "bias_k"), ("bias_v", "bias_v"),
                          ("norm_w", "norm.weight"), ("norm_b", "norm.bias")])
    return t


def tensors_to_params(t, layout, num_heads):
    """Inverse of params_to_tensors (used to get the canonical parameters
    back after rounding each stored tensor to its storage dtype)."""
    p = dict.fromkeys(["bq", "bk", "bv", "bo", "bias_k", "bias_v",
                       "norm_w", "norm_b"])
    if layout == "in_proj":
        p["wq"], p["wk"], p["wv"] = np.split(t["in_proj_weight"], 3)
    elif layout == "qkv_proj":
        p["wq"], p["wk"] = t["q_proj_weight"], t["k_proj_weight"]
        p["wv"] = t["v_proj_weight"]
    if "in_proj_bias" in t:
        # q and k outputs have the same width; v's may differ in general.
        dqk = p["wq"].shape[0]
        b = t["in_proj_bias"]
        p["bq"], p["bk"], p["bv"] = b[:dqk], b[dqk:2 * dqk], b[2 * dqk:]
    for x in "qkv":
        if layout == "linear":
            p[f"w{x}"] = t[f"{x}_proj.weight"]
            p[f"b{x}"] = t.get(f"{x}_proj.bias")
        elif layout == "per_head":
            heads = range(num_heads)
            p[f"w{x}"] = np.concatenate([t[f"{x}_proj.{i}.weight"] for i in heads])
            if f"{x}_proj.0.bias" in t:
                p[f"b{x}"] = np.concatenate([t[f"{x}_proj.{i}.bias"] for i in heads])
    p["wo"], p["bo"] = t["out_proj.weight"], t.get("out_proj.bias")
    _copy_optional(t, p, [("bias_k", "bias_k"), ("bias_v", "bias_v"),
                          ("norm.weight", "norm_w"), ("norm.bias", "norm_b")])
    return p


def _split_heads(p, num_heads, has_bias):
    t = {}
    for x in "qkv":
        weights = np.split(p[f"w{x}"], num_heads)
        biases = np.split(p[f"b{x}"], num_heads) if has_bias else None
        for i in range(num_heads):
            t[f"{x}_proj.{i}.weight"] = weights[i]
            if has_bias:
                t[f"{x}_proj.{i}.bias"] = biases[i]
    return t


def _copy_optional(src, dst, name_pairs):
    for src_name, dst_name in name_pairs:
        if src.get(src_name) is not None:
            dst[dst_name] = src[src_name]
