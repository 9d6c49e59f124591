"""Weight-streaming GEMM for the few rows of a decode step: y = x @ w.T, M <= 64.

    x [M, K], w [N, K] (an nn.Linear weight, K contiguous), y [M, N]; fp32 accumulation.

At decode batch sizes every weight byte is read once and used M times, so the GEMM is a
copy of w through the SMs. Each program owns BLOCK_N rows of w and walks K in BLOCK_K
tiles, multiplying the w tile by the x tile transposed ([BLOCK_N, BLOCK_K] x
[BLOCK_K, BLOCK_M]: the weight is the tall operand) into an fp32 [BLOCK_N, BLOCK_M]
accumulator. With SPLIT_K > 1 (modes 0 and 1) program (n, s) covers only the s-th of
SPLIT_K equal ranges of K and writes its fp32 partial sum to y[s]; the caller adds the
partials (in a graph, Inductor fuses that sum into the consumer of y). A small weight
(q_a + kv_a: 2112 rows) otherwise leaves each SM one long serial stream.

MODE picks what the programs compute (the fusions of a DeepSeek layer's decode step):
    0  one weight:         y1 = x @ w1.T                              (o_proj, down_proj)
                           with HAS_RES (no split-K): y1 = r + x @ w1.T, the product
                           rounded to y's dtype before the add (the decoder layer's
                           residual add, as HF rounds it)
    1  two weights:        y1 = x @ w1.T, y2 = x @ w2.T in one launch (q_a_proj + kv_a_proj);
                           programs [0, N1_BLOCKS) stream w1, the rest w2
    2  gated (SwiGLU) up:  y1 = silu(x @ w1.T) * (x @ w2.T), w1 and w2 both [N, K]
                           (gate_proj, up_proj); each program streams the same rows of both
                           and rounds like the unfused modules: gate, silu(gate), up and the
                           product each to y's dtype
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _stream_rows(x_ptr, w_ptr, n0, M, N, K, stride_xm, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, SPLIT_K: tl.constexpr = 1):
    """acc [BLOCK_N, BLOCK_M] = w[n0 : n0 + BLOCK_N] @ x.T (fp32), over this program's
    range of K (all of it unless SPLIT_K > 1)."""
    k_tiles = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K)             # K tiles per split
    k0 = tl.program_id(1) * k_tiles * BLOCK_K if SPLIT_K > 1 else 0
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)                                             # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]   # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]               # [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, k_tiles):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0 - k * BLOCK_K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w, x, acc)                                            # [BLOCK_N, BLOCK_M]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_rows(y_ptr, acc, n0, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                stride_ys=0, r_ptr=None, stride_rm=0, HAS_RES: tl.constexpr = False):
    """y[:, n0 : n0 + BLOCK_N] = acc.T in y's dtype (of split program_id(1) when
    stride_ys, the stride between the partials, is given); with HAS_RES, plus r's tile
    (acc rounded to y's dtype first, the sum rounded again)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    dt = y_ptr.dtype.element_ty
    y_ptr += tl.program_id(1).to(tl.int64) * stride_ys
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]            # y.T tile
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=mask, other=0.0)
        tl.store(y_ptrs, (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt), mask=mask)
    else:
        tl.store(y_ptrs, acc.to(dt), mask=mask)


@triton.jit
def decode_linear_kernel(
    x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr,    # x [M, K]; w1 [N1, K], w2 [N2, K]; y1 [M, N1], y2 [M, N2]
    M, N1, N2, K,
    stride_xm, stride_w1, stride_w2, stride_y1, stride_y2,
    stride_ys,                                # SPLIT_K > 1: stride between y's partials
    N1_BLOCKS,                                # cdiv(N1, BLOCK_N)
    r_ptr, stride_r,                          # HAS_RES: the residual [M, N1] (MODE 0)
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    SPLIT_K: tl.constexpr,                    # grid axis 1 (1 for MODE 2)
    Y2_COL0: tl.constexpr,                    # > 0: MODE 1 writes x @ w2.T into y1 from this
                                              # column on (y2_ptr unused: one output tensor)
    HAS_RES: tl.constexpr,                    # MODE 0 without split-K: y1 = r + x @ w1.T
):
    pid = tl.program_id(0)
    if MODE == 0:
        n0 = pid * BLOCK_N
        acc = _stream_rows(x_ptr, w1_ptr, n0, M, N1, K, stride_xm, stride_w1,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, SPLIT_K)
        _store_rows(y1_ptr, acc, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N, stride_ys,
                    r_ptr, stride_r, HAS_RES)
    elif MODE == 1:
        if pid < N1_BLOCKS:
            n0 = pid * BLOCK_N
            acc = _stream_rows(x_ptr, w1_ptr, n0, M, N1, K, stride_xm, stride_w1,
                               BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, SPLIT_K)
            _store_rows(y1_ptr, acc, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N, stride_ys)
        else:
            n0 = (pid - N1_BLOCKS) * BLOCK_N
            acc = _stream_rows(x_ptr, w2_ptr, n0, M, N2, K, stride_xm, stride_w2,
                               BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, SPLIT_K)
            if Y2_COL0 > 0:
                _store_rows(y1_ptr + Y2_COL0, acc, n0, M, N2, stride_y1, BLOCK_M, BLOCK_N,
                            stride_ys)
            else:
                _store_rows(y2_ptr, acc, n0, M, N2, stride_y2, BLOCK_M, BLOCK_N, stride_ys)
    else:
        # gate and up rows n0 : n0 + BLOCK_N, interleaved tile by tile
        n0 = pid * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N1
        m_ok = offs_m < M
        w_off = offs_n.to(tl.int64)[:, None] * stride_w1 + offs_k[None, :]      # [BLOCK_N, BLOCK_K]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]         # [BLOCK_K, BLOCK_M]
        g_ptrs = w1_ptr + w_off
        u_ptrs = w2_ptr + w_off
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                wg = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = offs_k < K - k * BLOCK_K
                wg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:
                acc_g = tl.dot(wg.to(tl.float32), x.to(tl.float32), acc_g)
                acc_u = tl.dot(wu.to(tl.float32), x.to(tl.float32), acc_u)
            else:
                acc_g = tl.dot(wg, x, acc_g)
                acc_u = tl.dot(wu, x, acc_u)
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        dt = y1_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # silu(gate)
        up = acc_u.to(dt).to(tl.float32)
        _store_rows(y1_ptr, act * up, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N)
