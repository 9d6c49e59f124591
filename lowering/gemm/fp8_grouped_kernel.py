"""A grouped GEMM over block-quantized fp8 weights for a prefill-sized batch, W8A8 as HF's
FP8Linear computes it: an FP8 checkpoint's routed experts over the (token, k) pairs sorted
by expert (lowering/moe/fp8_prefill.py), or one linear with every row in one group
(fp8_grouped.py's prefill_linear).

    a [R, K] e4m3 activations with scales as_ [R, cdiv(K, BLOCK_K)] (quantized per BLOCK_K
    columns, act_quant_kernel); rows [P] int32: the activation row of sorted pair p
    w [E, NW, K] e4m3 with scale_inv ws [E, cdiv(NW, GROUP_N), cdiv(K, BLOCK_K)] fp32
    starts, ends [E] int32: where expert e's pairs begin and end in the sorted order
    tile_ends [E] int32: the same in tiles of BLOCK_M pairs (cumulative cdiv(count, BLOCK_M))
    y [P, N] in y's dtype:
        GATED (gate_up): y[p] = SiLU(a[rows[p]] @ Wg[e].T) * (a[rows[p]] @ Wu[e].T), gate
                         rows [0, N) of w[e] and up rows [UP_ROW0, UP_ROW0 + N), up's scale
                         rows from UP_S_ROW0; gate, up, SiLU(gate) and the product each
                         rounded to y's dtype, as the unfused modules
        else (down):     y[p] = a[rows[p]] @ W[e].T

    grid = (cdiv(P, BLOCK_M) + E, cdiv(N, BLOCK_N)): program (i, j) takes the i-th tile of
    the sorted pairs (expert e's tiles follow expert e - 1's; a tile holds one expert's
    pairs only), output columns [j BLOCK_N, (j + 1) BLOCK_N); programs past the last tile
    return at once (the grid is sized on the host without reading the counts)

Each K step (one scale group) adds dot(a, w.T) * ws * as_ to the fp32 accumulator, as
fp8_linear_kernel.py sums a W8A8 product. The decode kernels (lowering/moe/fp8_*_kernel.py)
stream each chosen expert once for a few pairs; here a tile of pairs shares each weight
tile, so the weights are read about once per BLOCK_M pairs of an expert.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_product(a_ptr, as_ptr, arow, m_ok, w_rows, n_ok, s_rows, K, stride_a, stride_as,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = the W8A8 product of the tile's activation rows arow
    [BLOCK_M] and the weight rows w_rows [BLOCK_N, 1] (pointers) with their scale rows
    s_rows [BLOCK_N] (pointers)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + arow.to(tl.int64)[:, None] * stride_a                   # [BLOCK_M, 1]
    sa_rows = as_ptr + arow.to(tl.int64) * stride_as                        # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + offs_k
        if EVEN_K:
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None], other=0.0)   # [BM, BK]
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)   # [BN, BK]
        else:
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(s_rows + kb, mask=n_ok, other=0.0)                         # [BLOCK_N]
        sa = tl.load(sa_rows + kb, mask=m_ok, other=0.0)                        # [BLOCK_M]
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(a, tl.trans(w))                                       # fp8 x fp8
        acc += part * ws[None, :] * sa[:, None]
    return acc


@triton.jit
def grouped_fp8_kernel(
    a_ptr, as_ptr, rows_ptr,                 # activations e4m3 [R, K], scales, rows [P]
    w_ptr, ws_ptr,                           # [E, NW, K] e4m3, scale_inv
    y_ptr,                                   # [P, N]
    starts_ptr, ends_ptr, tile_ends_ptr,     # [E] int32 each
    P, N, K, E, UP_ROW0, UP_S_ROW0,
    stride_a, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    GATED: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,   # BLOCK_K = GROUP_K
    GROUP_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    ex = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_ends_ptr + ex, mask=ex < E, other=2147483647)       # [BLOCK_E]
    e = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)     # the expert whose tiles hold it
    if e < E:
        first = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)          # e's first tile
        start = tl.load(starts_ptr + e)                                       # e's first pair
        end = tl.load(ends_ptr + e)
        pairs = start + (tile - first) * BLOCK_M + tl.arange(0, BLOCK_M)      # [BLOCK_M]
        m_ok = pairs < end
        arow = tl.load(rows_ptr + pairs, mask=m_ok, other=0)                  # [BLOCK_M]
        offs_n = n0 + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        n_ok = offs_n < N
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        s_base = ws_ptr + e.to(tl.int64) * stride_se
        acc = _tile_product(a_ptr, as_ptr, arow, m_ok, w_rows, n_ok,
                            s_base + (offs_n // GROUP_N) * stride_sn, K, stride_a, stride_as,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32)
        dt = y_ptr.dtype.element_ty
        if GATED:
            up = _tile_product(a_ptr, as_ptr, arow, m_ok, w_rows + UP_ROW0 * stride_wn, n_ok,
                               s_base + (UP_S_ROW0 + offs_n // GROUP_N) * stride_sn, K,
                               stride_a, stride_as, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32)
            g = acc.to(dt).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                     # silu(gate)
            acc = act * up.to(dt).to(tl.float32)
        y = y_ptr + pairs.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
        tl.store(y, acc.to(dt), mask=m_ok[:, None] & n_ok[None, :])
