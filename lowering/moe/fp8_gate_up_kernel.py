"""Routed experts' gate + up over block-quantized fp8 expert weights (DeepSeek-V3 / R1
checkpoints, HF's FP8Experts) for a decode step: h = SiLU(x @ Wg[e].T) * (x @ Wu[e].T)
per (token, k) pair, streaming only the chosen experts' rows, one byte per weight.

    x [T, H]; gate_up [E, 2I, H] e4m3 (gate rows 0 : I, up rows I : 2I), scale_inv
    [E, 2 * cdiv(I, GROUP_N), cdiv(H, GROUP_K)] fp32 (gate's blocks, then up's: UP_S_ROW0 =
    cdiv(I, GROUP_N)); h [P, I] with P = T * TOP_K, row p = pair (token p // TOP_K, k p % TOP_K)

As gate_up_kernel.py (grid (P, cdiv(I, BLOCK_N)), one program per first pair of
an expert), with HF's FP8Linear numerics per linear: x quantized per GROUP_K columns
(lowering/gemm/fp8_linear_kernel.py's quant_act_tile: in registers by every program, or
with PRE_Q once before the launch by act_quant_kernel), fp8 x fp8 dots scaled by both
scales into fp32, gate, up, SiLU(gate) and the product each rounded to h's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.gemm.fp8_linear_kernel import quant_act_tile
from lowering.moe.expert_run import expert_run, run_rows


@triton.jit
def moe_gate_up_fp8_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr,             # x [T, H], gate_up [E, 2I, H] e4m3, scales, h [P, I]
    topk_idx_ptr,                            # [P] the flattened topk_idx
    P, E, I, H, TOP_K, UP_S_ROW0,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_hp,
    BLOCK_R: tl.constexpr,                   # >= the longest run (next power of 2 of P)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,   # BLOCK_K = GROUP_K
    GROUP_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    xs_ptr, stride_xs,                       # PRE_Q: x's scales [T, cdiv(H, BLOCK_K)]
    PRE_Q: tl.constexpr,                     # x is e4m3, quantized once (act_quant_kernel)
):
    s = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e, run, match = expert_run(topk_idx_ptr, s, P, E, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < I
    g_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + I * stride_wn                                            # the up half
    s_base = ws_ptr + e.to(tl.int64) * stride_se
    gs_rows = s_base + (offs_n // GROUP_N) * stride_sn                         # [BLOCK_N]
    us_rows = s_base + (UP_S_ROW0 + offs_n // GROUP_N) * stride_sn
    dt = h_ptr.dtype.element_ty
    for m0 in range(0, run, BLOCK_M):
        pair, token, m_ok = run_rows(match, m0, run, P, TOP_K, BLOCK_M)
        x_rows = x_ptr + token.to(tl.int64)[None, :] * stride_xt               # [1, BLOCK_M]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, tl.cdiv(H, BLOCK_K)):
            kk = kb * BLOCK_K + offs_k
            if EVEN_K:
                wg = tl.load(g_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                wu = tl.load(u_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :], other=0.0)
            else:
                k_ok = kk < H
                wg = tl.load(g_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if PRE_Q:
                xq = x                                                         # [BK, BM] e4m3
                xs = tl.load(xs_ptr + token.to(tl.int64) * stride_xs + kb, mask=m_ok, other=0.0)
            else:
                xq, xs = quant_act_tile(x.to(tl.float32), w_ptr, not DOT_F32)  # [BK, BM], [BM]
            gsc = tl.load(gs_rows + kb, mask=n_ok, other=0.0)                  # [BLOCK_N]
            usc = tl.load(us_rows + kb, mask=n_ok, other=0.0)
            if DOT_F32:      # the CPU interpreter: fp8 x fp8 products are exact in fp32
                pg = tl.dot(wg.to(tl.float32), xq.to(tl.float32))
                pu = tl.dot(wu.to(tl.float32), xq.to(tl.float32))
            else:
                pg = tl.dot(wg, xq)                                            # [BLOCK_N, BLOCK_M]
                pu = tl.dot(wu, xq)
            acc_g += pg * gsc[:, None] * xs[None, :]
            acc_u += pu * usc[:, None] * xs[None, :]
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # SiLU(gate)
        up = acc_u.to(dt).to(tl.float32)
        h_ptrs = h_ptr + pair.to(tl.int64)[None, :] * stride_hp + offs_n[:, None]   # h.T tile
        tl.store(h_ptrs, (act * up).to(dt), mask=m_ok[None, :] & n_ok[:, None])
