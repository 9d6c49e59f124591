"""Prefill as MHA on up-projected K/V: the CUDA path and the torch reference.

On CUDA, prefill_attention runs lowering.prefill.mla_prefill: one launch of the dense
attention op (cuDNN where it serves) for the new tokens of all requests, bf16 GEMMs for
the up-projection, one gather kernel and one merge kernel per context window; no Python
loop over requests. The host ints it needs (prefill requests, longest prompt and
context) come from `shape` when the caller passes them, else from one device->host copy
(lowering.prefill.prefill_shape).

Elsewhere (CPU) it keeps the torch reference below. For each prefill request: the new
tokens attend causally to themselves (K 192 wide = [k_nope | k_pe], V 128 wide) and to
the context already in the paged cache.
Keys are taken at most `workspace_rows` tokens at a time (new tokens, then cached
context gathered from the paged cache), up-projected, and each chunk's (out, lse)
is merged by online softmax; queries are split so one score block holds at most
SCORE_BUDGET elements. Peak memory is bounded by the two budgets, not by the prompt
or context length.
"""
from __future__ import annotations

import torch

from lowering.decode.reference import dequant_cache
from lowering.prefill.step import PrefillShape, mla_prefill, prefill_shape


def up_project(kv_c: torch.Tensor, W_UK_T: torch.Tensor, W_UV: torch.Tensor):
    """kv_c [c, L] -> k_nope [c, N, P], v [c, N, V]."""
    k_nope = torch.einsum("cl,npl->cnp", kv_c, W_UK_T)
    v = torch.einsum("cl,nlv->cnv", kv_c, W_UV)
    return k_nope, v


SCORE_BUDGET = 1 << 26   # fp32 elements of one [N, queries, keys] score block (256 MiB)


def attend(q, k, v, scale: float, causal_offset: int | None):
    """q [s, N, D], k [c, N, D], v [c, N, V] -> out [s, N, V] fp32, lse [N, s] fp32.

    causal_offset None: every query sees every key; else query i sees key j iff
    j <= i + causal_offset. A query that sees no key gets out 0, lse -inf.
    """
    scores = torch.einsum("snd,cnd->nsc", q.float(), k.float()) * scale   # [N, s, c]
    if causal_offset is not None:
        s, c = scores.shape[1:]
        keep = torch.ones(s, c, dtype=torch.bool, device=q.device).tril(causal_offset)
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


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def prefill_attention(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                      query_start_loc, num_decode_tokens, softmax_scale, kind, k_scale,
                      workspace_rows, shape: PrefillShape | None = None):
    """Attention for tokens [num_decode_tokens, T) -> [T - num_decode_tokens, N * V] (q dtype).

    q [T, N, P+R]; kv_c_normed [T, L]; k_pe [T, R]. shape: the step's PrefillShape when
    the caller knows it on the host (CUDA: saves the one device->host copy).
    """
    if q.is_cuda:
        if shape is None:
            shape = prefill_shape(query_start_loc, seq_lens, num_decode_tokens)
        return mla_prefill(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                           query_start_loc, num_decode_tokens, softmax_scale, kind, k_scale,
                           workspace_rows, shape,
                           kernels="triton" if triton_available() else "torch")
    return reference_prefill(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table,
                             seq_lens, query_start_loc, num_decode_tokens, softmax_scale,
                             kind, k_scale, workspace_rows)


def reference_prefill(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                      query_start_loc, num_decode_tokens, softmax_scale, kind, k_scale,
                      workspace_rows):
    """The torch reference of prefill_attention (float32, a loop over requests; any device)."""
    T, N, _ = q.shape
    L = W_UK_T.shape[-1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    outs = []
    for r in range(len(lens)):
        a, b = qsl[r], qsl[r + 1]
        if b <= num_decode_tokens or a == b:
            continue
        s, ctx = b - a, lens[r] - (b - a)
        out = q.new_zeros(s, N, W_UV.shape[-1], dtype=torch.float32)     # [s, N, V]
        lse = q.new_full((N, s), float("-inf"), dtype=torch.float32)     # [N, s]
        # Key chunks: the new tokens (causal), then the cached context (all visible).
        for k0, k1 in context_chunks(s, workspace_rows):
            k_nope, v = up_project(kv_c_normed[a + k0:a + k1], W_UK_T, W_UV)
            k = torch.cat([k_nope, k_pe[a + k0:a + k1, None].expand(-1, N, -1)], -1)
            _attend_queries(q[a:b], k, v, softmax_scale, k0, out, lse)
        for c0, c1 in context_chunks(ctx, workspace_rows):
            rows = gather_context(kv_cache, block_table[r], c0, c1, kind, k_scale)  # [c, L + R]
            ck_nope, cv = up_project(rows[:, :L].to(W_UK_T.dtype), W_UK_T, W_UV)
            ck = torch.cat([ck_nope, rows[:, None, L:].to(ck_nope.dtype).expand(-1, N, -1)], -1)
            _attend_queries(q[a:b], ck, cv, softmax_scale, None, out, lse)
        outs.append(out.reshape(s, -1))
    return torch.cat(outs).to(q.dtype)


def _attend_queries(q, k, v, scale, key_start, out, lse):
    """Merge one key chunk into (out [s, N, V], lse [N, s]) in place, query block by block.

    key_start None: the chunk is context, seen by every query; else the chunk holds the
    request's own tokens [key_start, key_start + c) and query i sees token j iff j <= i.
    """
    s, N, _ = q.shape
    c = k.shape[0]
    step = max(1, SCORE_BUDGET // (N * c))
    for q0 in range(0, s, step):
        q1 = min(q0 + step, s)
        if key_start is not None and key_start > q1 - 1:
            continue                            # these queries precede every key of the chunk
        offset = None if key_start is None else q0 - key_start
        o, l = attend(q[q0:q1], k, v, scale, offset)
        out[q0:q1], lse[:, q0:q1] = merge(out[q0:q1], lse[:, q0:q1], o, l)
