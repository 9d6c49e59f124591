"""Weight-streaming GEMM over a block-quantized fp8 weight, for a decode step's few rows:

    y = x @ dequant(w).T,   x [M, K] bf16 / fp16 / fp32, M <= 64,
    w [N, K] float8_e4m3fn with scale_inv [ceil(N / GROUP_N), ceil(K / GROUP_K)] fp32
    (DeepSeek-V3's checkpoints and HF's FineGrainedFP8: 128 x 128 blocks), y [M, N].

The numerics are those of HF's FP8Linear on a GPU (W8A8, dynamic activation scales): each
row of x is quantized per GROUP_K columns, s = amax(|x group|) / 448 and
xq = e4m3(x / max(s, 1e-12)) (here x times the correctly rounded reciprocal, rounded ties
to even: quant_act_tile), then per K block the fp8 x fp8 product is accumulated in fp32
times s * scale_inv of the weight block, and y is rounded to y's dtype.

Each program owns BLOCK_N rows of w and walks K (its split of K: below) one scale group
(BLOCK_K = GROUP_K) at a time: it loads the weight tile [BLOCK_N, BLOCK_K] (one byte per
element: half the bytes of a bf16 weight), the x tile [BLOCK_K, BLOCK_M], quantizes the x tile in registers (x is a
few KB in L2; every program quantizes it again, as HF's kernel does, which costs ALU, not
memory traffic) and adds dot(w, xq) * scale_inv[n // GROUP_N, k] * s[m] to an fp32
accumulator [BLOCK_N, BLOCK_M].

With SPLIT_K > 1 (modes 0 and 1; a runtime argument, so every split of a tile shares one
compiled kernel) program (n, s) walks only the s-th of SPLIT_K contiguous
ranges of whole scale groups (groups [s * G // SPLIT_K, (s + 1) * G // SPLIT_K) of
G = cdiv(K, BLOCK_K): sizes differ by at most one group) and stores its fp32 partial sum
in y1[s] of [SPLIT_K, M, N]; fp8_split_reduce_kernel then sums the partials in split
order, rounds once to the output's dtype and applies the epilogue (the residual add, or
gate and up to SiLU(gate) x up). Each activation group is quantized as without splits,
so only the order of the fp32 sum changes. A short weight (q_a + kv_a: 2112 rows) or a
long K (o_proj, down_proj) otherwise leaves the SMs a few long serial streams.

MODE picks what the programs compute, as in linear_kernel.py:
    0  one weight:         y1 = x @ w1.T; with HAS_RES: y1 = r + x @ w1.T, the product
                           rounded to y's dtype before the add (HF's residual add)
    1  two weights:        y1 = x @ w1.T, y2 = x @ w2.T in one launch (q_a_proj +
                           kv_a_proj_with_mqa); programs [0, N1_BLOCKS) stream w1, the rest w2
    2  gated (SwiGLU) up:  y1 = silu(x @ w1.T) * (x @ w2.T) (gate_proj, up_proj), rounded
                           as the unfused modules: gate, silu(gate), up and the product
                           each to y's dtype (no split-K: split, gate and up run as mode
                           1's pair into partials [SPLIT_K, M, 2N] and the reduce gates)
DOT_F32 (the CPU interpreter) multiplies in fp32: fp8 x fp8 products are exact there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3


@triton.jit
def quant_act_tile(x, fp8_ptr, NATIVE_CAST: tl.constexpr):
    """x [BLOCK_K, BLOCK_M] fp32 -> (e4m3 values [BLOCK_K, BLOCK_M], s [BLOCK_M]): one scale
    per row of the step (a column of the tile), s = amax / 448, unfloored (a zero group
    then contributes zero); x times the correctly rounded reciprocal of max(s, 1e-12)
    (HF's kernel divides with the GPU's approximate division: both lie within an ulp of
    x / s), saturated to +-448 and rounded to e4m3, ties to even. NATIVE_CAST: the
    hardware's conversion (exact here: the value is in range); else by bit arithmetic
    (the CPU interpreter's cast does not carry into the exponent)."""
    amax = tl.max(tl.abs(x), axis=0)                                           # [BLOCK_M]
    s = div_rn(amax, amax * 0.0 + FP8_MAX)
    r = div_rn(s * 0.0 + 1.0, tl.maximum(s, 1e-12))                            # [BLOCK_M]
    q = tl.clamp(x * r[None, :], -FP8_MAX, FP8_MAX)
    if NATIVE_CAST:
        return q.to(fp8_ptr.dtype.element_ty), s
    return to_e4m3(q, fp8_ptr), s


@triton.jit
def quantize_row(y, yq_row, ys_row, offs, mask, G, QUANT_K: tl.constexpr,
                 BLOCK: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """Store one activation row y [BLOCK] (fp32 holding the row's 16-bit values, zeros past
    its end) quantized per QUANT_K columns by quant_act_tile: e4m3 at yq_row + offs (where
    mask) and its G scales at ys_row. For the kernels that produce an fp8 GEMM's input
    (the norms, the attention prologue), which hold the row in registers."""
    GP: tl.constexpr = BLOCK // QUANT_K
    groups = tl.trans(tl.reshape(y, (GP, QUANT_K)))                       # [QUANT_K, GP]
    q, sc = quant_act_tile(groups, yq_row, NATIVE_CAST)                 # [QUANT_K, GP], [GP]
    tl.store(yq_row + offs, tl.reshape(tl.trans(q), (BLOCK,)), mask=mask)
    g = tl.arange(0, GP)
    tl.store(ys_row + g, sc, mask=g < G)


@triton.jit
def act_quant_kernel(x_ptr, xq_ptr, xs_ptr, K, stride_x, GROUPS,
                     BLOCK_K: tl.constexpr, NATIVE_CAST: tl.constexpr):
    """x [M, K] -> xq [M, K] e4m3 and xs [M, GROUPS] fp32 by quant_act_tile, one program per
    (row, scale group): the activations of a PRE_Q launch, quantized once for all its
    programs (bit for bit what each program would compute)."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * BLOCK_K + tl.arange(0, BLOCK_K)                                 # [BLOCK_K]
    ok = offs < K
    x = tl.load(x_ptr + m * stride_x + offs[:, None], mask=ok[:, None], other=0.0)
    q, s = quant_act_tile(x.to(tl.float32), xq_ptr, NATIVE_CAST)       # [BLOCK_K, 1], [1]
    tl.store(xq_ptr + m * K + offs[:, None], q, mask=ok[:, None])
    tl.store(xs_ptr + m * GROUPS + g + tl.arange(0, 1), s)


@triton.jit
def _stream_fp8_rows(x_ptr, w_ptr, s_ptr, n0, M, N, K, stride_xm, stride_wn, stride_sn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_N: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                     SPLIT_K=1, xs_ptr=None, stride_xs=0, PRE_Q: tl.constexpr = False):
    """acc [BLOCK_N, BLOCK_M] = dequant(w[n0 : n0 + BLOCK_N]) @ quant(x).T in fp32, over
    this program's range of scale groups (all of K when SPLIT_K is 1). PRE_Q: x is
    already quantized (act_quant_kernel: e4m3 [M, K] and its scales xs [M, groups])."""
    groups = tl.cdiv(K, BLOCK_K)
    split = tl.program_id(1)
    g0 = split * groups // SPLIT_K
    g1 = (split + 1) * groups // SPLIT_K
    offs_n = n0 + tl.arange(0, BLOCK_N)                                        # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)                                             # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    n_ok = offs_n < N
    m_ok = offs_m < M
    k0 = g0 * BLOCK_K
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]              # [BK, BM]
    s_ptrs = s_ptr + (offs_n // GROUP_N) * stride_sn                             # [BLOCK_N]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(g0, g1):                                     # k: the scale group
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        ws = tl.load(s_ptrs + k, mask=n_ok, other=0.0)                        # [BLOCK_N]
        if PRE_Q:
            xq = x                                                   # [BLOCK_K, BLOCK_M] e4m3
            xs = tl.load(xs_ptr + offs_m * stride_xs + k, mask=m_ok, other=0.0)  # [BLOCK_M]
        else:
            xq, xs = quant_act_tile(x.to(tl.float32), w_ptr, not DOT_F32)
        if DOT_F32:
            part = tl.dot(w.to(tl.float32), xq.to(tl.float32))
        else:
            part = tl.dot(w, xq)                                               # fp8 x fp8 -> fp32
        acc += part * ws[:, None] * xs[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_rows(y_ptr, acc, n0, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                r_ptr=None, stride_rm=0, HAS_RES: tl.constexpr = False, stride_ys=0):
    """y[:, n0 : n0 + BLOCK_N] = acc.T in y's dtype (in partial program_id(1) when
    stride_ys, the stride between partials, is given); with HAS_RES, plus r's tile (acc
    rounded to y's dtype first, the sum rounded again)."""
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
def fp8_linear_kernel(
    x_ptr, w1_ptr, s1_ptr, w2_ptr, s2_ptr, y1_ptr, y2_ptr,   # x [M, K]; w [N, K] e4m3;
                                                             # s [N/GN, K/GK]; y [M, N]
    r_ptr,                                                   # HAS_RES: residual [M, N1]
    M, N1, N2, K,
    stride_xm, stride_w1, stride_s1, stride_w2, stride_s2, stride_y1, stride_y2, stride_r,
    N1_BLOCKS,                                               # cdiv(N1, BLOCK_N)
    stride_ys,                                               # SPLIT_K > 1: between partials
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, HAS_RES: tl.constexpr,
    Y2_COL0: tl.constexpr,                   # > 0: MODE 1 writes x @ w2.T into y1 from this
                                             # column on (one output tensor; y2_ptr unused)
    SPLIT_K,                                 # grid axis 1 (MODE 0 / 1; > 1: fp32 partials)
    xs_ptr, stride_xs,                       # PRE_Q: x's scales [M, cdiv(K, BLOCK_K)]
    PRE_Q: tl.constexpr,                     # x is e4m3, quantized by act_quant_kernel
):
    pid = tl.program_id(0)
    if MODE == 0:
        n0 = pid * BLOCK_N
        acc = _stream_fp8_rows(x_ptr, w1_ptr, s1_ptr, n0, M, N1, K, stride_xm, stride_w1,
                               stride_s1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EVEN_K, DOT_F32,
                               SPLIT_K, xs_ptr, stride_xs, PRE_Q)
        _store_rows(y1_ptr, acc, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N, r_ptr, stride_r,
                    HAS_RES, stride_ys)
    elif MODE == 1:
        if pid < N1_BLOCKS:
            n0 = pid * BLOCK_N
            acc = _stream_fp8_rows(x_ptr, w1_ptr, s1_ptr, n0, M, N1, K, stride_xm, stride_w1,
                                   stride_s1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EVEN_K,
                                   DOT_F32, SPLIT_K, xs_ptr, stride_xs, PRE_Q)
            _store_rows(y1_ptr, acc, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N, stride_ys=stride_ys)
        else:
            n0 = (pid - N1_BLOCKS) * BLOCK_N
            acc = _stream_fp8_rows(x_ptr, w2_ptr, s2_ptr, n0, M, N2, K, stride_xm, stride_w2,
                                   stride_s2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EVEN_K,
                                   DOT_F32, SPLIT_K, xs_ptr, stride_xs, PRE_Q)
            if Y2_COL0 > 0:
                _store_rows(y1_ptr + Y2_COL0, acc, n0, M, N2, stride_y1, BLOCK_M, BLOCK_N,
                            stride_ys=stride_ys)
            else:
                _store_rows(y2_ptr, acc, n0, M, N2, stride_y2, BLOCK_M, BLOCK_N,
                            stride_ys=stride_ys)
    else:
        n0 = pid * BLOCK_N
        acc_g = _stream_fp8_rows(x_ptr, w1_ptr, s1_ptr, n0, M, N1, K, stride_xm, stride_w1,
                                 stride_s1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EVEN_K, DOT_F32,
                                 1, xs_ptr, stride_xs, PRE_Q)
        acc_u = _stream_fp8_rows(x_ptr, w2_ptr, s2_ptr, n0, M, N1, K, stride_xm, stride_w2,
                                 stride_s2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EVEN_K, DOT_F32,
                                 1, xs_ptr, stride_xs, PRE_Q)
        dt = y1_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # silu(gate)
        up = acc_u.to(dt).to(tl.float32)
        _store_rows(y1_ptr, act * up, n0, M, N1, stride_y1, BLOCK_M, BLOCK_N)


@triton.jit
def fp8_split_reduce_kernel(
    p_ptr,                          # fp32 partials [SPLIT_K, M, NP] (last dim contiguous)
    y1_ptr, y2_ptr,                 # y1 [M, N1]; EPILOGUE 3: y2 [M, NP - N1]
    r_ptr,                          # EPILOGUE 1: the residual [M, N1]
    M, N1, NP,
    stride_ps, stride_pm, stride_y1, stride_y2, stride_r,
    SPLIT_K: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK: tl.constexpr,
):
    """The sum of the partials in split order (fp32; the splits unrolled, so their loads
    are in flight together), rounded once to y's dtype, then by
    EPILOGUE: 0 y1 = the sum (N1 = NP); 1 y1 = the sum plus the residual (rounded again:
    HF's `residual + linear(x)`); 2 gated: columns [0, N1) hold gate's partials and
    [N1, 2 N1) up's, y1 = silu(gate) * up rounded as the unfused modules; 3 two outputs:
    y1 = the sum's columns [0, N1), y2 the rest. Program (m, j) covers row m, output
    columns [j * BLOCK, (j + 1) * BLOCK) (of the sum for EPILOGUE 3, else of y1)."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                      # [BLOCK]
    ok = offs < (NP if EPILOGUE == 3 else N1)
    row = p_ptr + m.to(tl.int64) * stride_pm + offs
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(row + s * stride_ps, mask=ok, other=0.0)
    dt = y1_ptr.dtype.element_ty
    y1 = y1_ptr + m.to(tl.int64) * stride_y1 + offs
    if EPILOGUE == 0:
        tl.store(y1, acc.to(dt), mask=ok)
    elif EPILOGUE == 1:
        r = tl.load(r_ptr + m.to(tl.int64) * stride_r + offs, mask=ok, other=0.0)
        tl.store(y1, (acc.to(dt).to(tl.float32) + r.to(tl.float32)).to(dt), mask=ok)
    elif EPILOGUE == 2:
        up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            up += tl.load(row + N1 + s * stride_ps, mask=ok, other=0.0)
        g = acc.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # silu(gate)
        tl.store(y1, (act * up.to(dt).to(tl.float32)).to(dt), mask=ok)
    else:
        tl.store(y1, acc.to(dt), mask=ok & (offs < N1))
        y2 = y2_ptr + m.to(tl.int64) * stride_y2 + (offs - N1)
        tl.store(y2, acc.to(y2_ptr.dtype.element_ty), mask=ok & (offs >= N1))
