"""A decode step's whole query path after q_a_layernorm, one program per (head, row block):

    q_a [T, Q], w [N * (P + R), Q] (q_b_proj.weight), W_UK_T [N, P, L], cos / sin [T, R]
    q_h     = q_a @ w[h * (P + R) : (h + 1) * (P + R)].T     rounded to y's dtype  (q_b_proj)
    y[:, h] = [q_h[:, :P] @ W_UK_T[h] | RoPE(q_h[:, P:])]    [T, L + R]      (absorbed query)

Unfused, these are three launches with two round trips of the query through memory: q_b's
GEMM, the query's RoPE and the absorbed GEMM. Here program h streams head h's P + R rows
of w (Q contiguous values each) in BLOCK_K steps, keeps q_h in registers, then streams
W_UK_T[h] in BLOCK_L column blocks; the weight is the tall operand of every dot, as in
linear_kernel.py ([rows of w, BLOCK_K] x [BLOCK_K, BLOCK_T] into fp32).

The rope rows are loaded in the order RoPE pairs them up: first the R/2 rows x1, then
their partners x2 (rows P + 2j and P + 2j + 1 with ROPE 1, DeepSeek-V3's pairs, whose
output is HF's de-interleaved order, and ROPE 2, DeepSeek-V2's complex pairs, written back
in place; rows P + j and P + R/2 + j with ROPE 0, rotate_half), so after the loop the two
halves of the [R, BLOCK_T] accumulator are the rotation's operands (cos / sin: HF's rows
[T, R] for ROPE 0 / 1, V2's freqs_cis parts [T, R/2] for 2, whose pair j reads column j). (Two
separate [R/2, BLOCK_K] dots for x1 and x2 miscompiled on Triton 3.6 / H200 at some
configs: wrong q_nope. One [R, BLOCK_K] dot does not.)
Roundings follow the unfused ops: q_h to q_a's dtype (q_b's output), the absorbed GEMM in
fp32 rounded once, RoPE in fp32 rounded once (q_rope_kernel.py's `rotate`). With QUANT
(y float8_e4m3fn, an fp8 decode query) each value rounded so is then quantized as a static
fp8 quant does it: fp8(clamp(v / scale, -448, 448)), the division correctly rounded.

W8A8 (an FP8 checkpoint's q_b_proj: w float8_e4m3fn with fp32 scale_inv ws [N * (P + R) /
GROUP_N, Q / BLOCK_K] per block): q_a arrives quantized per BLOCK_K (= the scale group)
columns, a_ptr its e4m3 rows and xs_ptr its scales [T, Q / BLOCK_K] (the prologue's
mla::decode_qkv_prologue_fp8), and each K step adds dot(w, a) * ws[row's block, k] *
xs[t, k] to the fp32 accumulators, as the fp8 decode GEMM (fp8_linear_kernel.py) sums
HF's W8A8 product; the rest is the same.

    grid = (N, cdiv(T, BLOCK_T))
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3
from lowering.fused.q_rope_kernel import rotate


@triton.jit
def _out(v, scale, y_ptr, QUANT: tl.constexpr):
    """v (rounded to q_a's dtype) as stored: itself, or with QUANT quantized to e4m3 as
    the static quant kernel does (fp32 division rounded to nearest, clamp, e4m3 grid)."""
    out = v
    if QUANT:
        x = v.to(tl.float32)
        out = to_e4m3(tl.clamp(div_rn(x, scale + tl.zeros_like(x)), -FP8_MAX, FP8_MAX), y_ptr)
    return out


@triton.jit
def rope_rows(R: tl.constexpr, ROPE: tl.constexpr):
    """[R] offsets of a head's rope rows in the order RoPE pairs them: x1 then x2 (rows j
    then H + j for rotate_half; 2j then 2j + 1 for the interleaved and complex pairs)."""
    H: tl.constexpr = R // 2
    rr = tl.arange(0, R)
    if ROPE == 0:
        return rr
    return tl.where(rr < H, 2 * rr, 2 * (rr - H) + 1)


@triton.jit
def q_absorb_kernel(
    a_ptr,                     # q_a [T, Q] rows, stride stride_at (last dim contiguous)
                               # (W8A8: its e4m3 quantization)
    w_ptr,                     # q_b weight [N * (P + R), Q] contiguous (W8A8: e4m3)
    wuk_ptr,                   # W_UK_T [N, P, L] contiguous, in q_a's dtype
    cos_ptr, sin_ptr,          # [T, R] rows, stride stride_cs (last dim contiguous)
    y_ptr,                     # [T, N, L + R] contiguous: q_a's dtype, or e4m3 with QUANT
    scale_ptr,                 # [1] fp32 (QUANT: the fp8 query's static scale)
    T, N, stride_at, stride_cs,
    Q: tl.constexpr, P: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    ROPE: tl.constexpr, DOT_F32: tl.constexpr, QUANT: tl.constexpr,
    ws_ptr, xs_ptr,            # W8A8: w's scale_inv (row stride Q / BLOCK_K), q_a's scales
    W8A8: tl.constexpr, GROUP_N: tl.constexpr,
):
    dt: tl.constexpr = wuk_ptr.dtype.element_ty   # q_a's dtype: every rounding before the quant
    scale = 1.0
    if QUANT:
        scale = tl.load(scale_ptr)
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)               # [BLOCK_T]
    r_ok = rows < T
    k = tl.arange(0, BLOCK_K)
    p = tl.arange(0, P)
    ir = rope_rows(R, ROPE)          # the rope rows in RoPE's pair order

    # q_b: q_h^T = w_h [P + R, Q] @ q_a^T [Q, BLOCK_T], as nope and rope row blocks
    w_head = w_ptr + h.to(tl.int64) * (P + R) * Q
    wn_ptrs = w_head + p[:, None] * Q + k[None, :]                          # [P, BLOCK_K]
    wr_ptrs = w_head + (P + ir)[:, None] * Q + k[None, :]                   # [R, BLOCK_K]
    a_ptrs = a_ptr + rows.to(tl.int64)[None, :] * stride_at + k[:, None]   # [BLOCK_K, BLOCK_T]
    acc_n = tl.zeros((P, BLOCK_T), dtype=tl.float32)
    acc_r = tl.zeros((R, BLOCK_T), dtype=tl.float32)
    if W8A8:         # each row's scale block, and q_a's scales, per K step (= scale group)
        KG: tl.constexpr = Q // BLOCK_K
        sn_ptrs = ws_ptr + ((h * (P + R) + p) // GROUP_N) * KG                  # [P]
        sr_ptrs = ws_ptr + ((h * (P + R) + P + ir) // GROUP_N) * KG             # [R]
        xs_ptrs = xs_ptr + rows.to(tl.int64) * KG                               # [BLOCK_T]
    for k in range(0, Q // BLOCK_K):
        a = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        wn = tl.load(wn_ptrs)
        wr = tl.load(wr_ptrs)
        if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots (fp8: exact)
            a, wn, wr = a.to(tl.float32), wn.to(tl.float32), wr.to(tl.float32)
        if W8A8:         # fp8 x fp8 -> fp32, times both scales (fp8_linear_kernel's sum)
            xs = tl.load(xs_ptrs + k, mask=r_ok, other=0.0)[None, :]            # [1, BLOCK_T]
            acc_n += tl.dot(wn, a) * tl.load(sn_ptrs + k)[:, None] * xs         # [P, BLOCK_T]
            acc_r += tl.dot(wr, a) * tl.load(sr_ptrs + k)[:, None] * xs         # [R, BLOCK_T]
        else:
            acc_n = tl.dot(wn, a, acc_n)                                     # [P, BLOCK_T]
            acc_r = tl.dot(wr, a, acc_r)                                     # [R, BLOCK_T]
        a_ptrs += BLOCK_K
        wn_ptrs += BLOCK_K
        wr_ptrs += BLOCK_K

    absorb_rope_store(acc_n, acc_r, h, rows, r_ok, wuk_ptr, cos_ptr, sin_ptr, y_ptr, scale,
                      N, stride_cs, 0, L, True, P, R, L, BLOCK_T, BLOCK_L, ROPE, DOT_F32,
                      QUANT, dt)


@triton.jit
def absorb_rope_store(acc_n, acc_r, h, rows, r_ok, wuk_ptr, cos_ptr, sin_ptr, y_ptr, scale,
                      N, stride_cs, l_lo, l_hi, do_rope,
                      P: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, ROPE: tl.constexpr,
                      DOT_F32: tl.constexpr, QUANT: tl.constexpr, dt: tl.constexpr):
    """Head h's query from its fp32 rows, nope acc_n [P, BLOCK_T] and rope acc_r
    [R, BLOCK_T] (in RoPE's pair order: x1 then x2), into y [T, N, L + R]: both rounded to
    dt (q's own rounding), [nope @ W_UK_T[h] (fp32, rounded once) | RoPE(rope) (fp32,
    rounded once)], each value as _out stores it. rows / r_ok [BLOCK_T]: the tokens;
    only the absorbed columns [l_lo, l_hi) (multiples of BLOCK_L), and the rope columns
    where do_rope."""
    H: tl.constexpr = R // 2
    p = tl.arange(0, P)
    j = tl.arange(0, H)
    c2 = H + j if ROPE == 0 else j
    # absorbed: y[t, h, :L]^T = W_UK_T[h]^T [L, P] @ q_nope^T [P, BLOCK_T]
    qn = acc_n.to(dt)                                                        # q's rounding
    if DOT_F32:
        qn = qn.to(tl.float32)
    y_row = y_ptr + rows.to(tl.int64) * (N * (L + R)) + h * (L + R)         # [BLOCK_T]
    l = tl.arange(0, BLOCK_L)
    wuk_ptrs = wuk_ptr + h.to(tl.int64) * P * L + p[None, :] * L + l[:, None]   # [BLOCK_L, P]
    for l0 in range(l_lo, l_hi, BLOCK_L):
        wuk = tl.load(wuk_ptrs + l0)
        if DOT_F32:
            wuk = wuk.to(tl.float32)
        o = tl.dot(wuk, qn)                                                  # [BLOCK_L, BLOCK_T]
        tl.store(y_row[None, :] + (l0 + l)[:, None], _out(o.to(dt), scale, y_ptr, QUANT),
                 mask=r_ok[None, :])

    # RoPE of the rope rows, after q's rounding
    if do_rope:
        xr = acc_r.to(dt).to(tl.float32).reshape(2, H, BLOCK_T)             # [x1; x2]
        x1, x2 = tl.split(tl.permute(xr, (1, 2, 0)))                         # [H, BLOCK_T] each
        cs = rows.to(tl.int64)[None, :] * stride_cs
        m = r_ok[None, :]
        cos1 = tl.load(cos_ptr + cs + j[:, None], mask=m, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs + j[:, None], mask=m, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs + c2[:, None], mask=m, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs + c2[:, None], mask=m, other=0.0).to(tl.float32)
        o1, o2 = rotate(x1, x2, cos1, sin1, cos2, sin2, dt)
        if ROPE == 2:                # V2: each pair back in its place
            d1, d2 = 2 * j, 2 * j + 1
        else:
            d1, d2 = j, H + j
        tl.store(y_row[None, :] + L + d1[:, None], _out(o1, scale, y_ptr, QUANT), mask=m)
        tl.store(y_row[None, :] + L + d2[:, None], _out(o2, scale, y_ptr, QUANT), mask=m)
