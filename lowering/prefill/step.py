"""The prefill rows of one attention step, as kernels and bf16 GEMMs (the CUDA path).

For the prefill requests of a step (the suffix of the batch after the decode requests):

1. New tokens. k_nope and v of this step's tokens come from two GEMMs in the input
   dtype, kv_c [T, L] @ W_UK [L, N*P] and kv_c @ W_UV [L, N*V] (never fp32 einsums);
   k = [k_nope | k_pe] (192 wide; one launch, keys_kernel.py). The causal attention of
   each request over its own tokens is one call of the dense op on the right-padded
   batch (ragged.py): out and lse.
2. Cached context, when any request has some. A window of `width` positions of every
   request's context is gathered into one padded workspace [Bp, width, L + R] (one
   kernel, fp8 dequantized in the gather; width = workspace_rows // Bp, so memory stays
   bounded by the workspace budget), up-projected by the same two GEMMs, and attended by
   the same padded queries, non-causally. Requests whose context ends inside the window
   hide the rest by key length (an additive bias on the cuDNN route); when every
   request's context covers the window (one request, or equal contexts) no mask is
   built at all. Each window's (out, lse) is merged into the running result by one
   merge kernel launch. The loop is over windows, never over requests.

   The absorbed MQA form (the decode kernels with s_q > 1) is not built here. Per context
   key, head and new token it costs 2 * (L + R) + 2 * L = 2176 FLOP (scores over 576,
   output over 512) against 2 * (P + R) + 2 * V = 640 for the up-projected form; the
   up-projection costs 2 * L * (P + V) = 262144 FLOP per context key and head, once for
   all new tokens. So the absorbed form is cheaper only below 262144 / (2176 - 640) ~ 170
   new tokens per request (the multi-turn case of 512 new tokens is above it); short
   chunks over a long context would gain from it, and that is left for later.

Memory: the context is windowed (at most workspace_rows rows of K/V at a time), but the
new tokens' K [Tp, N, 192] and V [Tp, N, 128] exist whole, as any one-launch attention
needs them (671 MB at 8192 tokens and 128 heads, bf16), plus a right-padded copy of q,
k and v when the requests' lengths differ (Bp * max_query_len rows each; none when they
are equal, the case of HF's batches, whose pads are real rows of the step).

Host ints come from PrefillShape (prefill_shape reads them with one device->host copy
when the caller did not pass them; the step metadata knows them on the host).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowering.prefill.dense import dense_attention
from lowering.prefill.ragged import RaggedLayout


@dataclass(frozen=True)
class PrefillShape:
    """Exact from prefill_shape(); a caller may pass bounds instead (the padded buffers and
    the context windows then cover the bounds, and the lengths on the device hide the
    rest: same results, more work), as a captured prefill chunk does for its bucket."""
    num_requests: int       # prefill requests of the step (the batch's suffix): exact
    max_query_len: int      # their longest new-token count (or more)
    max_context_len: int    # their longest cached context, seq_len - query_len (or more)
    min_context_len: int    # their shortest cached context (or less, >= 0)


def prefill_shape(query_start_loc, seq_lens, num_decode_tokens: int) -> PrefillShape:
    """The host ints of a step's prefill requests, in one device->host copy."""
    qlen = query_start_loc[1:] - query_start_loc[:-1]           # [B]
    is_prefill = query_start_loc[1:] > num_decode_tokens         # [B], a suffix
    ctx = (seq_lens - qlen).clamp(min=0)
    big = torch.iinfo(torch.int32).max
    stats = torch.stack([
        is_prefill.sum(), torch.where(is_prefill, qlen, 0).max(),
        torch.where(is_prefill, ctx, 0).max(), torch.where(is_prefill, ctx, big).min()])
    nreq, max_q, max_ctx, min_ctx = stats.tolist()
    return PrefillShape(nreq, max_q, max_ctx, min_ctx)


def up_project(kv_c, W_UK_T, W_UV):
    """kv_c [c, L] -> k_nope [c, N, P], v [c, N, V]: two GEMMs in kv_c's dtype."""
    N, P, L = W_UK_T.shape
    V = W_UV.shape[-1]
    k_nope = torch.mm(kv_c, W_UK_T.reshape(N * P, L).t())       # [c, N * P]
    v = torch.mm(kv_c, W_UV.transpose(0, 1).reshape(L, N * V))   # [c, N * V]
    return k_nope.view(-1, N, P), v.view(-1, N, V)


def kernel_keys(k_nope, k_pe):
    """k_nope [T, N, P], k_pe [T, R] -> k [T, N, P + R]: one launch where it serves."""
    from lowering.prefill.keys_kernel import keys_reference, keys_unmet, prefill_keys
    if keys_unmet(k_nope, k_pe) is None:
        return prefill_keys(k_nope, k_pe)
    return keys_reference(k_nope, k_pe)


def kernel_ops(kernels: str):
    """(gather, merge, keys) for kernels "triton" (one launch each) or "torch" (references)."""
    if kernels == "triton":
        from lowering.prefill.gather_kernel import gather_context
        from lowering.prefill.merge_kernel import merge_attn_states
        return gather_context, merge_attn_states, kernel_keys
    from lowering.prefill.gather_kernel import gather_context_reference
    from lowering.prefill.keys_kernel import keys_reference
    from lowering.prefill.merge_kernel import merge_attn_states_reference
    return gather_context_reference, merge_attn_states_reference, keys_reference


def mla_prefill(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                query_start_loc, num_decode_tokens: int, softmax_scale: float, kind: str,
                k_scale, workspace_rows: int, shape: PrefillShape, route: str = "auto",
                kernels: str = "triton"):
    """Attention for tokens [num_decode_tokens, T) -> [T - num_decode_tokens, N * V] (q dtype).

    q [T, N, P + R]; kv_c_normed [T, L]; k_pe [T, R]; the rest as mla::attention_with_output.
    route: the dense op's route; kernels: "triton" | "torch" for the gather and the merge.
    """
    T, N, _ = q.shape
    L = W_UK_T.shape[-1]
    V = W_UV.shape[-1]
    nd = num_decode_tokens
    Bp, B = shape.num_requests, block_table.shape[0]
    Tp = T - nd
    cu = query_start_loc[B - Bp:] - nd                            # [Bp + 1] int32
    gather, merge, keys = kernel_ops(kernels)
    qp = q[nd:]                                                   # [Tp, N, P + R]
    k_nope, v = up_project(kv_c_normed[nd:], W_UK_T, W_UV)
    k = keys(k_nope, k_pe[nd:])                                   # [Tp, N, P + R]
    lay = RaggedLayout(cu, shape.max_query_len, Tp)
    q_pad = lay.padded(qp)                                        # [Bp, N, S, P + R]
    o, l = dense_attention(q_pad, lay.padded(k), lay.padded(v), None, softmax_scale, True,
                           route)                                 # [Bp, S, N, V], [Bp, N, S]
    out, lse = lay.packed(o), lay.packed(l.transpose(1, 2))       # [Tp, N, V], [Tp, N]
    if shape.max_context_len <= 0:
        return out.reshape(Tp, N * V)

    bt = block_table[B - Bp:]
    ctx_lens = (seq_lens[B - Bp:] - (cu[1:] - cu[:-1])).clamp(min=0).to(torch.int32)  # [Bp]
    width = min(max(1, workspace_rows // Bp), shape.max_context_len)
    for c0 in range(0, shape.max_context_len, width):
        w = min(width, shape.max_context_len - c0)
        rows = gather(kv_cache, bt, ctx_lens, c0, w, kind, k_scale, q.dtype)  # [Bp, w, L + R]
        flat = rows.view(Bp * w, -1)
        ck_nope, cv = up_project(flat[:, :L], W_UK_T, W_UV)
        ck = keys(ck_nope, flat[:, L:]).view(Bp, w, N, -1)        # [Bp, w, N, P + R]
        key_lens = None if shape.min_context_len >= c0 + w else (ctx_lens - c0).clamp(0, w)
        o, l = dense_attention(q_pad, ck.transpose(1, 2), cv.view(Bp, w, N, V).transpose(1, 2),
                               key_lens, softmax_scale, False, route)  # [Bp, S, N, V], [Bp, N, S]
        last = c0 + w >= shape.max_context_len
        out, lse = merge(out, lse, lay.packed(o), lay.packed(l.transpose(1, 2)),
                         q.dtype if last else torch.float32)
    return out.reshape(Tp, N * V)
