"""float64 reference of mha_run's attention, written with plain torch ops.

Semantics are those of PyTorch 1.13 nn.MultiheadAttention(batch_first=True)
generalised to the "einsum variant" (per-head widths dk/dv independent of
embed_dim), with two deliberate differences documented by mha_run:

* a float key_padding_mask is added to the scores (PyTorch 1.13 mishandles
  float key_padding_mask combined with an attn_mask),
* a query row whose keys are all masked (-inf everywhere, after the
  add_bias_kv / add_zero_attn columns) gets probabilities of zero, so its
  output is out_proj.bias (then post-norm), where PyTorch yields NaN.
"""

import math

import torch
import torch.nn.functional as F


def reference_mha(params, num_heads, query, key=None, value=None,
                  key_padding_mask=None, attn_mask=None, is_causal=False,
                  add_zero_attn=False, norm_eps=None):
    """Returns (output, per-head probabilities) as float64 tensors.

    params: canonical parameter dict (see mha_model_io). Tensors may be
    batched ([B, L, E], key_padding_mask [B, S]) or unbatched ([L, E],
    [S]); the results have the matching rank ([B, h, L, S'] or [h, L, S']).
    attn_mask is [L, S] or [B*h, L, S] ([h, L, S] unbatched).
    """
    batched = query.dim() == 3
    if key is None:
        key = query
    if value is None:
        value = key
    if not batched:
        query, key, value = query[None], key[None], value[None]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
    p = {k: None if v is None else torch.as_tensor(v, dtype=torch.float64)
         for k, v in params.items()}
    q, k, v = (x.to(torch.float64) for x in (query, key, value))
    B, L, _ = q.shape
    S = k.shape[1]

    mask = _additive_mask(B, num_heads, L, S, key_padding_mask, attn_mask,
                          is_causal)
    ctx, probs = _attend(p, num_heads, q, k, v, mask, add_zero_attn)
    out = F.linear(ctx, p["wo"], p["bo"])
    if norm_eps is not None:
        out = F.layer_norm(q + out, (q.shape[-1],), p["norm_w"], p["norm_b"],
                           norm_eps)
    if not batched:
        out, probs = out[0], probs[0]
    return out, probs


def _additive_mask(B, h, L, S, key_padding_mask, attn_mask, is_causal):
    """Sum of all masks as a float64 [B, h, L, S] tensor (-inf = masked)."""
    mask = torch.zeros(B, h, L, S, dtype=torch.float64)
    if attn_mask is not None:
        am = _to_additive(attn_mask)
        mask = mask + (am if am.dim() == 2 else am.view(B, h, L, S))
    if key_padding_mask is not None:
        mask = mask + _to_additive(key_padding_mask).view(B, 1, 1, S)
    if is_causal:
        # Top-left aligned: query i may not see key j > i.
        causal = torch.ones(L, S, dtype=torch.bool).triu(1)
        mask = mask + _to_additive(causal)
    return mask


def _to_additive(mask):
    mask = torch.as_tensor(mask)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(
            mask, float("-inf"))
    return mask.to(torch.float64)


def _attend(p, h, q, k, v, mask, add_zero_attn):
    """Projections, extra key columns, masked softmax and the weighted sum.
    Returns the concatenated head outputs [B, L, h*dv] and probs [B,h,L,S']."""
    B, L, _ = q.shape
    Q = F.linear(q, p["wq"], p["bq"])
    K = F.linear(k, p["wk"], p["bk"])
    V = F.linear(v, p["wv"], p["bv"])
    if p["bias_k"] is not None:
        # One learned key/value appended to every sequence, never masked.
        K = torch.cat([K, p["bias_k"].expand(B, 1, -1)], dim=1)
        V = torch.cat([V, p["bias_v"].expand(B, 1, -1)], dim=1)
        mask = F.pad(mask, (0, 1))
    if add_zero_attn:
        K = torch.cat([K, K.new_zeros(B, 1, K.shape[2])], dim=1)
        V = torch.cat([V, V.new_zeros(B, 1, V.shape[2])], dim=1)
        mask = F.pad(mask, (0, 1))

    def heads(x):  # [B, T, h*d] -> [B, h, T, d]
        return x.view(B, x.shape[1], h, -1).transpose(1, 2)

    Q, K, V = heads(Q), heads(K), heads(V)
    scores = Q @ K.transpose(-1, -2) / math.sqrt(Q.shape[-1]) + mask
    all_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1).masked_fill(all_masked, 0.0)
    ctx = (probs @ V).transpose(1, 2).reshape(B, L, -1)
    return ctx, probs
