"""Routed experts' gate + up for a decode step: h = SiLU(x @ W_gate[e].T) * (x @ W_up[e].T)
for every (token, k) pair, streaming only the chosen experts' rows.

    x [T, H]; gate_up [E, 2I, H] (HF's DeepseekV3Experts.gate_up_proj: gate rows 0 : I,
    up rows I : 2I); h [P, I] with P = T * TOP_K, row p = pair (token p // TOP_K, k p % TOP_K)

Grid (P, cdiv(I, BLOCK_N)): program (s, n) serves the pairs of pair s's expert where s is
the first pair that chose it (expert_run.py), and rows n * BLOCK_N of its gate and up
weights, walking H in BLOCK_K tiles for up to BLOCK_M of the run's tokens at a time ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M] dots
into fp32). Rounded like HF's modules: gate, up, SiLU(gate) and the product each to h's dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.moe.expert_run import expert_run, run_rows


@triton.jit
def moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr,                     # x [T, H], gate_up [E, 2I, H], h [P, I]
    topk_idx_ptr,                            # [P] the flattened topk_idx
    P, E, I, H, TOP_K,
    stride_xt, stride_we, stride_wn, stride_hp,
    BLOCK_R: tl.constexpr,                   # >= the longest run (next power of 2 of P)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    s = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e, run, match = expert_run(topk_idx_ptr, s, P, E, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_rows = w_base + offs_n.to(tl.int64)[:, None] * stride_wn                 # [BLOCK_N, 1]
    u_rows = g_rows + I * stride_wn                                            # the up half
    dt = h_ptr.dtype.element_ty
    for m0 in range(0, run, BLOCK_M):
        pair, token, m_ok = run_rows(match, m0, run, P, TOP_K, BLOCK_M)
        x_rows = x_ptr + token.to(tl.int64)[None, :] * stride_xt               # [1, BLOCK_M]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            if EVEN_K:
                wg = tl.load(g_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                wu = tl.load(u_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :], other=0.0)
            else:
                k_ok = kk < H
                wg = tl.load(g_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots
                acc_g = tl.dot(wg.to(tl.float32), x.to(tl.float32), acc_g)
                acc_u = tl.dot(wu.to(tl.float32), x.to(tl.float32), acc_u)
            else:
                acc_g = tl.dot(wg, x, acc_g)                                   # [BLOCK_N, BLOCK_M]
                acc_u = tl.dot(wu, x, acc_u)
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # SiLU(gate)
        up = acc_u.to(dt).to(tl.float32)
        h_ptrs = h_ptr + pair.to(tl.int64)[None, :] * stride_hp + offs_n[:, None]   # h.T tile
        tl.store(h_ptrs, (act * up).to(dt), mask=m_ok[None, :] & n_ok[:, None])
