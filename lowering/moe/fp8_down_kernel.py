"""Routed experts' down projection over block-quantized fp8 expert weights for a decode
step, weighted per (token, k) pair: out[p] = weight[p] * (h[p] @ Wd[e_p].T).

    h [P, I] (fp8_gate_up_kernel.py's output), down [E, H, I] e4m3, scale_inv
    [E, cdiv(H, GROUP_N), cdiv(I, GROUP_K)] fp32, weight [P] fp32, out [P, H] fp32

As down_kernel.py, with HF's FP8Linear numerics: h quantized per GROUP_K columns (in
registers by every program, or with PRE_Q once before the launch by act_quant_kernel),
fp8 x fp8 dots scaled by both scales into fp32, the product rounded to h's dtype
before the fp32 multiply by its routing weight (the caller sums over k and rounds once).
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.gemm.fp8_linear_kernel import quant_act_tile
from lowering.moe.expert_run import expert_run, run_rows


@triton.jit
def moe_down_fp8_kernel(
    h_ptr, w_ptr, ws_ptr, weight_ptr, out_ptr,   # h [P, I], down [E, H, I] e4m3, scales,
                                                 # weight [P], out [P, H]
    topk_idx_ptr,                                # [P] the flattened topk_idx
    P, E, H, I, TOP_K,
    stride_hp, stride_we, stride_wn, stride_se, stride_sn, stride_op,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,   # BLOCK_K = GROUP_K
    GROUP_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    hs_ptr, stride_hs,                           # PRE_Q: h's scales [P, cdiv(I, BLOCK_K)]
    PRE_Q: tl.constexpr,                         # h is e4m3, quantized once (act_quant_kernel)
    ACT: tl.constexpr,                           # with PRE_Q, h's dtype before: 0 bf16, 1 fp16, 2 fp32
):
    s = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e, run, match = expert_run(topk_idx_ptr, s, P, E, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < H
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = ws_ptr + e.to(tl.int64) * stride_se + (offs_n // GROUP_N) * stride_sn   # [BLOCK_N]
    if PRE_Q:        # the product is rounded to the activations' dtype, not h's e4m3
        dt = tl.bfloat16 if ACT == 0 else (tl.float16 if ACT == 1 else tl.float32)
    else:
        dt = h_ptr.dtype.element_ty
    for m0 in range(0, run, BLOCK_M):
        pair, token, m_ok = run_rows(match, m0, run, P, TOP_K, BLOCK_M)
        h_rows = h_ptr + pair.to(tl.int64)[None, :] * stride_hp                # [1, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, tl.cdiv(I, BLOCK_K)):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                h = tl.load(h_rows + kk[:, None], mask=m_ok[None, :], other=0.0)
            else:
                k_ok = kk < I
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                h = tl.load(h_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if PRE_Q:
                hq = h                                                         # [BK, BM] e4m3
                hs = tl.load(hs_ptr + pair.to(tl.int64) * stride_hs + kb, mask=m_ok, other=0.0)
            else:
                hq, hs = quant_act_tile(h.to(tl.float32), w_ptr, not DOT_F32)  # [BK, BM], [BM]
            wsc = tl.load(s_rows + kb, mask=n_ok, other=0.0)                   # [BLOCK_N]
            if DOT_F32:      # the CPU interpreter: fp8 x fp8 products are exact in fp32
                part = tl.dot(w.to(tl.float32), hq.to(tl.float32))
            else:
                part = tl.dot(w, hq)                                           # [BLOCK_N, BLOCK_M]
            acc += part * wsc[:, None] * hs[None, :]
        wt = tl.load(weight_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)   # [BLOCK_M]
        y = acc.to(dt).to(tl.float32) * wt[None, :]
        o_ptrs = out_ptr + pair.to(tl.int64)[None, :] * stride_op + offs_n[:, None]  # out.T tile
        tl.store(o_ptrs, y, mask=m_ok[None, :] & n_ok[:, None])
    if (e < 0) | (e >= E):          # no program serves this pair: its row adds zero
        tl.store(out_ptr + s.to(tl.int64) * stride_op + offs_n,
                 tl.zeros([BLOCK_N], dtype=tl.float32), mask=n_ok)
