"""A grouped GEMM for prefill-sized batches over experts' weights (or one linear's, as one
expert): the routed experts over the (token, k) pairs sorted by expert
(lowering/moe/prefill.py, lowering/moe/fp8_prefill.py), or an FP8 checkpoint's linear with
every row in one group (grouped.py's prefill_linear). W8A8 as HF's FP8Linear computes it, or
16-bit as a GEMM with fp32 accumulation.

    a [R, K] activations: 16-bit, or (W8A8) e4m3 with scales as_ [R, cdiv(K, BLOCK_K)]
        (quantized per BLOCK_K columns, act_quant_kernel); rows [P] int32: the activation
        row of sorted pair p
    w [E, NW, K]: 16-bit, or (W8A8) e4m3 with scale_inv ws [E, cdiv(NW, GROUP_N),
        cdiv(K, BLOCK_K)] fp32
    starts, ends [E] int32: where expert e's pairs begin and end in the sorted order
    tile_ends [E] int32: the same in tiles of BLOCK_M pairs (cumulative cdiv(count, BLOCK_M))
    (ONE_GROUP: one expert whose pairs are rows 0 .. P - 1 of a; rows and the tables unread)
    y [P, N] in y's dtype:
        GATED (gate_up): y[p] = SiLU(a[rows[p]] @ Wg[e].T) * (a[rows[p]] @ Wu[e].T), gate
                         rows [0, N) of w[e] and up rows [UP_ROW0, UP_ROW0 + N), up's scale
                         rows from UP_S_ROW0; gate, up, SiLU(gate) and the product each
                         rounded to y's dtype, as the unfused modules
        else (down):     y[p] = a[rows[p]] @ W[e].T

    grid = (TILES * N_BLOCKS,), TILES = cdiv(P, BLOCK_M) + E, N_BLOCKS = cdiv(N, BLOCK_N):
    a program takes tile i of the sorted pairs (expert e's tiles follow expert e - 1's; a
    tile holds one expert's pairs only) and output columns [j BLOCK_N, (j + 1) BLOCK_N);
    programs past the last tile return at once (the grid is sized on the host without
    reading the counts). Program ids walk GROUP_T tiles at every j before the next j, so
    the rows of GROUP_T tiles stay in L2 while their columns are computed, and an expert's
    tiles (consecutive) share each weight slice there.

Each program streams its [BLOCK_N, K] slice of the expert's weight once (gate and up in the
same K loop, sharing the activation tile), computing the transposed tile acc [BLOCK_N,
BLOCK_M] = W a^T, so the weight rows are the MMA's M and a tile of a few pairs fills its
N. With few pairs per expert (a prefill chunk over many experts) the GEMM is bound by the
weights' bytes, read about once per BLOCK_M pairs of an expert. W8A8: each K step (one
scale group) adds dot(w, a^T) * ws * as_ to the fp32 accumulator, as fp8_linear_kernel.py
sums a W8A8 product.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_product(acc, w_rows, kk, k_ok, n_ok, a, sa, s_ptrs,
                 EVEN_K: tl.constexpr, W8A8: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + the product of the weight rows w_rows [BLOCK_N, 1]
    (pointers) at columns kk [BLOCK_K] and the activation tile a [BLOCK_K, BLOCK_M]
    (W8A8: times the weight scales at s_ptrs [BLOCK_N] and the activations' sa [BLOCK_M])."""
    if EVEN_K:
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)       # [BN, BK]
    else:
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if DOT_F32:                  # the CPU interpreter mis-multiplies 16-bit and fp8 dots
        w = w.to(tl.float32)
    if W8A8:
        ws = tl.load(s_ptrs, mask=n_ok, other=0.0)                             # [BLOCK_N]
        acc += tl.dot(w, a) * ws[:, None] * sa[None, :]
    else:
        acc = tl.dot(w, a, acc)
    return acc


@triton.jit
def grouped_kernel(
    a_ptr, as_ptr, rows_ptr,                 # activations [R, K], (W8A8) scales, rows [P]
    w_ptr, ws_ptr,                           # [E, NW, K], (W8A8) scale_inv
    y_ptr,                                   # [P, N]
    starts_ptr, ends_ptr, tile_ends_ptr,     # [E] int32 each
    P, N, K, E, UP_ROW0, UP_S_ROW0, TILES, N_BLOCKS,
    stride_a, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    W8A8: tl.constexpr, GATED: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,                   # W8A8: the scale group along K
    GROUP_N: tl.constexpr, GROUP_T: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_GROUP: tl.constexpr,                 # one expert, rows in order: no tables read
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    in_group = GROUP_T * N_BLOCKS
    first = (pid // in_group) * GROUP_T                  # the group's first tile
    size = tl.minimum(TILES - first, GROUP_T)
    tile = first + (pid % in_group) % size
    n0 = ((pid % in_group) // size) * BLOCK_N
    if ONE_GROUP:
        e = pid * 0
    else:
        ex = tl.arange(0, BLOCK_E)
        tile_ends = tl.load(tile_ends_ptr + ex, mask=ex < E, other=2147483647)   # [BLOCK_E]
        e = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)   # the expert of these tiles
    if e < E:
        if ONE_GROUP:
            pairs = tile * BLOCK_M + tl.arange(0, BLOCK_M)                    # [BLOCK_M]
            m_ok = pairs < P
            arow = pairs
        else:
            e_tile = tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0)     # e's first tile
            start = tl.load(starts_ptr + e)                                   # e's first pair
            end = tl.load(ends_ptr + e)
            pairs = start + (tile - e_tile) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
            m_ok = pairs < end
            arow = tl.load(rows_ptr + pairs, mask=m_ok, other=0)              # [BLOCK_M]
        a_rows = a_ptr + arow.to(tl.int64)[None, :] * stride_a                # [1, BLOCK_M]
        sa_rows = as_ptr + arow.to(tl.int64) * stride_as                      # [BLOCK_M]
        offs_n = n0 + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
        n_ok = offs_n < N
        g_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        u_rows = g_rows + UP_ROW0 * stride_wn                                 # GATED only
        s_base = ws_ptr + e.to(tl.int64) * stride_se
        gs_rows = s_base + (offs_n // GROUP_N) * stride_sn                    # W8A8 only
        us_rows = s_base + (UP_S_ROW0 + offs_n // GROUP_N) * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                  # W a^T
        if GATED:
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kk = kb * BLOCK_K + tl.arange(0, BLOCK_K)                         # [BLOCK_K]
            k_ok = kk < K
            if EVEN_K:
                a = tl.load(a_rows + kk[:, None], mask=m_ok[None, :], other=0.0)   # [BK, BM]
            else:
                a = tl.load(a_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None],
                            other=0.0)
            if DOT_F32:
                a = a.to(tl.float32)
            if W8A8:
                sa = tl.load(sa_rows + kb, mask=m_ok, other=0.0)                  # [BLOCK_M]
            else:
                sa = m_ok                                                     # unused
            acc = _add_product(acc, g_rows, kk, k_ok, n_ok, a, sa, gs_rows + kb, EVEN_K,
                               W8A8, DOT_F32)
            if GATED:
                acc_u = _add_product(acc_u, u_rows, kk, k_ok, n_ok, a, sa, us_rows + kb,
                                     EVEN_K, W8A8, DOT_F32)
        dt = y_ptr.dtype.element_ty
        if GATED:
            g = acc.to(dt).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                     # silu(gate)
            acc = act * acc_u.to(dt).to(tl.float32)
        y = y_ptr + pairs.to(tl.int64)[None, :] * stride_y + offs_n[:, None]   # y^T tile
        tl.store(y, acc.to(dt), mask=m_ok[None, :] & n_ok[:, None])
