"""The attention prologue of a DeepSeek decode step, after the GEMM that produces the query
input and the cache row: program 0 of a token makes the cache row, programs 1.. its query.

    part [SPLIT, T, NQ + L + R]  fp32 split-K partial sums of [q | kv_c | k_pe]
    kv_out [T, L + R]  = [rms_norm(kv_c) * w_kv | rope(k_pe)]      (the cache row)
    Q_ROPE False (V3, q = q_a):        q_out [T, NQ] = rms_norm(q_a) * w_q   (q_a_layernorm)
    Q_ROPE True  (V2, q = q_proj's):   q_out [T, NH, HW] = q with RoPE on the last R columns
                                       of each of its NH heads (HW = NQ / NH = P + R)

    grid = (T, 2) for V3; (T, 1 + cdiv(NH, HEADS)) for V2, HEADS query heads per program

    QUANT_K > 0 (V3 with an fp8 q_b_proj): q_out also quantized per QUANT_K columns as the
    fp8 decode GEMMs quantize their activations (quant_act_tile), into qq [T, NQ] e4m3 and
    qs [T, cdiv(NQ, QUANT_K)] fp32, which q_b's GEMM then reads

It replaces the partial sums, the norms, both RoPEs and the cat of the unfused graph (for
V2 about ten small kernels, its complex-number RoPE among them). Each sum is rounded to
the activation dtype first (the GEMM's output); the norms round as HF's RMSNorm does
(x * rsqrt(mean(x^2) + eps) before the weight multiply); RoPE runs in fp32 and rounds
once, as Inductor computes HF's RoPE (and as V2's complex multiply does).

RoPE (R even, H = R / 2), by ROPE:
    0 rotate_half:          x1 = x[:H],    x2 = x[H:]       out = [o1 | o2]
    1 interleaved (V3):     x1 = x[0::2],  x2 = x[1::2]     out = [o1 | o2]  (HF's order)
    2 complex (V2):         x1 = x[0::2],  x2 = x[1::2]     out[0::2] = o1, out[1::2] = o2
    o1 = x1 * cos1 - x2 * sin1,   o2 = x2 * cos2 + x1 * sin2
with cos1 / sin1 = cos / sin[:H] and cos2 / sin2 = cos / sin[H:] for rotate_half (HF's rows
cat(freqs, freqs) * scaling, [T, R]); the pairs' angles cos / sin[:H] otherwise (for V2 the
real and imaginary parts of its freqs_cis, [T, R / 2], in fp32).
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.q_rope_kernel import rotate
from lowering.gemm.fp8_linear_kernel import quantize_row


@triton.jit
def _row_sum(ptr, offs, mask, stride_split, SPLIT: tl.constexpr):
    """The fp32 sum over the SPLIT partials of ptr[offs] (0 where masked)."""
    acc = tl.load(ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ptr + s * stride_split + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _rms_norm(x, w_ptr, offs, mask, n, eps, dt):
    """HF's RMSNorm of one row x (fp32 holding dtype-dt values, 0 where masked)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # issued before the sum
    var = tl.sum(x * x, axis=0) / n
    y = (x * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    return (w * y).to(dt)


@triton.jit
def _rope(src, dst, cols, ok, cos_row, sin_row, stride_cc, stride_split, dt,
          SPLIT: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr):
    """RoPE of the R-wide rope parts that start at columns cols [HB] of the partials row src,
    written at the same columns of the output row dst (ok [HB]: which parts are real)."""
    H: tl.constexpr = R // 2
    j = tl.arange(0, BLOCK_H)
    mh = j < H
    if ROPE == 0:
        i1, i2, c2 = j, H + j, H + j
    else:                                             # the pairs (2j, 2j + 1), angle j
        i1, i2, c2 = 2 * j, 2 * j + 1, j
    m = ok[:, None] & mh[None, :]                                         # [HB, BLOCK_H]
    x1 = _row_sum(src, cols[:, None] + i1[None, :], m, stride_split, SPLIT).to(dt).to(tl.float32)
    x2 = _row_sum(src, cols[:, None] + i2[None, :], m, stride_split, SPLIT).to(dt).to(tl.float32)
    cos1 = tl.load(cos_row + j * stride_cc, mask=mh, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + j * stride_cc, mask=mh, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + c2 * stride_cc, mask=mh, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + c2 * stride_cc, mask=mh, other=0.0).to(tl.float32)[None, :]
    o1, o2 = rotate(x1, x2, cos1, sin1, cos2, sin2, dt)
    if ROPE == 2:
        d1, d2 = i1, i2
    else:
        d1, d2 = j, H + j
    tl.store(dst + cols[:, None] + d1[None, :], o1, mask=m)
    tl.store(dst + cols[:, None] + d2[None, :], o2, mask=m)


@triton.jit
def qkv_prologue_kernel(
    part_ptr,                  # [SPLIT, T, NQ + L + R] fp32, contiguous
    wq_ptr, wkv_ptr,           # [NQ] (unused with Q_ROPE), [L]: the norms' weights
    cos_ptr, sin_ptr,          # [T, R] or [T, R / 2] rows, strides (stride_cs, stride_cc)
    q_out_ptr,                 # [T, NQ]
    kv_out_ptr,                # [T, L + R]
    qq_ptr, qs_ptr,            # QUANT_K > 0: [T, NQ] e4m3, [T, QG] fp32
    stride_split, stride_cs, stride_cc, eps_q, eps_kv,
    SPLIT: tl.constexpr, NQ: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr, Q_ROPE: tl.constexpr,
    NH: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr,
    QUANT_K: tl.constexpr, QG: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    t = tl.program_id(0)
    pid = tl.program_id(1)
    dt = q_out_ptr.dtype.element_ty
    row = part_ptr + t.to(tl.int64) * (NQ + L + R)
    q_row = q_out_ptr + t.to(tl.int64) * NQ
    cos_row = cos_ptr + t.to(tl.int64) * stride_cs
    sin_row = sin_ptr + t.to(tl.int64) * stride_cs
    if pid == 0:
        # kv_c -> kv_a_layernorm, into the row's first L columns
        out = kv_out_ptr + t.to(tl.int64) * (L + R)
        ol = tl.arange(0, BLOCK_L)
        ml = ol < L
        kv = _row_sum(row + NQ, ol, ml, stride_split, SPLIT).to(dt).to(tl.float32)  # [BLOCK_L]
        tl.store(out + ol, _rms_norm(kv, wkv_ptr, ol, ml, L, eps_kv, dt), mask=ml)
        # k_pe -> RoPE, into the last R columns
        one = tl.full([1], 0, tl.int32)
        _rope(row + NQ + L, out + L, one, one == 0, cos_row, sin_row, stride_cc, stride_split, dt,
              SPLIT, R, BLOCK_H, ROPE)
    elif Q_ROPE:
        # heads [h0, h0 + HEADS) of q: the first P columns copied (rounded), RoPE on the rest
        HW: tl.constexpr = NQ // NH
        P: tl.constexpr = HW - R
        h = (pid - 1) * HEADS + tl.arange(0, HEADS)                       # [HEADS]
        ok = h < NH
        p = tl.arange(0, BLOCK_P)
        offs = h[:, None] * HW + p[None, :]                               # [HEADS, BLOCK_P]
        m = ok[:, None] & (p < P)[None, :]
        tl.store(q_row + offs, _row_sum(row, offs, m, stride_split, SPLIT).to(dt), mask=m)
        _rope(row, q_row, h * HW + P, ok, cos_row, sin_row, stride_cc, stride_split, dt,
              SPLIT, R, BLOCK_H, ROPE)
    else:
        # q_a -> q_a_layernorm
        oq = tl.arange(0, BLOCK_Q)
        mq = oq < NQ
        x = _row_sum(row, oq, mq, stride_split, SPLIT).to(dt).to(tl.float32)  # [BLOCK_Q]
        y = _rms_norm(x, wq_ptr, oq, mq, NQ, eps_q, dt)                   # [BLOCK_Q], 0 past NQ
        tl.store(q_row + oq, y, mask=mq)
        if QUANT_K > 0:         # q_a quantized for q_b's fp8 GEMM
            quantize_row(y.to(tl.float32), qq_ptr + t.to(tl.int64) * NQ,
                         qs_ptr + t.to(tl.int64) * QG, oq, mq, QG, QUANT_K, BLOCK_Q,
                         NATIVE_CAST)
