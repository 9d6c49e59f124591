"""Pure-torch MLA decode: the reference every kernel is measured against.

Gathers each request's paged latent rows, masks by length (causal within the
query block), and runs softmax attention in float32. Works on CPU and GPU; no
device->host sync, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch


def dequant_cache(kv_cache: torch.Tensor, kind: str, k_scale) -> torch.Tensor:
    if kind == "fp8":
        return kv_cache.float() * k_scale.float().reshape(())
    return kv_cache.float()


def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, softmax_scale, *,
                         causal, kind, k_scale, head_dim_v):
    B, s_q, H, D = q.shape
    nb, bs, _ = kv_cache.shape
    max_blocks = block_table.shape[1]
    S = max_blocks * bs
    # Padding ids (e.g. -1) beyond a request's length are masked; clamp so indexing stays in range.
    bt = block_table.long().clamp(0, nb - 1)
    kv = dequant_cache(kv_cache, kind, k_scale)[bt].reshape(B, S, D)     # [B, S, D]
    scores = torch.einsum("bqhd,bsd->bhqs", q.float(), kv) * softmax_scale  # [B, H, s_q, S]
    pos = torch.arange(S, device=q.device)                               # [S]
    lens = cache_seqlens.long()[:, None]                                 # [B, 1]
    if causal:
        qi = torch.arange(s_q, device=q.device)[None, :]                 # [1, s_q]
        limit = lens - s_q + qi + 1                                      # [B, s_q]
    else:
        limit = lens.expand(B, s_q)
    mask = pos[None, None, :] < limit[:, :, None]                        # [B, s_q, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                # [B, H, s_q]
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    # Rows past a request's length were never written: zero them so NaN/inf there
    # cannot leak through a zero probability (0 * NaN = NaN).
    kv = kv.masked_fill((pos[None, :] >= lens)[..., None], 0.0)
    out = torch.einsum("bhqs,bsv->bqhv", p, kv[..., :head_dim_v])        # [B, s_q, H, V]
    return out.to(q.dtype), lse.float()


def run_reference(call):
    """The "reference" route of lowering.mla_decode (a checked, bounded DecodeCall)."""
    return mla_decode_reference(call.q, call.kv_cache, call.block_table, call.cache_seqlens,
                                call.softmax_scale, causal=call.causal, kind=call.kind,
                                k_scale=call.k_scale, head_dim_v=call.head_dim_v)
