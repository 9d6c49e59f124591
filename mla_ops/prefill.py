"""Prefill as MHA on up-projected K/V, with chunked cached context.

For each prefill request: the new tokens attend causally to themselves (K 192
wide = [k_nope | k_pe], V 128 wide); context already in the paged cache is
gathered and up-projected at most `workspace_rows` tokens at a time, and each
chunk's (out, lse) is merged by online softmax, so peak memory is bounded by
the budget, not by the context length.
"""
from __future__ import annotations

import torch

from lowering.reference import dequant_cache


def up_project(kv_c: torch.Tensor, W_UK_T: torch.Tensor, W_UV: torch.Tensor):
    """kv_c [c, L] -> k_nope [c, N, P], v [c, N, V]."""
    k_nope = torch.einsum("cl,npl->cnp", kv_c, W_UK_T)
    v = torch.einsum("cl,nlv->cnv", kv_c, W_UV)
    return k_nope, v


def attend(q, k, v, scale: float, causal: bool):
    """q [s, N, D], k [c, N, D], v [c, N, V] -> out [s, N, V] fp32, lse [N, s] fp32."""
    scores = torch.einsum("snd,cnd->nsc", q.float(), k.float()) * scale   # [N, s, c]
    if causal:
        s, c = scores.shape[1:]
        keep = torch.ones(s, c, dtype=torch.bool, device=q.device).tril(c - s)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                 # [N, s]
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("nsc,cnv->snv", p, v.float()), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Online-softmax merge of two partial attentions; -inf lse means empty (weight 0)."""
    lse = torch.logaddexp(lse_a, lse_b)                                   # [N, s]
    finite = torch.isfinite(lse)
    w_a = torch.where(finite, torch.exp(lse_a - lse), 0.0).transpose(0, 1)[..., None]  # [s, N, 1]
    w_b = torch.where(finite, torch.exp(lse_b - lse), 0.0).transpose(0, 1)[..., None]
    return out_a * w_a + out_b * w_b, lse


def context_chunks(context_len: int, workspace_rows: int):
    """[start, end) ranges of at most workspace_rows cached positions."""
    return [(a, min(a + workspace_rows, context_len)) for a in range(0, context_len, workspace_rows)]


def gather_context(kv_cache, block_row, start: int, end: int, kind, k_scale):
    """Rows [start, end) of one sequence from the paged cache -> [end - start, L + R] fp32."""
    bs = kv_cache.shape[1]
    pos = torch.arange(start, end, device=kv_cache.device)
    slots = block_row.long()[pos // bs] * bs + pos % bs
    rows = kv_cache.view(-1, kv_cache.shape[-1])[slots]
    return dequant_cache(rows, kind, k_scale)


def prefill_attention(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                      query_start_loc, num_decode_tokens, softmax_scale, kind, k_scale,
                      workspace_rows):
    """Attention for tokens [num_decode_tokens, T) -> [T - num_decode_tokens, N * V] (q dtype).

    q [T, N, P+R]; kv_c_normed [T, L]; k_pe [T, R].
    """
    T, N, _ = q.shape
    P, L = W_UK_T.shape[1:]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    outs = []
    for r in range(len(lens)):
        a, b = qsl[r], qsl[r + 1]
        if b <= num_decode_tokens or a == b:
            continue
        k_nope, v = up_project(kv_c_normed[a:b], W_UK_T, W_UV)           # [s, N, P], [s, N, V]
        k = torch.cat([k_nope, k_pe[a:b, None].expand(-1, N, -1)], -1)    # [s, N, P + R]
        out, lse = attend(q[a:b], k, v, softmax_scale, causal=True)
        for c0, c1 in context_chunks(lens[r] - (b - a), workspace_rows):
            rows = gather_context(kv_cache, block_table[r], c0, c1, kind, k_scale)  # [c, L + R]
            ck_nope, cv = up_project(rows[:, :L].to(W_UK_T.dtype), W_UK_T, W_UV)
            ck = torch.cat([ck_nope, rows[:, None, L:].to(ck_nope.dtype).expand(-1, N, -1)], -1)
            c_out, c_lse = attend(q[a:b], ck, cv, softmax_scale, causal=False)
            out, lse = merge(out, lse, c_out, c_lse)
        outs.append(out.reshape(b - a, -1))
    return torch.cat(outs).to(q.dtype)
