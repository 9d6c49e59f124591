"""Routed experts' down projection for a decode step, weighted per (token, k) pair:
out[p] = weight[p] * (h[p] @ W_down[e_p].T), streaming only the chosen experts' rows.

    h [P, I] (gate_up_kernel.py's output), down [E, H, I] (HF's DeepseekV3Experts.down_proj),
    weight [P] fp32 routing weights, out [P, H] fp32; P = T * TOP_K pairs

Grid (P, cdiv(H, BLOCK_N)) over the pairs, as gate_up_kernel.py. Every row of out is
written (a pair whose expert is outside [0, E) by its own program, as zeros), so out
needs no zero fill. Each product is rounded
to h's dtype (HF's linear output) before the fp32 multiply by its routing weight; the caller
sums out over k per token in fp32 and rounds once (HF's grouped_mm experts do the same).
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.moe.expert_run import expert_run, run_rows


@triton.jit
def moe_down_kernel(
    h_ptr, w_ptr, weight_ptr, out_ptr,       # h [P, I], down [E, H, I], weight [P], out [P, H]
    topk_idx_ptr,                            # [P] the flattened topk_idx
    P, E, H, I, TOP_K,
    stride_hp, stride_we, stride_wn, stride_op,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    s = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e, run, match = expert_run(topk_idx_ptr, s, P, E, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < H
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    dt = h_ptr.dtype.element_ty
    for m0 in range(0, run, BLOCK_M):
        pair, token, m_ok = run_rows(match, m0, run, P, TOP_K, BLOCK_M)
        h_rows = h_ptr + pair.to(tl.int64)[None, :] * stride_hp                # [1, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                h = tl.load(h_rows + kk[:, None], mask=m_ok[None, :], other=0.0)
            else:
                k_ok = kk < I
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                h = tl.load(h_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots
                acc = tl.dot(w.to(tl.float32), h.to(tl.float32), acc)
            else:
                acc = tl.dot(w, h, acc)                                        # [BLOCK_N, BLOCK_M]
        wt = tl.load(weight_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)   # [BLOCK_M]
        y = acc.to(dt).to(tl.float32) * wt[None, :]
        o_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_op + offs_n[:, None]  # out.T tile
        tl.store(o_ptrs, y, mask=m_ok[None, :] & n_ok[:, None])
    if (e < 0) | (e >= E):          # no program serves this pair: its row adds zero
        tl.store(out_ptr + s.to(tl.int64) * stride_op + offs_n,
                 tl.zeros([BLOCK_N], dtype=tl.float32), mask=n_ok)
