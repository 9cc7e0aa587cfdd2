"""The configurations exercised by parity.py.

A Case fixes everything about one run: model config, weight layout and
storage, input shapes, masks and mha_run flags. The first len(FIXED_CASES)
cases are hand-picked so that every feature is hit at least once whatever
the seed; later ones are random but deterministic per (seed, index).
"""

import dataclasses
import random

# (embed_dim, num_heads): small and odd shapes, incl. one head and head_dim 3.
# (256, 4) is the demo model's shape, large enough for blocked kernels.
HEAD_SHAPES = [(24, 3), (8, 1), (32, 4), (64, 8), (20, 5), (18, 6), (12, 2),
               (48, 3), (256, 4)]


@dataclasses.dataclass
class Case:
    id: int = 0
    E: int = 24
    h: int = 3
    kdim: int = 24             # feature size of the key input
    vdim: int = 24             # feature size of the value input
    dk: int = 0                # qk_head_dim; 0 = E / h
    dv: int = 0                # v_head_dim;  0 = E / h
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    compute: str = "FP32"      # FP32 | BF16 | INT8
    norm_eps: float = None     # None = no post-norm
    write_eps: bool = True     # False: `post_norm {}` (eps defaults to 1e-5)
    layout: str = "sd"         # sd (-> in_proj / qkv_proj) | linear | per_head
    wdtype: str = "F32"        # storage dtype: F32 | F16 | BF16 | mixed
    prefix: str = ""           # tensor_prefix
    rename: bool = False       # remap some tensors through tensor_names
    explicit: bool = False     # spell out default-valued config fields
    batch: int = 2             # 0 = unbatched 2-D inputs
    L: int = 4
    S: int = 4
    mode: str = "self"         # self (no key) | cross | key_only (no value)
    kpm: str = None            # key_padding_mask: None | bool | float
    attn_mask: str = None      # None | 2d-bool | 2d-float | 3d-bool | 3d-float
    full_rows: bool = False    # force query rows whose keys are all masked
    causal: bool = False       # --is_causal
    weights: str = None        # None | avg (--need_weights) | head (+ per-head)


# Each entry documents what it adds; together they cover every option.
FIXED_CASES = [
    # 0: baseline PyTorch state_dict (packed in_proj_weight), self-attention.
    dict(weights="avg"),
    # 1: one head, L = S = 1, batch 1, cross-attention.
    dict(E=8, h=1, mode="cross", kdim=8, vdim=8, batch=1, L=1, S=1,
         weights="head"),
    # 2: kdim/vdim != E -> state_dict with q/k/v_proj_weight; bool padding.
    dict(E=32, h=4, mode="cross", kdim=16, vdim=20, L=3, S=7, kpm="bool",
         weights="avg"),
    # 3: key without value (value = key), separate linears, 2-D bool mask.
    dict(mode="key_only", kdim=12, vdim=12, L=5, S=6, batch=3,
         layout="linear", attn_mask="2d-bool"),
    # 4: unbatched self-attention, bool padding + 3-D float mask.
    dict(E=32, h=4, batch=0, L=6, S=6, kpm="bool", attn_mask="3d-float",
         weights="head"),
    # 5: bias=False, add_bias_kv, float padding mask, one linear per head.
    dict(E=20, h=5, bias=False, add_bias_kv=True, mode="cross", kdim=20,
         vdim=20, L=4, S=5, kpm="float", layout="per_head", weights="head"),
    # 6: add_zero_attn, 3-D bool mask, --is_causal, batch 3.
    dict(add_zero_attn=True, attn_mask="3d-bool", causal=True, batch=3,
         L=5, S=5, weights="head"),
    # 7: bias_kv + zero_attn with fully masked keys (extra keys stay visible).
    dict(add_bias_kv=True, add_zero_attn=True, mode="cross", L=3, S=6,
         kpm="bool", attn_mask="2d-float", full_rows=True, weights="avg"),
    # 8: fully masked rows (padding + 2-D bool) followed by post-norm.
    dict(mode="cross", L=4, S=5, kpm="bool", attn_mask="2d-bool",
         full_rows=True, norm_eps=1e-5, weights="head"),
    # 9: causal with L < S.
    dict(mode="cross", L=3, S=6, causal=True, weights="avg"),
    # 10: causal with L > S; padding of key 0 fully masks query row 0.
    dict(mode="cross", L=6, S=3, causal=True, kpm="bool", full_rows=True,
         weights="head"),
    # 11: post-norm eps 1e-3, F16 weights, float padding mask.
    dict(norm_eps=1e-3, wdtype="F16", kpm="float", L=5, S=5),
    # 12: BF16 weights, separate linears, tensor_prefix (+ decoy tensors).
    dict(wdtype="BF16", layout="linear", prefix="encoder.layers.0.self_attn.",
         mode="cross", L=4, S=6, kpm="bool"),
    # 13: one linear per head, tensor_names remapping, kdim = vdim = 16.
    dict(layout="per_head", rename=True, mode="cross", kdim=16, vdim=16,
         L=2, S=5, weights="avg"),
    # 14: einsum variant dk=5, dv=7 (h*d != E), separate linears, bias_kv.
    dict(dk=5, dv=7, layout="linear", add_bias_kv=True, kpm="bool",
         mode="cross", kdim=10, vdim=14, L=4, S=6, weights="head"),
    # 15: einsum per-head dk=4, dv=12, zero_attn, 3-D float mask, post_norm {}.
    dict(E=32, h=4, dk=4, dv=12, layout="per_head", add_zero_attn=True,
         attn_mask="3d-float", norm_eps=1e-5, write_eps=False, L=3, S=3,
         weights="head"),
    # 16: compute_dtype BF16, E=64 h=8, batch 4, causal self-attention.
    dict(E=64, h=8, compute="BF16", batch=4, L=9, S=9, causal=True,
         weights="avg"),
    # 17: BF16 compute + post-norm + F16 weights + kdim 40 + masked rows.
    dict(compute="BF16", norm_eps=1e-5, mode="cross", kdim=40, vdim=24,
         wdtype="F16", kpm="bool", full_rows=True, L=4, S=5, weights="head"),
    # 18: unbatched key-only, causal, padding + 2-D bool, bias_kv, masked rows.
    dict(batch=0, mode="key_only", kdim=8, vdim=8, causal=True, kpm="bool",
         attn_mask="2d-bool", full_rows=True, add_bias_kv=True, L=5, S=4,
         weights="head"),
    # 19: mixed storage dtypes, q/k/v_proj_weight, prefix, bias=False, norm.
    dict(wdtype="mixed", mode="cross", kdim=12, vdim=24, prefix="model.attn.",
         bias=False, norm_eps=1e-5, L=3, S=4, weights="avg"),
    # 20: E=18 h=6 (head_dim 3), L = S = 1, batch 4, 2-D float mask.
    dict(E=18, h=6, batch=4, L=1, S=1, attn_mask="2d-float", weights="avg"),
    # 21: rows fully masked by -inf in float masks; unbatched, einsum, BF16.
    dict(batch=0, dk=6, dv=6, layout="linear", compute="BF16", mode="cross",
         L=4, S=5, kpm="float", attn_mask="3d-float", full_rows=True,
         weights="head"),
    # 22: bias=False packed in_proj, zero_attn, unbatched 2-D float mask,
    #     default-valued fields spelled out (kdim: 24, compute_dtype FP32).
    dict(bias=False, add_zero_attn=True, batch=0, L=3, S=3,
         attn_mask="2d-float", explicit=True, weights="avg"),
    # 23: separate linears, bool padding + 3-D bool mask + causal, batch 2,
    #     fully masked rows from padding of a whole sequence.
    dict(layout="linear", mode="cross", kdim=24, vdim=16, L=5, S=7,
         kpm="bool", attn_mask="3d-bool", causal=True, full_rows=True,
         weights="avg"),
    # 24: >= 512 keys and no weights: the key-tiled online-softmax path
    #     (two uneven row blocks), with both masks, causal, zero_attn and
    #     fully masked rows.
    dict(E=64, h=4, batch=1, L=700, S=700, add_zero_attn=True, kpm="bool",
         attn_mask="3d-float", causal=True, full_rows=True),
    # 25: the key-tiled path in BF16 for cross-attention with other widths,
    #     bias_kv and a float padding mask.
    dict(E=32, h=4, batch=2, mode="cross", kdim=40, vdim=20, L=96, S=1100,
         compute="BF16", add_bias_kv=True, kpm="float", attn_mask="2d-bool"),
    # 26: compute_dtype INT8 (int8 projections): the demo model's shape, self-
    #     attention, padding + causal, post-norm, averaged weights.
    dict(E=256, h=4, compute="INT8", batch=3, L=40, S=40, kpm="bool",
         causal=True, norm_eps=1e-5, weights="avg"),
    # 27: INT8 cross-attention with other widths, one linear per head,
    #     bias_kv + zero_attn, float padding, 3-D float mask, masked rows.
    dict(E=32, h=4, compute="INT8", mode="cross", kdim=40, vdim=20, L=6, S=9,
         layout="per_head", add_bias_kv=True, add_zero_attn=True,
         kpm="float", attn_mask="3d-float", full_rows=True, weights="head"),
    # 28: INT8 over the key-tiled path, key-only, bias=False, F16 weights.
    dict(E=64, h=4, compute="INT8", mode="key_only", kdim=48, vdim=48,
         batch=1, L=96, S=900, bias=False, wdtype="F16", attn_mask="2d-bool"),
    # 29: BF16 attention in one pass (AVX512-BF16 without AMX: sequences from
    #     32 rows, heads of 32): two row blocks a head, bool padding with
    #     fully masked rows, causal, a 3-D float mask, post-norm.
    dict(E=128, h=4, compute="BF16", batch=2, L=70, S=70, kpm="bool",
         attn_mask="3d-float", causal=True, full_rows=True, norm_eps=1e-5),
]


def make_case(index, seed):
    """Case number `index`: hand-picked for the first few, else random."""
    if index < len(FIXED_CASES):
        case = Case(id=index, **FIXED_CASES[index])
    else:
        case = _random_case(index, random.Random(f"{seed}:{index}"))
    return _make_consistent(case)


def _random_case(index, r):
    c = Case(id=index)
    c.E, c.h = r.choice(HEAD_SHAPES)
    if r.random() < 0.2:  # einsum variant
        c.dk, c.dv = r.choice([2, 3, 5, 8, 12]), r.choice([2, 4, 7, 8, 16])
    c.mode = r.choice(["self", "self", "cross", "cross", "key_only"])
    c.kdim = r.choice([c.E, c.E, 8, 16, 40])
    c.vdim = r.choice([c.E, c.E, 12, 20])
    c.batch = r.choice([0, 1, 2, 3, 4])
    c.L = r.choice([1, 2, 3, 5, 8, 13, 33])
    c.S = r.choice([1, 2, 4, 7, 16, 64])
    c.bias = r.random() < 0.8
    c.add_bias_kv, c.add_zero_attn = r.random() < 0.3, r.random() < 0.3
    c.compute = r.choices(["FP32", "BF16", "INT8"], [0.6, 0.25, 0.15])[0]
    c.norm_eps = r.choice([None, None, 1e-5, 1e-3])
    c.write_eps = r.random() < 0.8
    c.layout = r.choice(["sd", "sd", "linear", "per_head"])
    c.wdtype = r.choice(["F32", "F32", "F16", "BF16", "mixed"])
    naming = r.choice(["plain", "plain", "prefix", "rename"])
    c.prefix = "layers.3.attn." if naming == "prefix" else ""
    c.rename = naming == "rename"
    c.explicit = r.random() < 0.2
    c.kpm = r.choice([None, None, "bool", "float"])
    c.attn_mask = r.choice([None, None, "2d-bool", "2d-float", "3d-bool",
                            "3d-float"])
    c.full_rows = r.random() < 0.2
    c.causal = r.random() < 0.25
    c.weights = r.choice([None, "avg", "head"])
    return c


def _make_consistent(c):
    """Resolve choices that constrain each other."""
    if c.mode == "self":        # key = value = query
        c.kdim = c.vdim = c.E
        c.S = c.L
    elif c.mode == "key_only":  # value = key
        c.vdim = c.kdim
    if c.dk or c.dv:            # einsum variant: no packed PyTorch layouts
        c.dk, c.dv = c.dk or c.dv, c.dv or c.dk
        if c.layout == "sd":
            c.layout = "linear"
    if c.layout == "sd":
        c.layout = "in_proj" if c.kdim == c.vdim == c.E else "qkv_proj"
    if c.norm_eps is None:
        c.write_eps = True
    elif not c.write_eps:       # `post_norm {}`: eps takes its default
        c.norm_eps = 1e-5
    if c.full_rows and not (c.kpm or c.attn_mask):
        c.kpm = "bool"
    return c


def describe(c):
    """Short one-line summary of a case."""
    parts = [f"E{c.E}h{c.h}", f"B{c.batch}" if c.batch else "unbatched",
             f"L{c.L}S{c.S}", c.mode]
    if c.mode != "self" and (c.kdim != c.E or c.vdim != c.E):
        parts.append(f"kd{c.kdim}vd{c.vdim}")
    if c.dk:
        parts.append(f"einsum{c.dk}/{c.dv}")
    parts.append(c.layout)
    flags = [("nobias", not c.bias), ("bias_kv", c.add_bias_kv),
             ("zero_attn", c.add_zero_attn), ("causal", c.causal),
             ("fullrows", c.full_rows), ("prefix", bool(c.prefix)),
             ("rename", c.rename), ("explicit", c.explicit)]
    parts += [name for name, on in flags if on]
    if c.kpm:
        parts.append(f"kpm-{c.kpm}")
    if c.attn_mask:
        parts.append(f"am{c.attn_mask}")
    if c.norm_eps is not None:
        parts.append(f"norm{c.norm_eps:g}" if c.write_eps else "norm{}")
    if c.weights:
        parts.append(f"w-{c.weights}")
    if c.wdtype != "F32":
        parts.append(f"w{c.wdtype}")
    if c.compute != "FP32":
        parts.append("c" + c.compute)
    return " ".join(parts)
