#!/usr/bin/python3
"""Checks the parity test's own machinery, without mha_run:

1. safetensors writer/reader round trip for every dtype used;
2. weight layouts: params -> named tensors -> params is the identity, and
   the weights.safetensors written for each case decodes to the parameters
   the reference uses (prefix, tensor_names, storage rounding);
3. mha_reference against torch.nn.MultiheadAttention (PyTorch 1.13) for
   every case PyTorch can express, with the all-masked-row rule applied;
4. mha_reference against a naive per-(batch, head, query) loop for every
   case, including the einsum variant PyTorch lacks.

  python3 tests/parity/self_test.py [--configs 200] [--seed 0]
"""

import argparse
import math
import os
import random
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mha_model_io import (params_to_tensors, read_safetensors,  # noqa: E402
                          round_to_dtype, tensors_to_params, write_safetensors)
from mha_reference import reference_mha  # noqa: E402
from parity import (expected_outputs, make_inputs, make_params,  # noqa: E402
                    write_model)
from parity_cases import describe, make_case  # noqa: E402

TOL = 1e-5  # fp32 torch vs fp64 reference


def check_safetensors_round_trip(tmp):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    mask = x > 0
    tensors = {"f32": (x, "F32"), "f16": (x, "F16"), "bf16": (x, "BF16"),
               "bool": (mask, "BOOL"), "scalar": (np.float32(2.5), "F32"),
               "empty": (np.zeros((0, 4), np.float32), "F32")}
    path = os.path.join(tmp, "t.safetensors")
    write_safetensors(path, tensors, metadata={"format": "pt"})
    back, dtypes = read_safetensors(path)
    assert dtypes == {n: d for n, (_, d) in tensors.items()}
    assert np.array_equal(back["f32"], x) and back["f32"].dtype == np.float32
    assert np.array_equal(back["f16"], x.astype(np.float16).astype(np.float32))
    bf16 = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(back["bf16"], bf16)
    assert np.array_equal(round_to_dtype(x, "BF16"), bf16)
    assert back["bool"].dtype == bool and np.array_equal(back["bool"], mask)
    assert back["scalar"].shape == () and back["scalar"] == 2.5
    assert back["empty"].shape == (0, 4)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert header_len % 8 == 0
    print("safetensors round trip: ok")


def check_layouts(case):
    p = make_params(case, torch.Generator().manual_seed(case.id))
    layouts = ["linear", "per_head"]
    if not case.dk:  # PyTorch state_dict layouts
        layouts.append("qkv_proj")
        if case.kdim == case.vdim == case.E:
            layouts.append("in_proj")
    for layout in layouts:
        back = tensors_to_params(params_to_tensors(p, layout, case.h),
                                 layout, case.h)
        for name, value in p.items():
            assert (value is None) == (back[name] is None), (layout, name)
            if value is not None:
                assert np.array_equal(value, back[name]), (layout, name)


def check_written_model(case, tmp):
    """weights.safetensors, read back through config's naming, must give the
    exact parameters the reference uses."""
    p = make_params(case, torch.Generator().manual_seed(case.id))
    model_dir = os.path.join(tmp, f"model_{case.id}")
    ref = write_model(case, p, model_dir, random.Random(case.id))
    stored, _ = read_safetensors(os.path.join(model_dir, "weights.safetensors"))
    with open(os.path.join(model_dir, "config.pbtxt")) as f:
        config = f.read()
    renames = dict(_parse_tensor_names(config))
    canonical = params_to_tensors(p, case.layout, case.h)
    from_file = {n: stored[case.prefix + renames.get(n, n)] for n in canonical}
    back = tensors_to_params(from_file, case.layout, case.h)
    for name, value in ref.items():
        if value is not None:
            assert np.array_equal(value, back[name]), (case.id, name)
            assert np.abs(value - p[name]).max() <= 1e-2 * (
                1 + np.abs(p[name]).max()), (case.id, name)


def _parse_tensor_names(config):
    """(key, value) pairs of the tensor_names entries of a config.pbtxt we
    wrote ourselves (one `key: "..."` / `value: "..."` line each)."""
    lines = [ln.strip() for ln in config.splitlines()]
    keys = [ln.split('"')[1] for ln in lines if ln.startswith("key:")]
    values = [ln.split('"')[1] for ln in lines if ln.startswith("value:")]
    return zip(keys, values)


def torch_mha_outputs(case, p, inputs):
    """(output, per-head weights) of nn.MultiheadAttention, or None when
    PyTorch 1.13 cannot express the case."""
    if case.dk or not _torch_can_mask(case):
        return None
    mha = torch.nn.MultiheadAttention(
        case.E, case.h, bias=case.bias, add_bias_kv=case.add_bias_kv,
        add_zero_attn=case.add_zero_attn, kdim=case.kdim, vdim=case.vdim,
        batch_first=True)
    sd = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in
          params_to_tensors(p, "in_proj" if mha._qkv_same_embed_dim
                            else "qkv_proj", case.h).items()
          if not k.startswith("norm.")}
    mha.load_state_dict(sd)
    q = inputs["query"]
    k = inputs.get("key", q)
    v = inputs.get("value", k)
    # Grad stays enabled so that the native "fast path" (which zeroes padded
    # rows instead of computing them) is not taken.
    out, w = mha(q, k, v, key_padding_mask=inputs.get("key_padding_mask"),
                 attn_mask=_with_causal(case, inputs.get("attn_mask")),
                 need_weights=True, average_attn_weights=False)
    out, w = out.detach().double(), w.detach().double()
    # mha_run's rule for rows whose keys are all masked (PyTorch: NaN). When
    # only some heads of a row have no key, PyTorch's whole row is NaN and
    # cannot be compared.
    nan_rows = torch.isnan(w).any(dim=-1, keepdim=True)
    if (nan_rows.any(dim=-3) != nan_rows.all(dim=-3)).any():
        return None
    w = w.masked_fill(nan_rows, 0.0)
    empty = nan_rows.all(dim=-3)  # [.., L, 1]: every head saw no key
    bo = torch.zeros(case.E, dtype=torch.float64) if p["bo"] is None \
        else torch.from_numpy(p["bo"]).double()
    out = torch.where(empty, bo, out)
    if case.norm_eps is not None:
        out = F.layer_norm(q.double() + out, (case.E,),
                           torch.from_numpy(p["norm_w"]).double(),
                           torch.from_numpy(p["norm_b"]).double(),
                           case.norm_eps)
    return out, w


def _torch_can_mask(case):
    # PyTorch 1.13 ORs a float key_padding_mask into a bool attn_mask and
    # cannot combine it with a float one.
    return not (case.kpm == "float" and (case.attn_mask or case.causal))


def _with_causal(case, attn_mask):
    if not case.causal:
        return attn_mask
    causal = torch.ones(case.L, case.S, dtype=torch.bool).triu(1)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask | causal
    return attn_mask.masked_fill(causal, float("-inf"))


def naive_reference(case, p, inputs):
    """Loop-per-(batch, head, query) version of the attention, in float64."""
    batched = case.batch > 0
    get = _batch_getter(inputs, batched)
    B = max(case.batch, 1)
    dk, dv = p["wq"].shape[0] // case.h, p["wv"].shape[0] // case.h
    out = np.zeros((B, case.L, case.E))
    probs = np.zeros((B, case.h, case.L, _num_keys(case)))
    for b in range(B):
        q, k, v = get("query", b), get("key", b), get("value", b)
        head_outputs = []
        for hd in range(case.h):
            qh = _proj(q, p["wq"], p["bq"], hd, dk)
            kh = _proj(k, p["wk"], p["bk"], hd, dk)
            vh = _proj(v, p["wv"], p["bv"], hd, dv)
            kh, vh = _extra_keys(case, p, kh, vh, hd, dk, dv)
            for i in range(case.L):
                scores = kh @ qh[i] / math.sqrt(dk) + _mask_row(case, inputs,
                                                                b, hd, i)
                probs[b, hd, i] = _softmax_or_zero(scores)
            head_outputs.append(probs[b, hd] @ vh)
        ctx = np.concatenate(head_outputs, axis=1)
        out[b] = ctx @ p["wo"].T.astype(np.float64) + (
            0 if p["bo"] is None else p["bo"])
        if case.norm_eps is not None:
            out[b] = _layer_norm(get("query", b) + out[b], p, case.norm_eps)
    return (out, probs) if batched else (out[0], probs[0])


def _batch_getter(inputs, batched):
    def get(name, b):
        x = inputs.get(name)
        if x is None:  # absent key -> query, absent value -> key
            x = inputs.get("key") if name == "value" and "key" in inputs \
                else inputs["query"]
        x = x.double().numpy()
        return x[b] if batched else x
    return get


def _num_keys(case):
    return case.S + case.add_bias_kv + case.add_zero_attn


def _proj(x, w, bias, hd, d):
    rows = slice(hd * d, (hd + 1) * d)
    y = x @ w[rows].T.astype(np.float64)
    return y if bias is None else y + bias[rows]


def _extra_keys(case, p, kh, vh, hd, dk, dv):
    if case.add_bias_kv:
        kh = np.vstack([kh, p["bias_k"][0, :, hd * dk:(hd + 1) * dk]])
        vh = np.vstack([vh, p["bias_v"][0, :, hd * dv:(hd + 1) * dv]])
    if case.add_zero_attn:
        kh, vh = np.vstack([kh, np.zeros(dk)]), np.vstack([vh, np.zeros(dv)])
    return kh, vh


def _mask_row(case, inputs, b, hd, i):
    row = np.zeros(_num_keys(case))
    for j in range(case.S):
        terms = []
        if "attn_mask" in inputs:
            am = inputs["attn_mask"]
            terms.append(am[i, j] if am.dim() == 2 else am[b * case.h + hd, i, j])
        if "key_padding_mask" in inputs:
            kpm = inputs["key_padding_mask"]
            terms.append(kpm[b, j] if kpm.dim() == 2 else kpm[j])
        if case.causal:
            terms.append(torch.tensor(j > i))
        for t in terms:
            row[j] += -math.inf if (t.dtype == torch.bool and t) else (
                0.0 if t.dtype == torch.bool else float(t))
    return row


def _softmax_or_zero(scores):
    if np.all(np.isneginf(scores)):
        return np.zeros_like(scores)
    e = np.exp(scores - scores.max())
    return e / e.sum()


def _layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["norm_w"] + p["norm_b"]


def max_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max()) if a.size else 0.0


def check_reference(case):
    """Returns a list of failure strings; also whether torch was compared."""
    gen = torch.Generator().manual_seed(case.id)
    p = make_params(case, gen)
    inputs = make_inputs(case, gen)
    out, probs = reference_mha(p, case.h, inputs["query"], inputs.get("key"),
                               inputs.get("value"),
                               inputs.get("key_padding_mask"),
                               inputs.get("attn_mask"), case.causal,
                               case.add_zero_attn, case.norm_eps)
    failures = []
    naive_out, naive_probs = naive_reference(case, p, inputs)
    for what, a, b in [("naive output", out, naive_out),
                       ("naive probs", probs, naive_probs)]:
        if not max_diff(a, b) <= 1e-9:
            failures.append(f"{what} differ by {max_diff(a, b):.3g}")
    torch_result = torch_mha_outputs(case, p, inputs)
    if torch_result is not None:
        for what, a, b in [("torch output", out, torch_result[0]),
                           ("torch probs", probs, torch_result[1])]:
            if not max_diff(a, b) <= TOL:
                failures.append(f"{what} differ by {max_diff(a, b):.3g}")
    assert set(expected_outputs(case, p, inputs)) >= {"output"}
    return failures, torch_result is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    failed = vs_torch = 0
    with tempfile.TemporaryDirectory() as tmp:
        check_safetensors_round_trip(tmp)
        for index in range(args.configs):
            case = make_case(index, args.seed)
            check_layouts(case)
            check_written_model(case, tmp)
            failures, compared = check_reference(case)
            vs_torch += compared
            failed += bool(failures)
            for f in failures:
                print(f"[{index:3d}] {describe(case)}: {f}")
    print(f"layouts and model files: ok; reference vs naive loops: "
          f"{args.configs} cases; vs nn.MultiheadAttention: {vs_torch} cases")
    print(f"{args.configs - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
